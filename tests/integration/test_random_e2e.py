"""Seeded randomized end to end: two source servers -> capture -> landing -> ingest -> lake, and after
every batch the lake equals both sources exactly (every row, every column) and the audit agrees.

What it proves, for the seed of the run (CDC_RANDOM_SEED, default DEFAULT_SEED; printed, and part of
every assertion message, so a failure replays with the same seed):
  - one table sharded over two PostgreSQL servers (schemas s0, s1 on server A, s2 on server B), with
    a text column stored out of line (TOAST, STORAGE EXTERNAL) and typed columns (bigint, int,
    numeric(12,2), timestamptz, boolean, text[]), is bootstrapped while changes are being made and
    then follows the sources through random batches of transactions on both servers: updates with
    recency skew (most changes), inserts, deletes, primary-key changes (chains too, and moves onto
    freed keys), updates that leave the TOASTed column alone (pgoutput sends no value for it) and
    updates that change it, delete and re-insert of a key in one batch, bulk updates, a TRUNCATE of
    one shard, overlapping transactions on one server, transactions committing while a capture
    runs, and one added column rolled out to every shard and then used;
  - a capture or an ingest killed at one of its failpoints (a subprocess that exits as kill -9
    would) leaves a state from which the ordinary retry converges, also when the retry comes only
    after more changes and another capture run;
  - the full audit reports no missing, extra or different key when the lake equals the source,
    flags the keys when it does not, and counts the keys of a lagging lake as in flight only;
  - maintenance (compaction, expiry, latest view, landing retention) run while capture runs are
    pending, or right after a killed ingest, does not disturb what follows.
The expected side is always read back from the sources (tests.helpers.source_df), never from a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from functools import partial, reduce
from typing import Any

import psycopg2
import pytest
import yaml
from cdc_lakehouse.audit.audit_table import audit_table
from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
from cdc_lakehouse.capture.capture_run import capture_run
from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.ingest.ingest_table import IngestResult, ingest_table
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.landing.format import manifest_path
from cdc_lakehouse.landing.stores import LocalLanding
from cdc_lakehouse.maintenance.maintain_table import maintain_table
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.views.latest import latest_rows
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from tests.conftest import ROOT, make_config
from tests.helpers import landed_rows, source_df

DEFAULT_SEED = 22
SEED = int(os.environ.get("CDC_RANDOM_SEED") or DEFAULT_SEED)
BATCHES = int(os.environ.get("CDC_RANDOM_BATCHES") or 7)
TABLE = "doc"
DDL = (
    "CREATE TABLE {s}.doc (id bigint PRIMARY KEY, n integer, amount numeric(12,2), at timestamptz, "
    "flag boolean, tags text[], body text)"
)
# Array elements that need quoting or escaping in PostgreSQL's array text (and a NULL element).
TAG_POOL = ["a", "b,c", 'q"x', "", "NULL", None, "é☃", " sp ", "{br}", "back\\slash"]
INGEST_POINTS = ["ingest_before_changelog", "ingest_after_changelog", "ingest_after_merge"]
CAPTURE_POINTS = ["after_files", "after_manifest"]
# A capture in a child process: capture has no Spark, so killing it costs about a second.
CAPTURE_CHILD = (
    "import json, sys\n"
    "from cdc_lakehouse.capture.capture_run import capture_run\n"
    "from cdc_lakehouse.landing.stores import LocalLanding\n"
    "from cdc_lakehouse.source.catalog import EndpointTables\n"
    "a = json.loads(sys.argv[1])\n"
    "capture_run(EndpointTables(a['endpoint'], a['conn_id'], a['tables']), a['dsn'], LocalLanding(a['landing']), "
    "a['run_id'])\n"
)


@pytest.fixture(scope="module")
def pg_b(tmp_root):
    """Server B: a second cluster of its own (LocalPostgres sets wal_level=logical)."""
    from devstack.localstack import LocalPostgres, free_port

    server = LocalPostgres(tmp_root / "pg_rand_b", free_port(), fast=True)
    server.init()
    server.start()
    yield server
    server.destroy()


@dataclass
class Server:
    """One source endpoint: a database on one server, holding some of the shard schemas."""

    name: str
    pg: Any
    conn_id: str
    db: str
    schemas: list[str]
    endpoint_id: str = ""

    @property
    def dsn(self) -> str:
        return self.pg.dsn(self.db)

    def tables(self) -> dict[str, tuple[list[str], list[str]]]:
        return {TABLE: (self.schemas, ["id"])}

    def endpoint(self) -> EndpointTables:
        return EndpointTables(self.endpoint_id, self.conn_id, self.tables())


class RandomSource:
    """Random, seeded changes to the sources. It tracks only which keys exist (to pick valid
    operations); the expected lake is always read back from the sources themselves."""

    def __init__(self, rng: random.Random, servers: list[Server]):
        self.rng = rng
        self.servers = servers
        self.shards = [s for srv in servers for s in srv.schemas]
        self.server_of = {s: srv for srv in servers for s in srv.schemas}
        self.keys: dict[str, set[int]] = {s: set() for s in self.shards}
        self.freed: dict[str, list[int]] = {s: [] for s in self.shards}
        self.hot: dict[str, list[int]] = {s: [] for s in self.shards}
        self.next_id = dict.fromkeys(self.shards, 1)
        self.has_note = False
        # Two connections per server: transactions on one server can overlap (commit order is not
        # begin order; the slot delivers in commit order).
        self.conns = {srv.name: [psycopg2.connect(srv.dsn) for _ in range(2)] for srv in servers}
        self.sql: list[str] = []  # the current batch as replayable SQL (for a failure's reproduction)
        self.ops: list[str] = []  # ... and as short descriptions
        self.counts: Counter = Counter()

    def close(self) -> None:
        for conns in self.conns.values():
            for c in conns:
                c.close()

    # --- values ------------------------------------------------------------------------------------
    def body(self) -> str | None:
        r = self.rng.random()
        if r < 0.6:
            # > 2.5 kB of md5 text: out of line (STORAGE EXTERNAL: no compression), so an update that
            # leaves it alone arrives as "unchanged TOAST"; now and then ~23 kB (many TOAST chunks).
            n = self.rng.randint(80, 140) if self.rng.random() < 0.9 else 700
            seed = self.rng.getrandbits(64)
            return " ".join(hashlib.md5(f"{seed}:{i}".encode()).hexdigest() for i in range(n))
        if r < 0.9:
            return f"short {self.rng.getrandbits(32):08x} ünï"  # stays inline: always sent
        return None

    def values(self) -> dict[str, Any]:
        rng = self.rng
        tz = timezone(timedelta(minutes=rng.choice([0, 0, 330, -480, 60])))
        v = {
            "n": rng.choice([None, rng.randint(-(2**31), 2**31 - 1), rng.randint(0, 99)]),
            "amount": None if rng.random() < 0.1 else Decimal(rng.randint(-(10**12) + 1, 10**12 - 1)).scaleb(-2),
            "at": None
            if rng.random() < 0.1
            else (datetime(2020, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randint(0, 10**15))).astimezone(tz),
            "flag": rng.choice([True, False, None]),
            "tags": None if rng.random() < 0.15 else [rng.choice(TAG_POOL) for _ in range(rng.randint(0, 4))],
        }
        if self.has_note:
            v["note"] = rng.choice([None, f"note {rng.randint(0, 999)}", "ünïcode ✓"])
        return v

    # --- statements ---------------------------------------------------------------------------------
    def _exec(self, conn, shard: str, what: str, sql: str, params=()) -> int:
        with conn.cursor() as cur:
            text = cur.mogrify(sql, params).decode()
            cur.execute(text)
            n = cur.rowcount
        self.sql.append(f"{text};  -- {self.server_of[shard].name}")
        self.ops.append(f"{shard} {what}")
        self.counts[what.split(maxsplit=1)[0]] += 1
        return n

    def _commit(self, conn) -> None:
        conn.commit()
        self.sql.append("COMMIT;")

    def pick(self, s: str) -> int:
        """Recency skew: mostly one of the keys touched last, otherwise any key."""
        keys = self.keys[s]
        hot = [k for k in self.hot[s][-20:] if k in keys]
        if hot and self.rng.random() < 0.8:
            return self.rng.choice(hot)
        return self.rng.choice(sorted(keys))

    def new_id(self, s: str) -> int:
        free = [k for k in self.freed[s][-30:] if k not in self.keys[s]]
        if free and self.rng.random() < 0.3:
            return self.rng.choice(free)  # reuse a deleted (or moved-away) key
        self.next_id[s] += self.rng.randint(1, 3)
        return self.next_id[s]

    def insert(self, conn, s: str, k: int | None = None, body: Any = ...) -> None:
        k = self.new_id(s) if k is None else k
        v = {"id": k, **self.values(), "body": self.body() if body is ... else body}
        cols = ", ".join(v)
        self._exec(
            conn,
            s,
            f"insert {k}",
            f"INSERT INTO {s}.doc ({cols}) VALUES ({', '.join(['%s'] * len(v))})",
            list(v.values()),
        )
        self.keys[s].add(k)
        self.hot[s].append(k)

    def update_meta(self, conn, s: str, k: int | None = None) -> None:
        """Columns other than the TOASTed one: pgoutput sends the body as unchanged TOAST."""
        k = self.pick(s) if k is None else k
        v = self.values()
        cols = self.rng.sample(sorted(v), self.rng.randint(1, len(v)))
        sets = ", ".join(f"{c} = %s" for c in cols)
        self._exec(
            conn,
            s,
            f"update {k} {','.join(cols)}",
            f"UPDATE {s}.doc SET {sets} WHERE id = %s",
            [v[c] for c in cols] + [k],
        )
        self.hot[s].append(k)

    def update_body(self, conn, s: str) -> None:
        k = self.pick(s)
        v = self.values()
        extra = self.rng.sample(sorted(v), self.rng.randint(0, 2))
        sets = ", ".join(["body = %s", *[f"{c} = %s" for c in extra]])
        self._exec(
            conn,
            s,
            f"update {k} body,{','.join(extra)}",
            f"UPDATE {s}.doc SET {sets} WHERE id = %s",
            [self.body(), *[v[c] for c in extra], k],
        )
        self.hot[s].append(k)

    def delete(self, conn, s: str, k: int | None = None) -> None:
        k = self.pick(s) if k is None else k
        self._exec(conn, s, f"delete {k}", f"DELETE FROM {s}.doc WHERE id = %s", [k])
        self.keys[s].discard(k)
        self.freed[s].append(k)

    def pk_change(self, conn, s: str) -> None:
        old, new = self.pick(s), self.new_id(s)
        also = self.rng.random() < 0.3  # a key change that also changes a column
        sql = f"UPDATE {s}.doc SET id = %s{', n = %s' if also else ''} WHERE id = %s"
        self._exec(conn, s, f"pkchange {old}->{new}", sql, [new, *([self.rng.randint(0, 99)] if also else []), old])
        self.keys[s].discard(old)
        self.freed[s].append(old)
        self.keys[s].add(new)
        self.hot[s].append(new)
        if self.rng.random() < 0.3:
            self.update_meta(conn, s, new)  # the new key, TOAST unchanged: its value comes from the old key

    def delete_reinsert(self, conn, s: str) -> None:
        k = self.pick(s)
        self.delete(conn, s, k)
        self.insert(conn, s, k)
        if self.rng.random() < 0.5:
            self.update_meta(conn, s, k)  # must take the re-inserted body, never the deleted row's

    def bulk_update(self, conn, s: str) -> None:
        r = self.rng.randint(0, 6)
        self._exec(
            conn, s, f"bulk id%7={r}", f"UPDATE {s}.doc SET flag = NOT coalesce(flag, false) WHERE id %% 7 = %s", [r]
        )

    def truncate(self, conn, s: str) -> None:
        self._exec(conn, s, "truncate", f"TRUNCATE {s}.doc")
        self.freed[s].extend(sorted(self.keys[s]))
        self.keys[s].clear()
        for _ in range(self.rng.randint(0, 4)):
            self.insert(conn, s)  # same transaction, after the truncate (freed keys come back too)

    OPS = (
        ("update_meta", 55),
        ("update_body", 20),
        ("insert", 10),
        ("delete", 5),
        ("pk_change", 4),
        ("delete_reinsert", 4),
        ("bulk_update", 1),
    )

    def op(self, conn, s: str) -> None:
        if len(self.keys[s]) < 5:
            self.insert(conn, s)
            return
        name = self.rng.choices([o for o, _ in self.OPS], weights=[w for _, w in self.OPS])[0]
        getattr(self, name)(conn, s)

    # --- batches -----------------------------------------------------------------------------------
    def load(self, rows: int) -> None:
        for srv in self.servers:
            conn = self.conns[srv.name][0]
            for s in srv.schemas:
                for _ in range(rows):
                    self.insert(conn, s)
            self._commit(conn)

    def batch(self, n_ops: int, *, truncate: bool = False, pause: float = 0.0) -> None:
        """About n_ops changes in transactions of 1-20 statements, spread over both servers."""
        rng = self.rng
        truncate_at = rng.randint(0, n_ops) if truncate else None
        done = 0
        while done < n_ops:
            time.sleep(pause)
            srv = rng.choices(self.servers, weights=[len(x.schemas) for x in self.servers])[0]
            size = rng.choice([1, 1, 2, 3, 5, 8, 20])
            c1, c2 = self.conns[srv.name]
            if len(srv.schemas) > 1 and rng.random() < 0.25:
                # Overlapping transactions on one server, on different shards (no lock waits): the
                # first one begins first and commits last.
                s1, s2 = rng.sample(srv.schemas, 2)
                for _ in range(size):
                    self.op(c1, s1)
                for _ in range(size):
                    self.op(c2, s2)
                self._commit(c2)
                self.op(c1, s1)
                self._commit(c1)
                done += 2 * size + 1
                continue
            for _ in range(size):
                s = rng.choice(srv.schemas)
                if truncate_at is not None and done >= truncate_at:
                    self.truncate(c1, s)
                    truncate_at = None
                self.op(c1, s)
                done += 1
            self._commit(c1)

    def add_note_column(self) -> None:
        """The schema change: a column added on every shard; the random operations use it later."""
        for srv in self.servers:
            conn = self.conns[srv.name][0]
            for s in srv.schemas:
                self._exec(conn, s, "alter add note", f"ALTER TABLE {s}.doc ADD COLUMN note varchar(40)")
            self._commit(conn)
        self.has_note = True
        # No write follows on purpose: a shard that stays quiet after the ALTER still shows its older
        # schema in the manifests, which once read as a dropped column (a false SchemaChangeError).


# --- the lake against the sources ----------------------------------------------------------------------


def only_group(cfg, i: int):
    """The table config restricted to shard group i (source_df reads one server)."""
    return cfg.model_copy(update={"source": cfg.source.model_copy(update={"shards": [cfg.source.shards[i]]})})


def expected_rows(spark, cfg, servers: list[Server], columns):
    frames = [source_df(spark, only_group(cfg, i), srv.dsn, columns) for i, srv in enumerate(servers)]
    return reduce(lambda a, b: a.unionByName(b), frames)


def describe_diff(actual, expected, key: list[str], names: list[str], limit: int = 8) -> str:
    """A short account of how two frames differ: per key missing / extra / which columns differ."""
    others = [c for c in names if c not in key]
    e = expected.select(*key, F.lit(True).alias("_e"), *[F.col(c).alias(f"e_{c}") for c in others])
    a = actual.select(*key, F.lit(True).alias("_a"), *[F.col(c).alias(f"a_{c}") for c in others])
    j = e.join(a, key, "full_outer")
    differing = F.concat_ws(",", *[F.when(~F.col(f"e_{c}").eqNullSafe(F.col(f"a_{c}")), F.lit(c)) for c in others])
    kind = (
        F.when(F.col("_a").isNull(), F.lit("missing"))
        .when(F.col("_e").isNull(), F.lit("extra"))
        .otherwise(F.concat(F.lit("different:"), differing))
    )
    d = j.select(*key, kind.alias("kind")).filter(F.col("kind") != "different:").cache()
    counts = {r["k"]: r["count"] for r in d.groupBy(F.split("kind", ":")[0].alias("k")).count().collect()}
    sample = [f"{r[SHARD_COL]}/{r['id']}: {r['kind']}" for r in d.orderBy(*key).limit(limit).collect()]
    d.unpersist()
    dup = actual.count() - actual.select(*key).distinct().count()
    return f"{counts or 'no per-key difference'}; duplicate keys in the lake: {dup}; first: {sample}"


def lake_problems(spark, lake, cfg, servers: list[Server]) -> list[str]:
    """Differences between the lake (current table, and latest-per-key over the changelog) and the sources."""
    cur = lake.qualified(cfg.current_table)
    spark.sql(f"REFRESH TABLE {cur}")
    spark.sql(f"REFRESH TABLE {lake.qualified(cfg.changelog_table)}")
    columns = source_columns_of(spark, cur, cfg)
    names = [c for c, _ in columns]
    expected = expected_rows(spark, cfg, servers, columns).cache()
    problems = []
    for what, table in (("current table", spark.table(cur)), ("changelog latest", latest_rows(spark, lake, cfg))):
        actual = table.select(SHARD_COL, *names)
        try:
            assertDataFrameEqual(actual, expected)
        except AssertionError:
            problems.append(f"{what}: " + describe_diff(actual, expected, [SHARD_COL, "id"], names))
    expected.unpersist()
    return problems


def landed_cases(store: LocalLanding, servers: list[Server]) -> Counter:
    """What kinds of events the capture landed, from the landing files."""

    seen: Counter = Counter()
    for srv in servers:
        for f in sorted((store.root / srv.endpoint_id / TABLE).glob("run=*/*.parquet")):
            for e in landed_rows(f):
                before, after = dict(e["before"] or []), dict(e["after"] or [])
                unchanged = "body" in (e["unavailable"] or [])
                seen[{"c": "insert", "u": "update", "d": "delete", "t": "truncate"}[e["op"]]] += 1
                seen["unchanged_toast"] += unchanged
                moved = e["op"] == "u" and "id" in before and before["id"] != after.get("id")
                seen["pk_change"] += moved
                seen["pk_change_unchanged_toast"] += moved and unchanged
                seen["note"] += after.get("note") is not None
    return seen


@pytest.mark.slow
def test_random_batches_on_two_servers_converge_exactly(pg, pg_b, spark, lake, unique, monkeypatch, tmp_path):
    seed = SEED
    rng = random.Random(seed)
    print(f"\nrandom e2e: seed {seed} (rerun with CDC_RANDOM_SEED={seed}), {BATCHES} batches")
    t_start = time.time()
    servers = [
        Server("A", pg, "cdc_rand_a", f"rnda_{unique}", ["s0", "s1"]),
        Server("B", pg_b, "cdc_rand_b", f"rndb_{unique}", ["s2"]),
    ]
    for srv in servers:
        srv.pg.execute(f"CREATE DATABASE {srv.db}")
        monkeypatch.setenv(f"AIRFLOW_CONN_{srv.conn_id.upper()}", srv.pg.uri(srv.db))
        conn = psycopg2.connect(srv.dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            for s in srv.schemas:
                cur.execute(f"CREATE SCHEMA {s}")
                cur.execute(DDL.format(s=s))
                cur.execute(f"ALTER TABLE {s}.doc ALTER COLUMN body SET STORAGE EXTERNAL")
        conn.close()
    groups = [{"conn_id": srv.conn_id, "database": srv.db, "schemas": srv.schemas} for srv in servers]
    cfg = make_config(f"rnd_{unique}", [], table=TABLE, source={"table": TABLE, "shards": groups})
    for srv, g in zip(servers, cfg.source.shards):
        srv.endpoint_id = g.endpoint_id
    conf_dir = tmp_path / "tables"
    conf_dir.mkdir()
    (conf_dir / f"{cfg.name}.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    store = LocalLanding(lake.landing_uri)
    src = RandomSource(rng, servers)
    runs = 0
    timings: Counter = Counter()

    def ctx(what: str) -> str:
        return f"seed {seed} (CDC_RANDOM_SEED={seed}), {what}"

    def next_run() -> str:
        nonlocal runs
        runs += 1
        return f"20260101T{runs:06d}Z"  # run ids sort in capture order

    def capture(run_id: str, only: list[Server] | None = None) -> None:
        t = time.time()
        for srv in only or servers:
            capture_run(srv.endpoint(), srv.dsn, store, run_id)
        timings["capture"] += time.time() - t

    def alongside(changes, job) -> None:
        """Run job while the changes are made in another thread."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                changes()
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        try:
            job()
        finally:
            thread.join()
        if errors:
            raise errors[0]

    def killed(args: list[str], point: str, what: str) -> None:
        env = {
            **os.environ,
            "CDC_TEST_CRASH_AT": point,
            "PYTHONPATH": str(ROOT / "plugins"),
            "CDC_CATALOG_PASSWORD": "",
            "CDC_SPARK_DRIVER_MEMORY": "1g",
            "CDC_SPARK_MASTER": "local[2]",
        }
        t = time.time()
        r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
        timings["killed jobs"] += time.time() - t
        assert r.returncode == 137, ctx(
            f"{what}: expected the failpoint {point} to kill the job, got exit "
            f"{r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        )

    def ingest(run_id: str, name: str) -> IngestResult:
        t = time.time()
        m = ingest_table(spark, lake, cfg, upto_run=run_id, ingest_run=name)
        timings["ingest"] += time.time() - t
        assert m.metrics.status == "ok" and m.metrics.quarantined == 0, ctx(f"{name}: {m}")
        return m

    def check(what: str) -> None:
        t = time.time()
        problems = lake_problems(spark, lake, cfg, servers)
        timings["compare"] += time.time() - t
        t = time.time()
        audit = audit_table(spark, lake, cfg, audit_run=f"audit-{unique}-{what}", mode="full")
        timings["audit"] += time.time() - t
        flagged = {
            shard: {k: st.get(k, 0) for k in ("missing", "extra", "different", "in_flight") if st.get(k)}
            for shard, st in audit.shards.items()
        }
        flagged = {k: v for k, v in flagged.items() if v}
        # The audit must agree with the exact comparison either way: silent when they are equal,
        # reporting the keys when they are not.
        if problems:
            assert flagged, ctx(f"{what}: the lake differs from the source but the audit saw nothing: {problems}")
            sql_file = tmp_path / f"failed-{what}.sql"
            sql_file.write_text("\n".join(src.sql))
            pytest.fail(
                ctx(
                    f"{what}: lake != source: {problems}; audit {flagged}; all SQL so far: {sql_file}; "
                    f"last ops: {src.ops[-30:]}"
                )
            )
        assert audit.verdict == "ok" and not flagged, ctx(
            f"{what}: lake == source but audit {flagged}: {audit.message}"
        )

    # The schedule, drawn from the seed: where the schema change, maintenance and the kills go.
    batches = list(range(1, BATCHES + 1))
    note_batch = rng.choice(batches[1:-1])
    truncate_batch = rng.choice(batches)  # at least one TRUNCATE, whatever the seed
    lag_batch = rng.choice(batches[:-1])  # one audit while the lake lags behind
    maintenance_batches = set(rng.sample(batches[1:], 1 if BATCHES < 6 else 2))
    ingest_kills = dict(zip(rng.sample(batches, 2), rng.sample(INGEST_POINTS, 2)))
    capture_kills = {b: (rng.choice(servers), rng.choice(CAPTURE_POINTS)) for b in rng.sample(batches, min(2, BATCHES))}
    kills = {b: (srv.name, point) for b, (srv, point) in capture_kills.items()}
    print(
        f"schedule: add column in batch {note_batch}, truncate in {truncate_batch}, lagging audit after {lag_batch}, "
        f"maintenance before {sorted(maintenance_batches)}, ingest killed {ingest_kills}, capture killed {kills}"
    )

    try:
        src.load(200)
        src.counts.clear()
        capture(next_run())  # creates the slots and publications
        src.batch(40)  # captured, but before the bootstrap's snapshot: must come through the snapshot only
        # Changes while the bootstrap runs (a fixed list, so the seed still fixes every operation;
        # only where the snapshot falls among them varies): each must arrive exactly once.
        t = time.time()
        alongside(
            lambda: src.batch(60, pause=0.3),
            lambda: bootstrap_table(
                spark,
                lake,
                cfg,
                run_id=f"b{unique}",
                all_endpoint_tables={srv.endpoint_id: srv.tables() for srv in servers},
            ),
        )
        timings["bootstrap"] += time.time() - t
        print(f"around the bootstrap: {dict(src.counts)}")
        src.counts.clear()

        for b in batches:
            src.ops = []
            src.sql.append(f"-- batch {b}")
            if b == note_batch:
                src.batch(rng.randint(20, 80))
                src.add_note_column()
            src.batch(rng.randint(100, 250), truncate=b == truncate_batch or rng.random() < 0.2)
            if rng.random() < 0.3:
                # Two capture runs in one ingest, the first while transactions commit: those after its
                # heartbeat belong to the next run, whole.
                first = next_run()
                alongside(partial(src.batch, rng.randint(20, 80), pause=0.02), partial(capture, first))
            run_id = next_run()
            if b in capture_kills:
                victim, point = capture_kills[b]
                args = {
                    "endpoint": victim.endpoint_id,
                    "conn_id": victim.conn_id,
                    "tables": victim.tables(),
                    "dsn": victim.dsn,
                    "landing": lake.landing_uri,
                    "run_id": run_id,
                }
                capture(run_id, [s for s in servers if s is not victim])
                killed([sys.executable, "-c", CAPTURE_CHILD, json.dumps(args)], point, f"batch {b} capture")
                has_manifest = store.exists(manifest_path(victim.endpoint_id, run_id))
                assert has_manifest == (point == "after_manifest"), ctx(f"batch {b}: manifest after {point}")
                more = rng.random() < 0.5
                if more:
                    src.batch(rng.randint(10, 40))  # changes between the crash and the retry
                capture(run_id, [victim])  # the retry of the same run
                if more:
                    run_id = next_run()
                    capture(run_id)
            else:
                capture(run_id)
            if b in ingest_kills:
                point = ingest_kills[b]
                killed(
                    [
                        sys.executable,
                        str(ROOT / "spark_jobs" / "ingest.py"),
                        "--tables",
                        cfg.name,
                        "--config-dir",
                        str(conf_dir),
                        "--upto-run",
                        run_id,
                    ],
                    point,
                    f"batch {b} ingest",
                )
                spark.sql(f"REFRESH TABLE {lake.qualified(cfg.current_table)}")
                assert spark.table(lake.qualified(cfg.current_table)).count() > 0, ctx(f"batch {b}: readable")
                if rng.random() < 0.5:
                    # The retry comes later and covers a newer run too (the killed run's changes may be
                    # in the changelog already, and not in the current table).
                    src.batch(rng.randint(20, 60))
                    run_id = next_run()
                    capture(run_id)
            if b in maintenance_batches:
                # With runs pending (and, after a kill, perhaps a changelog ahead of the current table).
                t = time.time()
                maintain_table(spark, lake, cfg, run_id=f"m{b}", consumers=[cfg])
                timings["maintenance"] += time.time() - t
            ingest(run_id, f"i{b}")
            print(f"batch {b}: {dict(src.counts)} (runs up to {run_id})")
            src.counts.clear()
            check(f"batch{b}")
            if b == lag_batch:
                # The lake behind the sources (changes landed but not ingested, and changes still in
                # the slot): the audit counts those keys as in flight, never as mismatches.
                src.batch(rng.randint(20, 50))
                capture(next_run())
                src.batch(rng.randint(20, 50))
                audit = audit_table(spark, lake, cfg, audit_run=f"audit-{unique}-lag", mode="full")
                wrong = {
                    sh: st
                    for sh, st in audit.shards.items()
                    if any(st.get(k) for k in ("missing", "extra", "different"))
                }
                in_flight = sum(st.get("in_flight", 0) for st in audit.shards.values())
                assert audit.verdict == "ok" and not wrong and in_flight > 0, ctx(
                    f"audit of a lagging lake after batch {b}: {audit.message}"
                )
        # The cases this test is about really happened (a silent change in the generator, or TOAST
        # no longer kicking in, would otherwise leave them untested).
        seen = landed_cases(store, servers)
        print(f"landed events: {dict(seen)}")
        for case in ("unchanged_toast", "pk_change", "pk_change_unchanged_toast", "delete", "truncate", "note"):
            assert seen[case] > 0, ctx(f"no landed event of case {case}: {dict(seen)}")
    finally:
        src.close()
        print(
            f"random e2e seed {seed}: {time.time() - t_start:.0f}s; "
            + ", ".join(f"{k} {v:.0f}s" for k, v in timings.most_common())
        )
        for srv in servers:
            if srv.pg is pg:  # server B is removed with its fixture
                for (slot,) in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{srv.db}'"):
                    pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
                pg.execute(f"DROP DATABASE {srv.db} WITH (FORCE)")
