"""A Notion-like source and workload: blocks, spaces and permissions in sharded schemas.

Shape of the changes, after Notion's published figures: about 90% updates, recent blocks far
more likely to change than old ones, 8% inserts, 2% deletes, some keys changed several
times per interval, most updates leaving the long (TOASTed) content untouched, a rare
primary-key change, and now and then an added column. Blocks form trees: a root page every
200 blocks of a shard, 0-30 levels deep below it (Notion's run "from a few to dozens"), for the
derived block tree (docs/derived-trees.md). The trees stay whole, as the product keeps them: a
block is deleted with its subtree, a new block's parent exists (else it starts a page), and a
block whose key changes takes its children along. Used by the demo, the tests and the
benchmarks; the random choices are seeded.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from cdc_lakehouse.identifiers import pg_ident, pg_qualified

BLOCK_TYPES = ["page", "text", "to_do", "heading", "bulleted_list", "image", "code", "toggle"]
ID_STRIDE = 1_000_000_000  # shard n owns ids [n * stride, (n + 1) * stride)


def schema_sql(schema: str) -> list[str]:
    s = pg_ident(schema)
    return [
        f"CREATE SCHEMA IF NOT EXISTS {s}",
        f"""CREATE TABLE IF NOT EXISTS {s}.space (
            id bigint PRIMARY KEY, name varchar(200) NOT NULL, plan text NOT NULL DEFAULT 'free',
            created_at timestamptz NOT NULL DEFAULT now(), updated_at timestamptz NOT NULL DEFAULT now())""",
        f"""CREATE TABLE IF NOT EXISTS {s}.block (
            id bigint PRIMARY KEY, space_id bigint NOT NULL, parent_id bigint, type varchar(32) NOT NULL,
            properties jsonb NOT NULL DEFAULT '{{}}', content text, created_at timestamptz NOT NULL,
            updated_at timestamptz NOT NULL, is_archived boolean NOT NULL DEFAULT false,
            version integer NOT NULL DEFAULT 1, tags text[], score numeric(12,4), created_day date,
            external_id uuid)""",
        # Long content goes out of line uncompressed: updates that leave it alone arrive as
        # pgoutput's "unchanged TOAST" values, as they do for Notion's long blocks.
        f"ALTER TABLE {s}.block ALTER COLUMN content SET STORAGE EXTERNAL",
        # Deletes take a block's subtree with it (_step_deletes): its children are found by parent.
        f"CREATE INDEX IF NOT EXISTS block_parent_id_idx ON {s}.block (parent_id)",
        f"""CREATE TABLE IF NOT EXISTS {s}.permission (
            block_id bigint NOT NULL, user_id bigint NOT NULL, role text NOT NULL,
            granted_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (block_id, user_id))""",
    ]


def _content(long_share: float = 0.25) -> str:
    # ~3 KB of md5 text for a quarter of the blocks (TOASTed), a short line otherwise.
    return (
        f"CASE WHEN random() < {long_share} THEN (SELECT string_agg(md5(random()::text || g::text), ' ') "
        "FROM generate_series(1, 90) g) ELSE 'line ' || md5(random()::text) END"
    )


PAGE_GROUP = 200  # blocks per root page
# A delete takes the block's subtree along; a pick whose subtree is larger (most of a page) is
# spared, so deletes stay near 2% of the changes.
SUBTREE_MAX = 20


def _parent_sql(g: str, base: int = 0) -> str:
    """parent_id of block `base + g`: a root page (NULL) every PAGE_GROUP ids, below it chains
    stepping back 1-7 ids, never past the group's root. Notion's trees run "from a few to dozens"
    deep; this gives 0-30 (about 15 on average) whatever the table's size. ID_STRIDE is a
    multiple of PAGE_GROUP, so roots fall on the same ids whether g is shard-local or global."""
    root = f"{g} - ({g} - 1) %% {PAGE_GROUP}"
    offset = f"{base} + " if base else ""
    return f"CASE WHEN ({g} - 1) %% {PAGE_GROUP} <> 0 THEN {offset}greatest({root}, {g} - 1 - {g} %% 7) END"


@dataclass
class NotionWorkload:
    dsn: str
    schemas: list[str]
    seed: int = 0
    long_content_share: float = 0.25
    next_id: dict[str, int] = field(default_factory=dict)
    first_id: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _connect(self):
        import psycopg2

        conn = psycopg2.connect(self.dsn)
        conn.autocommit = False
        return conn

    def create(self, drop: bool = False) -> None:
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                for s in self.schemas:
                    if drop:
                        cur.execute(f"DROP SCHEMA IF EXISTS {pg_ident(s)} CASCADE")
                    for stmt in schema_sql(s):
                        cur.execute(stmt)
            conn.commit()
        finally:
            conn.close()

    def shard_no(self, schema: str) -> int:
        return self.schemas.index(schema) + 1

    def load(self, blocks_per_shard: int, spaces_per_shard: int = 10, perms_per_block: float = 0.2) -> None:
        """Initial rows, generated inside PostgreSQL (fast even for millions of rows)."""
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                for s in self.schemas:
                    base = self.shard_no(s) * ID_STRIDE
                    t = lambda name, s=s: pg_qualified(s, name)  # noqa: E731
                    cur.execute(
                        f"INSERT INTO {t('space')} (id, name, plan) SELECT {base} + g, 'space ' || g, "
                        f"(ARRAY['free','plus','business'])[1 + g %% 3] FROM generate_series(1, %s) g "
                        "ON CONFLICT DO NOTHING",
                        (spaces_per_shard,),
                    )
                    cur.execute(
                        f"INSERT INTO {t('block')} (id, space_id, parent_id, type, properties, content, created_at, "
                        "updated_at, version, tags, score, created_day, external_id) "
                        f"SELECT {base} + g, {base} + 1 + g %% %s, {_parent_sql('g', base)}, "
                        "(ARRAY['page','text','to_do','heading'])[1 + g %% 4], "
                        "jsonb_build_object('title', 'block ' || g, 'checked', g %% 2 = 0), "
                        f"{_content(self.long_content_share)}, now() - make_interval(secs => (%s - g)), "
                        "now() - make_interval(secs => (%s - g)), 1, ARRAY['t' || (g %% 5), 'x'], (g %% 1000) / 7.0, "
                        "(now() - make_interval(secs => (%s - g)))::date, md5(g::text)::uuid "
                        "FROM generate_series(1, %s) g ON CONFLICT DO NOTHING",
                        (spaces_per_shard, blocks_per_shard, blocks_per_shard, blocks_per_shard, blocks_per_shard),
                    )
                    cur.execute(
                        f"INSERT INTO {t('permission')} (block_id, user_id, role) SELECT {base} + g, "
                        "1 + (g %% 50), (ARRAY['read','edit','full'])[1 + g %% 3] FROM generate_series(1, %s) g "
                        f"WHERE g %% {max(1, int(1 / perms_per_block))} = 0 ON CONFLICT DO NOTHING",
                        (blocks_per_shard,),
                    )
                    self.first_id[s] = base + 1
                    self.next_id[s] = base + blocks_per_shard + 1
            conn.commit()
        finally:
            conn.close()

    def sync_ids(self) -> None:
        """Pick up the id ranges of an existing source (e.g. after a restart of the demo)."""
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                for s in self.schemas:
                    cur.execute(f"SELECT min(id), max(id) FROM {pg_qualified(s, 'block')}")
                    lo, hi = cur.fetchone()
                    base = self.shard_no(s) * ID_STRIDE
                    self.first_id[s] = lo or base + 1
                    self.next_id[s] = (hi or base) + 1
            conn.commit()
        finally:
            conn.close()

    def _recent_ids(self, schema: str, n: int) -> list[int]:
        """Recency skew: 80% of picks among the newest 10% of blocks, 20% anywhere."""
        lo, hi = self.first_id[schema], self.next_id[schema] - 1
        span = max(1, hi - lo + 1)
        hot_lo = hi - max(1, span // 10) + 1
        return [self.rng.randint(hot_lo, hi) if self.rng.random() < 0.8 else self.rng.randint(lo, hi) for _ in range(n)]

    def step(self, changes: int, *, chunk: int = 500, pk_changes: int = 0, toast_share: float = 0.9) -> Counter:
        """About `changes` row changes across the shards: 90% updates, 8% inserts, 2% deletes."""
        counts: Counter = Counter()
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                per_shard = max(1, changes // len(self.schemas))
                for s in self.schemas:
                    n_ins = max(1, int(per_shard * 0.08))
                    n_del = max(1, int(per_shard * 0.02))
                    n_upd = max(1, per_shard - n_ins - n_del)
                    self._step_inserts(conn, cur, s, n_ins, counts)
                    self._step_updates(conn, cur, s, n_upd, chunk, toast_share, counts)
                    self._step_deletes(conn, cur, s, n_del, counts)
                    self._step_key_changes(conn, cur, s, pk_changes, counts)
                    if self.rng.random() < 0.3:
                        self._step_space_update(conn, cur, s, counts)
        finally:
            conn.close()
        return counts

    def _step_inserts(self, conn, cur, s: str, n_ins: int, counts: Counter) -> None:
        start = self.next_id[s]
        block = pg_qualified(s, "block")
        # The parent by the tree's id arithmetic, when it exists (inserted now, or still there);
        # else the new block starts a page of its own, as a user's new block never hangs in the air.
        cur.execute(
            f"INSERT INTO {block} (id, space_id, parent_id, type, properties, content, created_at, "
            "updated_at, tags, score, created_day, external_id) "
            f"SELECT g, {self.shard_no(s) * ID_STRIDE} + 1 + g %% 10, "
            f"CASE WHEN p >= %s OR EXISTS (SELECT 1 FROM {block} x WHERE x.id = p) THEN p END, "
            "(ARRAY['page','text','to_do','code'])[1 + g %% 4], jsonb_build_object('title', 'new ' || g), "
            f"{_content(self.long_content_share)}, now(), now(), ARRAY['new'], g %% 100, current_date, "
            f"gen_random_uuid() FROM (SELECT g, {_parent_sql('g')} AS p FROM generate_series(%s, %s) g) n",
            (start, start, start + n_ins - 1),
        )
        cur.execute(
            f"INSERT INTO {pg_qualified(s, 'permission')} (block_id, user_id, role) SELECT g, 1 + g %% 50, 'edit' "
            "FROM generate_series(%s, %s) g WHERE g %% 4 = 0 ON CONFLICT DO NOTHING",
            (start, start + n_ins - 1),
        )
        self.next_id[s] = start + n_ins
        counts["insert"] += n_ins
        conn.commit()

    def _step_updates(self, conn, cur, s: str, n_upd: int, chunk: int, toast_share: float, counts: Counter) -> None:
        ids = self._recent_ids(s, n_upd)
        for i in range(0, len(ids), chunk):
            part = ids[i : i + chunk]
            if self.rng.random() < toast_share:
                # Content untouched: its TOASTed value is not re-sent.
                cur.execute(
                    f"UPDATE {pg_qualified(s, 'block')} SET properties = properties || jsonb_build_object('rev', "
                    "version + 1), updated_at = now(), version = version + 1, "
                    "is_archived = (random() < 0.05) WHERE id = ANY(%s)",
                    (part,),
                )
            else:
                cur.execute(
                    f"UPDATE {pg_qualified(s, 'block')} SET content = {_content(self.long_content_share)}, "
                    "updated_at = now(), version = version + 1, score = score + 1 "
                    "WHERE id = ANY(%s)",
                    (part,),
                )
            counts["update"] += cur.rowcount
            conn.commit()

    def _step_deletes(self, conn, cur, s: str, n_del: int, counts: Counter) -> None:
        """Blocks deleted the way users delete them: each with its whole subtree (a page with its
        content, a toggle with its lines, a leaf alone), never leaving a child without its parent.
        A pick whose subtree is over SUBTREE_MAX blocks is spared."""
        lo = self.first_id[s]
        picks = [self.rng.randint(lo, self.next_id[s] - 1) for _ in range(n_del)]
        block = pg_qualified(s, "block")
        cur.execute(
            f"""WITH RECURSIVE sub(top, id) AS (
                    SELECT id, id FROM {block} WHERE id = ANY(%s)
                    UNION SELECT sub.top, b.id FROM {block} b JOIN sub ON b.parent_id = sub.id)
                SELECT DISTINCT id FROM sub WHERE top IN (SELECT top FROM sub GROUP BY top HAVING count(*) <= %s)""",
            (picks, SUBTREE_MAX),
        )
        dels = [r[0] for r in cur.fetchall()]
        cur.execute(f"DELETE FROM {pg_qualified(s, 'permission')} WHERE block_id = ANY(%s)", (dels,))
        cur.execute(f"DELETE FROM {block} WHERE id = ANY(%s)", (dels,))
        counts["delete"] += cur.rowcount
        conn.commit()

    def _step_key_changes(self, conn, cur, s: str, pk_changes: int, counts: Counter) -> None:
        """A block moved to a new key, its children along (their parent_id follows it)."""
        block = pg_qualified(s, "block")
        for _ in range(pk_changes):
            old = self._recent_ids(s, 1)[0]
            new = self.next_id[s]
            self.next_id[s] += 1
            cur.execute(
                f"UPDATE {block} SET id = %s WHERE id = %s AND NOT EXISTS "
                f"(SELECT 1 FROM {pg_qualified(s, 'permission')} WHERE block_id = %s)",
                (new, old, old),
            )
            moved = cur.rowcount
            if moved:
                cur.execute(f"UPDATE {block} SET parent_id = %s WHERE parent_id = %s", (new, old))
            counts["pk_change"] += moved
            conn.commit()

    def _step_space_update(self, conn, cur, s: str, counts: Counter) -> None:
        sp = self.shard_no(s) * ID_STRIDE + 1 + self.rng.randint(0, 9)
        cur.execute(
            f"UPDATE {pg_qualified(s, 'space')} SET updated_at = now(), plan = (ARRAY['free','plus',"
            "'business'])[1 + floor(random() * 3)::int] WHERE id = %s",
            (sp,),
        )
        counts["space_update"] += cur.rowcount
        conn.commit()

    def add_column(self, name: str, typ: str = "text", table: str = "block") -> None:
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                for s in self.schemas:
                    cur.execute(f"ALTER TABLE {pg_qualified(s, table)} ADD COLUMN IF NOT EXISTS {pg_ident(name)} {typ}")
            conn.commit()
        finally:
            conn.close()

    def row_counts(self, table: str = "block") -> dict[str, int]:
        conn = self._connect()
        try:
            with conn.cursor() as cur:
                out = {}
                for s in self.schemas:
                    cur.execute(f"SELECT count(*) FROM {pg_qualified(s, table)}")
                    out[s] = cur.fetchone()[0]
            conn.commit()
            return out
        finally:
            conn.close()
