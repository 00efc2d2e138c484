"""Consistent points across tables (lake.points), against real PostgreSQL, capture, Spark and
Iceberg: source transactions that each write a `block` row on shard s0 and its `permission` row
on shard s1, the two tables ingested separately in a random order per capture run, one ingest
killed between its changelog and current-table commits, one left behind for a run. After every
step, a reader at the newest point sees every transaction whole: the same (tag, version) pairs
in both tables; a change-feed consumer reading both up to each point has mirrors that agree;
cdc_meta.consistent_points and the endpoint's Asset event name the same point. The tables' current snapshots are also compared, to prove the steps do expose
half-applied transactions (so the test would fail if the rule were wrong)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
from cdc_lakehouse.config import ConfigSet
from cdc_lakehouse.feed.models import FEED_OP_COL, OP_DELETE, FeedOffset
from cdc_lakehouse.feed.read import read_changes
from cdc_lakehouse.lake.points import ConsistentPoint, read_points, record_points
from cdc_lakehouse.orchestration import tasks
from cdc_lakehouse.orchestration.dag_parts import announce_snapshots, ingest_outlets, point_asset
from cdc_lakehouse.runtime.failpoints import FAIL_ENV, FailpointHit

from tests.conftest import session_seeds
from tests.helpers import lake_connection_json
from tests.integration.conftest import Source

TAG, TAGS = 50_000_000, 10_000_000  # ids of the test's transactions, below the workload's (shard * 10**9 + n)


def pairs_in(spark, lake, s, snapshots: dict[str, int] | None) -> tuple[set, set]:
    """(tag, version) of the tagged rows in block (s0) and permission (s1): at the point's
    snapshots, or (None) at the tables' current snapshots."""

    def read(cfg):
        table = lake.qualified(cfg.current_table)
        sql = f"SELECT * FROM {table}" + (f" VERSION AS OF {snapshots[table]}" if snapshots else "")
        return spark.sql(sql)

    block = read(s.block).where(f"_cdc_shard LIKE '%s0' AND id BETWEEN {TAG} AND {TAG + TAGS}").select("id", "version")
    flag = s.perm.soft_delete_columns.flag
    perm = read(s.perm).where(
        f"_cdc_shard LIKE '%s1' AND block_id BETWEEN {TAG} AND {TAG + TAGS} AND NOT coalesce({flag}, false)"
    )
    return (
        {(r["id"], r["version"]) for r in block.collect()},
        {(r["block_id"], int(r["role"][1:])) for r in perm.select("block_id", "role").collect()},
    )


def transactions(s, rng: random.Random, live: dict[int, int], n: int) -> None:
    """n source transactions, each writing both tables on two shards: insert, update or delete a pair."""
    sql = []
    for _ in range(n):
        op = rng.choice(["insert", "insert", "update", "update", "delete"]) if live else "insert"
        if op == "insert":
            tag = TAG + rng.randrange(TAGS)
            if tag in live:
                continue
            live[tag] = 1
            sql.append(
                f"BEGIN; INSERT INTO s0.block (id, space_id, type, created_at, updated_at) "
                f"VALUES ({tag}, 1, 'txn', now(), now()); "
                f"INSERT INTO s1.permission (block_id, user_id, role) VALUES ({tag}, 1, 'v1'); COMMIT"
            )
        elif op == "update":
            tag = rng.choice(sorted(live))
            live[tag] += 1
            sql.append(
                f"BEGIN; UPDATE s0.block SET version = {live[tag]} WHERE id = {tag}; "
                f"UPDATE s1.permission SET role = 'v{live[tag]}' WHERE block_id = {tag}; COMMIT"
            )
        else:
            tag = rng.choice(sorted(live))
            del live[tag]
            sql.append(
                f"BEGIN; DELETE FROM s0.block WHERE id = {tag}; DELETE FROM s1.permission WHERE block_id = {tag}; COMMIT"
            )
    s.execute(*sql)


@pytest.fixture
def small_source(pg, source_uri, spark, lake, unique):
    s = Source(pg, spark, lake, unique, blocks=200)  # the test's own rows are what it checks
    yield s
    s.close()


def test_a_reader_at_a_consistent_point_never_sees_part_of_a_transaction(small_source, pg, spark, lake, monkeypatch):
    (seed,) = session_seeds(1)
    print(f"consistent points: seed {seed}")
    rng = random.Random(seed)
    s = small_source
    cs = ConfigSet({c.name: c for c in (s.block, s.perm)}, [], {})
    meta = lake.qualified(lake.meta_table("consistent_points"))
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    live: dict[int, int] = {}
    partial_seen = 0
    last: ConsistentPoint | None = None

    def check(step: str) -> ConsistentPoint | None:
        nonlocal partial_seen, last
        point = (read_points(lake, cs)[s.endpoint] or [None])[0]
        if point is None:
            return None
        b, p = pairs_in(spark, lake, s, point.snapshots)
        assert b == p, f"seed {seed}, {step}: at point {point.lsn} block and permission differ: {sorted(b ^ p)[:10]}"
        cur_b, cur_p = pairs_in(spark, lake, s, None)
        partial_seen += cur_b != cur_p
        assert last is None or point.lsn >= last.lsn, f"seed {seed}, {step}: the newest point went back"
        # the ingest job's step records it for other engines, once
        t = time.perf_counter()
        assert record_points(spark, lake, cs, [s.endpoint], step) in (0, 1)
        print(f"consistent points: {step}: recording took {time.perf_counter() - t:.2f} s")
        rows = spark.sql(f"SELECT DISTINCT lsn, table_name, snapshot_id FROM {meta} WHERE endpoint = '{s.endpoint}'")
        recorded = {(r["table_name"], r["snapshot_id"]) for r in rows.collect() if r["lsn"] == point.lsn}
        assert recorded == set(point.snapshots.items()), (step, recorded, point)
        if last is None or point.lsn != last.lsn:
            feed_to(point)
        last = point
        return point

    # A change-feed consumer of both tables reads each up to the same point: its two mirrors
    # agree after every range, as the tables at the point do.
    offsets: dict[str, FeedOffset | None] = {s.block.name: None, s.perm.name: None}
    mirrors: dict[str, dict] = {s.block.name: {}, s.perm.name: {}}

    def feed_to(point: ConsistentPoint) -> None:
        for cfg, key, value in (
            (s.block, ("_cdc_shard", "id"), "version"),
            (s.perm, ("_cdc_shard", "block_id", "user_id"), "role"),
        ):
            batch = read_changes(
                spark, lake, cfg, "points", offsets[cfg.name], upto=point.snapshots[lake.qualified(cfg.current_table)]
            )
            mirror = mirrors[cfg.name]
            if batch.range.mode == "full":
                mirror.clear()
            for r in batch.rows.collect():
                k = tuple(r[c] for c in key)
                if r[FEED_OP_COL] == OP_DELETE:
                    mirror.pop(k, None)
                else:
                    mirror[k] = r[value]
            offsets[cfg.name] = batch.range.offset
        fb = {(k[1], v) for k, v in mirrors[s.block.name].items() if k[0].endswith("s0") and TAG <= k[1] <= TAG + TAGS}
        fp = {
            (k[1], int(v[1:]))
            for k, v in mirrors[s.perm.name].items()
            if k[0].endswith("s1") and TAG <= k[1] <= TAG + TAGS
        }
        assert fb == fp == pairs_in(spark, lake, s, point.snapshots)[0], f"seed {seed}: feed at point {point.lsn}"

    kill_round, lag_round = rng.sample(range(5), 2)
    print(f"consistent points: kill in round {kill_round}, a table left behind in round {lag_round}")
    for rnd in range(5):
        transactions(s, rng, live, 12)
        capture = s.capture()
        run, end = capture.manifest.run_id, capture.manifest.end_lsn
        first, second = rng.sample([s.block, s.perm], 2)
        s.ingest(first, run)
        check(f"round {rnd}: {first.name} alone")
        if rnd == lag_round:
            continue  # the second table catches up with the next run, applying two at once
        if rnd == kill_round:
            monkeypatch.setenv(FAIL_ENV, "ingest_after_changelog")
            with pytest.raises(FailpointHit):
                s.ingest(second, run)
            monkeypatch.delenv(FAIL_ENV)
            check(f"round {rnd}: {second.name} killed after its changelog")
        s.ingest(second, run)
        point = check(f"round {rnd}: both")
        assert point is not None and point.lsn == end and point.run_id == run, (rnd, point, end)

    # Both tables caught up (the last round may have left one behind): the newest point holds
    # exactly the source's transactions. And the steps did expose halves.
    for cfg in (s.block, s.perm):
        s.ingest(cfg, run)
    final = check("both caught up")
    assert final is not None and final.lsn == end
    final_b, final_p = pairs_in(spark, lake, s, final.snapshots)
    assert final_b == final_p == set(live.items())

    # The ingest task's post_execute announces it in the endpoint's Asset event (through the
    # Airflow connection, with the endpoint's tables as the config folder would give them).
    monkeypatch.setenv("AIRFLOW_CONN_CDC_LAKE", lake_connection_json(pg, lake))
    monkeypatch.setattr(tasks, "configs", lambda: cs)
    events = {a: SimpleNamespace(extra={}) for a in ingest_outlets([s.perm])}
    announce_snapshots([s.perm])({"outlet_events": events})
    assert events[point_asset(s.endpoint)].extra == {"endpoint": s.endpoint, "point": final.model_dump()}
    assert partial_seen >= 3, f"seed {seed}: only {partial_seen} steps had the tables apart"


def test_no_point_holds_an_added_columns_values_read_past_it(small_source, spark, lake, monkeypatch):
    """#51: a column added to `block` with a volatile default; the block ingest dies between its
    MERGE at W (a backfill pending) and the backfill. A transaction after W sets the new column
    on a block row and the row's permission. The rerun re-reads the column from the source (the
    transaction's value) and commits the watermark at W, which the old rule took for the point
    at W: block showed the transaction there, permission did not. The backfill's commit now says
    how far its read reached (`cdc.read-upto`), and no point forms below that."""
    s = small_source
    cs = ConfigSet({c.name: c for c in (s.block, s.perm)}, [], {})
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    tag = TAG + 1
    s.execute(
        f"BEGIN; INSERT INTO s0.block (id, space_id, type, created_at, updated_at) VALUES ({tag}, 1, 'txn', now(), now()); "
        f"INSERT INTO s1.permission (block_id, user_id, role) VALUES ({tag}, 1, 'v1'); COMMIT"
    )
    run = s.capture().manifest.run_id
    for cfg in (s.block, s.perm):
        s.ingest(cfg, run)
    s.execute(
        "ALTER TABLE s0.block ADD COLUMN heat float8 DEFAULT random()",  # a rewrite: re-read, not a constant
        f"UPDATE s0.block SET version = version + 1 WHERE id = {s.wl.first_id['s0']}",  # announces the column
    )
    run = s.capture().manifest.run_id
    s.ingest(s.perm, run)
    monkeypatch.setenv(FAIL_ENV, "ingest_after_merge")
    with pytest.raises(FailpointHit):
        s.ingest(s.block, run)
    monkeypatch.delenv(FAIL_ENV)
    s.execute(
        f"BEGIN; UPDATE s0.block SET heat = 42 WHERE id = {tag}; "
        f"UPDATE s1.permission SET role = 'v2' WHERE block_id = {tag}; COMMIT"
    )
    s.ingest(s.block, run)  # finishes the backfill: its read sees the transaction

    def seen(snapshots: dict[str, int] | None) -> tuple[bool, bool]:
        """Whether block's row, and whether permission's, show the transaction."""
        at = lambda t: f" VERSION AS OF {snapshots[t]}" if snapshots else ""  # noqa: E731
        block, perm = lake.qualified(s.block.current_table), lake.qualified(s.perm.current_table)
        rows = spark.sql(f"SELECT * FROM {block}{at(block)} WHERE id = {tag} AND _cdc_shard LIKE '%s0'").collect()
        role = spark.sql(f"SELECT role FROM {perm}{at(perm)} WHERE block_id = {tag} AND _cdc_shard LIKE '%s1'")
        return (bool(rows) and rows[0].asDict().get("heat") == 42, [r["role"] for r in role.collect()] == ["v2"])

    assert seen(None) == (True, False), "the backfill did not read past W: the test would prove nothing"
    points = read_points(lake, cs)[s.endpoint]
    for p in points:
        assert len(set(seen(p.snapshots))) == 1, f"the point at {p.lsn} shows the transaction in one table only"
    # The transaction's own capture run: both tables reach a point that holds it whole.
    run = s.capture().manifest.run_id
    for cfg in (s.block, s.perm):
        s.ingest(cfg, run)
    newest = read_points(lake, cs)[s.endpoint][0]
    assert newest.lsn > points[0].lsn and seen(newest.snapshots) == (True, True)
