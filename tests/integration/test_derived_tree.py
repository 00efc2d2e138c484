"""The derived block tree against real PostgreSQL, capture, ingest, Spark and Iceberg.

Every run is compared with a reference computed in Python straight from the source database:
per node its root, depth, path and effective grants (nearest explicit grant per principal wins),
or the reason it cannot be placed. Incremental runs are also compared with a full rebuild.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import psycopg2
import pytest
from cdc_lakehouse.derived.config import TreeConfig
from cdc_lakehouse.derived.derive_tree import derive_tree
from cdc_lakehouse.lake.holds import ConsumerLagError, drop_consumer

from devstack.workload import ID_STRIDE
from tests.conftest import make_config
from tests.integration.conftest import Source

GROUP = 40  # blocks per root page in the starting tree


@dataclass(frozen=True)
class Placed:
    parent: int | None
    root_id: int
    root_space_id: int
    depth: int
    path: tuple[int, ...]
    grants: tuple[tuple[str, str, int], ...]


def tree_cfg(s: Source, name: str, max_depth: int = 128) -> TreeConfig:
    return TreeConfig.model_validate(
        {
            "name": name,
            "nodes": {"table": s.block.name, "id": "id", "parent": "parent_id", "root_attribute": "space_id"},
            "grants": {"table": s.perm.name, "node": "block_id", "principal": "user_id", "grant": "role"},
            "lake": {"namespace": "derived"},
            "max_depth": max_depth,
        }
    )


def derive(s: Source, cfg: TreeConfig, **kw):
    return derive_tree(s.spark, s.lake, cfg, {s.block.name: s.block, s.perm.name: s.perm}, **kw)


def shard_of(s: Source) -> dict[str, str]:
    return {schema: shard for _, schema, shard in s.block.shards()}


def reference(s: Source, max_depth: int = 128, grants_table: str = "permission") -> tuple[dict, dict]:
    """(placed, unresolved reasons) by (shard, id), walking parent links in Python over the source."""
    return tree_of(*source_inputs(s, grants_table), max_depth)


def source_inputs(s: Source, grants_table: str = "permission") -> tuple[dict, dict]:
    """shard -> {id: (parent, space)} and (shard, node) -> {principal: role}, from the source."""
    conn = psycopg2.connect(s.dsn)
    nodes, grants = {}, {}
    with conn.cursor() as cur:
        for schema, shard in shard_of(s).items():
            cur.execute(f"SELECT id, parent_id, space_id FROM {schema}.block")
            nodes[shard] = {i: (p, sp) for i, p, sp in cur.fetchall()}
            cur.execute(f"SELECT block_id, user_id, role FROM {schema}.{grants_table}")
            for b, u, role in cur.fetchall():
                grants.setdefault((shard, b), {})[str(u)] = role
    conn.close()
    return nodes, grants


def tree_of(nodes: dict, grants: dict, max_depth: int = 128) -> tuple[dict, dict]:
    """(placed, unresolved reasons) by (shard, id) of the tree the inputs describe."""
    placed, reasons = {}, {}
    for shard, table in nodes.items():
        for node in table:
            outcome = walk(table, node)
            if isinstance(outcome, str):
                reasons[(shard, node)] = outcome
                continue
            if isinstance(outcome, int):
                other = any(outcome in t for sh, t in nodes.items() if sh != shard)
                reasons[(shard, node)] = "parent_in_other_shard" if other else "missing_parent"
                continue
            if len(outcome) > max_depth:
                reasons[(shard, node)] = "too_deep"
                continue
            placed[(shard, node)] = placement(table, grants, shard, node, outcome)
    return placed, reasons


def walk(table: dict, node: int):
    """The ancestors nearest first; the missing id if a parent is missing; 'cycle' on a loop."""
    seg, seen, cur = [], {node}, node
    while True:
        parent = table[cur][0]
        if parent is None:
            return seg
        if parent not in table:
            return parent
        if parent in seen:
            return "cycle"
        seg.append(parent)
        seen.add(parent)
        cur = parent


def placement(table: dict, grants: dict, shard: str, node: int, seg: list[int]) -> Placed:
    effective: dict[str, tuple[str, int]] = {}
    for on in [node, *seg]:
        for principal, role in grants.get((shard, on), {}).items():
            effective.setdefault(principal, (role, on))
    root = seg[-1] if seg else node
    return Placed(
        table[node][0],
        root,
        table[root][1],
        len(seg),
        tuple(reversed(seg)),
        tuple(sorted((p, r, on) for p, (r, on) in effective.items())),
    )


def lake_tree(s: Source, cfg: TreeConfig) -> tuple[dict, dict]:
    spark, lake = s.spark, s.lake
    for t in (cfg.output_table, cfg.unresolved_table):
        spark.sql(f"REFRESH TABLE {lake.qualified(t)}")
    placed = {
        (r["_cdc_shard"], r["id"]): Placed(
            r["parent_id"],
            r["root_id"],
            r["root_space_id"],
            r["depth"],
            tuple(r["path"]),
            tuple((g["principal"], g["grant"], g["granted_on"]) for g in r["grants"]),
        )
        for r in spark.table(lake.qualified(cfg.output_table)).collect()
    }
    reasons = {
        (r["_cdc_shard"], r["id"]): r["reason"] for r in spark.table(lake.qualified(cfg.unresolved_table)).collect()
    }
    return placed, reasons


def assert_tree_is_reference(s: Source, cfg: TreeConfig, want: tuple[dict, dict] | None = None) -> tuple[dict, dict]:
    got, want = lake_tree(s, cfg), want or reference(s, cfg.max_depth)
    for name, g, w in (("placed", got[0], want[0]), ("unresolved", got[1], want[1])):
        wrong = {k: (g.get(k), w.get(k)) for k in set(g) | set(w) if g.get(k) != w.get(k)}
        assert not wrong, f"{len(wrong)} {name} nodes differ (lake, reference), e.g. {list(wrong.items())[:3]}"
    return want


def apply_batch(s: Source, *sql: str) -> None:
    s.execute(*sql)
    run = s.capture().manifest.run_id
    for cfg in (s.block, s.perm):
        assert s.ingest(cfg, run, run=f"i{s.runs}").metrics.status == "ok"


@pytest.fixture
def tree_source(pg, source_uri, spark, lake, unique):
    """Two shards of 200 blocks in trees of GROUP blocks (depth up to ~12), bootstrapped."""
    s = Source(pg, spark, lake, unique, blocks=200)
    for schema in s.schemas:
        base = s.wl.shard_no(schema) * ID_STRIDE
        g = f"(id - {base})"
        first = f"({g} - (({g} - 1) % {GROUP}))"
        s.execute(
            f"UPDATE {schema}.block SET parent_id = CASE WHEN {g} = {first} THEN NULL "
            f"ELSE {base} + greatest({first}, {g} - 1 - ({g} % 5)) END"
        )
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    yield s
    s.close()


def test_scripted_shapes_deep_chain_moves_root_grants_deletes_cycles_orphans(tree_source, unique):
    s = tree_source
    cfg = tree_cfg(s, f"tree_{unique}")
    first = derive(s, cfg)
    assert first.mode == "full"
    placed, reasons = assert_tree_is_reference(s, cfg)
    assert not reasons and len(placed) == 400
    base = ID_STRIDE  # shard s0
    chain = [base + 1000 + i for i in range(61)]  # a root and 60 descendants below it, one per level
    rows = ", ".join(
        f"({n}, {base + 1}, {'NULL' if i == 0 else chain[i - 1]}, 'page', now(), now())" for i, n in enumerate(chain)
    )
    apply_batch(
        s,
        f"INSERT INTO s0.block (id, space_id, parent_id, type, created_at, updated_at) VALUES {rows}",
        f"INSERT INTO s0.permission (block_id, user_id, role) VALUES ({chain[0]}, 7, 'full'), ({chain[30]}, 7, 'read')",
    )
    m = derive(s, cfg)
    assert m.mode == "incremental" and m.passes <= 8, m  # log2(60) passes, not 60
    placed, _ = assert_tree_is_reference(s, cfg)
    deepest = placed[(shard_of(s)["s0"], chain[60])]
    assert deepest.depth == 60 and deepest.path == tuple(chain[:60])
    assert deepest.grants == (("7", "read", chain[30]),)  # the nearer grant wins

    # A grant at the root reaches every descendant; a whole subtree moves under another root.
    apply_batch(
        s,
        f"INSERT INTO s0.permission (block_id, user_id, role) VALUES ({chain[0]}, 9, 'edit')",
        f"UPDATE s0.block SET parent_id = {base + 1} WHERE id = {chain[20]}",
    )
    derive(s, cfg)
    placed, _ = assert_tree_is_reference(s, cfg)
    assert placed[(shard_of(s)["s0"], chain[60])].root_id == base + 1
    assert all(("9", "edit", chain[0]) in placed[(shard_of(s)["s0"], n)].grants for n in chain[:20])

    # Deletes orphan the subtree below; a cycle; a parent in the other shard; a child before its parent.
    apply_batch(
        s,
        f"DELETE FROM s0.block WHERE id = {chain[10]}",
        f"UPDATE s0.block SET parent_id = {base + 12} WHERE id = {base + 11}",
        f"UPDATE s0.block SET parent_id = {base + 11} WHERE id = {base + 12}",
        f"UPDATE s1.block SET parent_id = {base + 5} WHERE id = {2 * ID_STRIDE + 7}",
        f"INSERT INTO s0.block (id, space_id, parent_id, type, created_at, updated_at) "
        f"VALUES ({base + 5001}, {base + 1}, {base + 5000}, 'text', now(), now())",
    )
    derive(s, cfg)
    _, reasons = assert_tree_is_reference(s, cfg)
    s0, s1 = shard_of(s)["s0"], shard_of(s)["s1"]
    assert reasons[(s0, chain[11])] == reasons[(s0, chain[19])] == "missing_parent"
    assert reasons[(s0, base + 11)] == reasons[(s0, base + 12)] == "cycle"
    assert reasons[(s1, 2 * ID_STRIDE + 7)] == "parent_in_other_shard"
    assert reasons[(s0, base + 5001)] == "missing_parent"

    # The parents arrive and the loop is broken: everything resolves on the next run.
    apply_batch(
        s,
        f"INSERT INTO s0.block (id, space_id, parent_id, type, created_at, updated_at) "
        f"VALUES ({chain[10]}, {base + 1}, {chain[9]}, 'page', now(), now()), "
        f"({base + 5000}, {base + 1}, NULL, 'page', now(), now())",
        f"UPDATE s0.block SET parent_id = NULL WHERE id = {base + 11}",
        f"UPDATE s1.block SET parent_id = NULL WHERE id = {2 * ID_STRIDE + 7}",
    )
    derive(s, cfg)
    _, reasons = assert_tree_is_reference(s, cfg)
    assert not reasons
    # Too deep for a tree limited to 40 levels: refused with the reason, not truncated.
    shallow = tree_cfg(s, f"shallow_{unique}", max_depth=40)
    derive(s, shallow)
    _, reasons = assert_tree_is_reference(s, shallow)
    assert reasons and set(reasons.values()) == {"too_deep"}


def random_batch(s: Source, rng: random.Random, next_id: dict[str, int]) -> list[str]:
    """Moves (some into loops or other shards), inserts (some before their parent), deletes,
    grants granted, changed and revoked, root attribute changes and updates of other columns."""
    sql = []
    for schema in s.schemas:
        base = s.wl.shard_no(schema) * ID_STRIDE
        ids = list(range(base + 1, next_id[schema]))
        pick = lambda ids=ids: rng.choice(ids)  # noqa: E731
        for _ in range(rng.randint(2, 6)):
            target = rng.choice([pick(), pick(), "NULL", pick() + (ID_STRIDE if schema == "s0" else -ID_STRIDE)])
            sql.append(f"UPDATE {schema}.block SET parent_id = {target} WHERE id = {pick()}")
        for _ in range(rng.randint(1, 5)):
            nid, next_id[schema] = next_id[schema], next_id[schema] + rng.choice([1, 1, 2])  # gaps: late parents
            sql.append(
                f"INSERT INTO {schema}.block (id, space_id, parent_id, type, created_at, updated_at) "
                f"VALUES ({nid}, {base + rng.randint(1, 10)}, {rng.choice([pick(), nid + 1])}, 'text', now(), now()) "
                "ON CONFLICT (id) DO NOTHING"
            )
        sql.append(f"DELETE FROM {schema}.block WHERE id IN ({pick()}, {pick()})")
        for _ in range(rng.randint(1, 6)):
            role = rng.choice(["read", "edit", "full"])
            sql.append(
                f"INSERT INTO {schema}.permission (block_id, user_id, role) VALUES ({pick()}, {rng.randint(1, 6)}, "
                f"'{role}') ON CONFLICT (block_id, user_id) DO UPDATE SET role = EXCLUDED.role"
            )
        sql.append(f"DELETE FROM {schema}.permission WHERE block_id IN ({pick()}, {pick()}, {pick()})")
        sql.append(
            f"UPDATE {schema}.block SET space_id = {base + rng.randint(1, 10)} WHERE parent_id IS NULL AND id = {pick()}"
        )
        sql.append(f"UPDATE {schema}.block SET version = version + 1 WHERE id % 7 = {rng.randint(0, 6)}")
    return sql


def test_incremental_equals_reference_and_full_after_random_batches(tree_source, unique):
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    s = tree_source
    inc, full = tree_cfg(s, f"inc_{unique}"), tree_cfg(s, f"full_{unique}")
    derive(s, inc)
    next_id = {schema: s.wl.shard_no(schema) * ID_STRIDE + 201 for schema in s.schemas}
    modes, seen = [], set()
    for _ in range(5):
        apply_batch(s, *random_batch(s, rng, next_id))
        m = derive(s, inc)
        print(m.to_dict())
        modes.append(m.mode)
        seen |= set(assert_tree_is_reference(s, inc)[1].values())
    assert modes == ["incremental"] * 5, (seed, modes)
    assert {"missing_parent", "parent_in_other_shard"} <= seen, (seed, seen)
    assert derive(s, inc).mode == "noop"
    derive(s, full, full=True)
    assert lake_tree(s, inc) == lake_tree(s, full), seed


class Killed(Exception):
    pass


def test_a_run_killed_between_its_commits_converges_on_the_next(tree_source, unique, monkeypatch):
    """Each commit boundary of a run: before the unresolved table's, between it and the output's.
    The next run recomputes from the output's old watermark and lands on the reference."""
    import cdc_lakehouse.derived.derive_tree as derived_run

    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    s = tree_source
    cfg = tree_cfg(s, f"killed_{unique}")
    derive(s, cfg)
    next_id = {schema: s.wl.shard_no(schema) * ID_STRIDE + 201 for schema in s.schemas}
    for point in ("derive_before_unresolved", "derive_after_unresolved"):
        apply_batch(s, *random_batch(s, rng, next_id))

        def crash(name, point=point):
            if name == point:
                raise Killed(name)

        monkeypatch.setattr(derived_run, "crash_point", crash)
        with pytest.raises(Killed):
            derive(s, cfg)
        monkeypatch.undo()
        assert derive(s, cfg).mode == "incremental"
        assert_tree_is_reference(s, cfg)
    # Updates of other columns only: nothing to recompute, yet the watermark moves (next run: noop).
    apply_batch(s, "UPDATE s0.block SET version = version + 1", "UPDATE s1.block SET content = 'x'")
    m = derive(s, cfg)
    assert m.mode == "incremental" and m.affected == len(reference(s)[1]), m  # only the unresolved retried
    assert derive(s, cfg).mode == "noop"
    assert_tree_is_reference(s, cfg)


def test_surrogate_keyed_grants_revoked_or_moved_leave_every_node_that_inherited_them(tree_source, unique):
    """Grants keyed by a surrogate id (`id bigserial`, default replica identity): a DELETE carries
    only the id and an UPDATE moving a grant only its new row, so the node a grant left is in no
    changelog row. The incremental run finds it in the grants table as of its previous run's
    snapshot: a revoked or moved grant leaves every node that inherited it, as a full rebuild and
    the source say. With that snapshot expired (its holds dropped), the run stops asking for a full one."""
    s = tree_source
    shards = {"conn_id": "cdc_test_source", "database": s.db, "schemas": s.schemas}
    gcfg = make_config(f"g_{unique}", [], source={"table": "block_grant", "shards": [shards]}, primary_key=["id"])
    s.tables = lambda: {**Source.tables(s), "block_grant": (s.schemas, ["id"])}  # published and captured
    b0, b1 = ID_STRIDE, 2 * ID_STRIDE  # roots of the first trees: b + 1, b + 41, b + 81 (GROUP = 40)
    s.execute(
        *[
            f"CREATE TABLE {schema}.block_grant (id bigserial PRIMARY KEY, block_id bigint NOT NULL, "
            "user_id bigint NOT NULL, role text NOT NULL)"
            for schema in s.schemas
        ],
        f"INSERT INTO s0.block_grant (block_id, user_id, role) VALUES ({b0 + 1}, 7, 'full'), ({b0 + 41}, 7, 'read'), "
        f"({b0 + 3}, 8, 'edit'), ({b0 + 81}, 9, 'read')",
        f"INSERT INTO s1.block_grant (block_id, user_id, role) VALUES ({b1 + 1}, 7, 'edit'), ({b1 + 41}, 8, 'full')",
    )
    s.bootstrap(gcfg)
    tables = {s.block.name: s.block, gcfg.name: gcfg}
    dcfg, full = (
        TreeConfig.model_validate(
            {
                "name": name,
                "nodes": {"table": s.block.name, "id": "id", "parent": "parent_id", "root_attribute": "space_id"},
                "grants": {"table": gcfg.name, "node": "block_id", "principal": "user_id", "grant": "role"},
            }
        )
        for name in (f"sg_{unique}", f"sg_full_{unique}")
    )
    assert derive_tree(s.spark, s.lake, dcfg, tables).mode == "full"
    placed, _ = assert_tree_is_reference(s, dcfg, reference(s, grants_table="block_grant"))
    shard0 = shard_of(s)["s0"]
    assert ("7", "full", b0 + 1) in placed[(shard0, b0 + 40)].grants  # inherited down the first tree

    def grant_batch(*sql):
        s.execute(*sql)
        assert s.ingest(gcfg, s.capture().manifest.run_id, run=f"g{s.runs}").metrics.status == "ok"

    grant_batch(
        f"DELETE FROM s0.block_grant WHERE block_id = {b0 + 1} AND user_id = 7",  # revoked: the whole first tree
        f"UPDATE s0.block_grant SET block_id = {b0 + 121} WHERE block_id = {b0 + 41}",  # moved to another tree
        f"UPDATE s1.block_grant SET block_id = {b1 + 81}, role = 'read' WHERE block_id = {b1 + 1}",
        f"INSERT INTO s1.block_grant (block_id, user_id, role) VALUES ({b1 + 2}, 9, 'full')",
    )
    m = derive_tree(s.spark, s.lake, dcfg, tables)
    assert m.mode == "incremental", m
    placed, _ = assert_tree_is_reference(s, dcfg, reference(s, grants_table="block_grant"))
    assert m.keys_from == {s.block.name: "changelog", gcfg.name: "changelog"}, m
    assert not any(g[0] == "7" and g[2] == b0 + 1 for n, p in placed.items() if n[0] == shard0 for g in p.grants)
    assert ("7", "read", b0 + 121) in placed[(shard0, b0 + 121)].grants
    derive_tree(s.spark, s.lake, full, tables, full=True)
    assert lake_tree(s, dcfg) == lake_tree(s, full)

    # The grants snapshot the last run pinned is expired (both trees' holds dropped first, as for
    # retired consumers): nothing to look the old nodes up in, so the run stops asking for a full one.
    grant_batch(f"DELETE FROM s1.block_grant WHERE block_id = {b1 + 41}")
    drop_consumer(s.spark, [s.lake.qualified(gcfg.current_table)], f"derived:{dcfg.name}")
    drop_consumer(s.spark, [s.lake.qualified(gcfg.current_table)], f"derived:{full.name}")
    s.spark.sql(
        f"CALL {s.lake.catalog_name}.system.expire_snapshots(table => '{gcfg.current_table}', "
        "older_than => TIMESTAMP '2999-01-01 00:00:00', retain_last => 1)"
    ).collect()
    with pytest.raises(ConsumerLagError, match=f"derived consumer {dcfg.name} of .*mode=full"):
        derive_tree(s.spark, s.lake, dcfg, tables)
    assert derive_tree(s.spark, s.lake, dcfg, tables, full=True).mode == "full"
    assert_tree_is_reference(s, dcfg, reference(s, grants_table="block_grant"))


def test_the_tree_reads_both_inputs_at_one_consistent_point(tree_source, unique):
    """One source transaction moves a block under another root and grants on that root; only
    block is ingested. Read at the inputs' consistent point (the default), the tree shows neither
    half; read at their current snapshots (`read_at: current`), it shows the move without the
    grant. Once permission is ingested too, the tree is the reference again."""
    s = tree_source
    at_point = tree_cfg(s, f"pt_{unique}")
    current = tree_cfg(s, f"cur_{unique}").model_copy(update={"read_at": "current"})
    b0 = s.wl.shard_no("s0") * ID_STRIDE
    # Both tables apply one run: their first point (the two bootstraps left them apart).
    apply_batch(s, f"UPDATE s0.block SET version = version + 1 WHERE id = {b0 + 2}")
    for cfg in (at_point, current):
        assert derive(s, cfg).mode == "full"
    before = assert_tree_is_reference(s, at_point)
    s.execute(
        f"BEGIN; UPDATE s0.block SET parent_id = {b0 + 1} WHERE id = {b0 + 45}; "
        f"INSERT INTO s0.permission (block_id, user_id, role) VALUES ({b0 + 1}, 77, 'full') "
        "ON CONFLICT DO NOTHING; COMMIT"
    )
    run = s.capture().manifest.run_id
    assert s.ingest(s.block, run, run="blk").metrics.status == "ok"
    assert derive(s, at_point).mode == "noop"  # the point did not move
    assert_tree_is_reference(s, at_point, before)
    assert derive(s, current).mode == "incremental"  # the half that is in
    assert lake_tree(s, current) != lake_tree(s, at_point)
    assert s.ingest(s.perm, run, run="perm").metrics.status == "ok"
    assert derive(s, at_point).mode == "incremental"
    assert_tree_is_reference(s, at_point)
