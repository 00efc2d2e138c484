"""The change feed against real PostgreSQL, capture, ingest, Spark and Iceberg.

Two consumers follow the block table through random batches: a mirror (one row per key, applied
from the feed's upserts and deletes, offsets in cdc_meta.feed_offsets) and the demo's block
counts (an Iceberg output whose commit carries the offset). Both are compared with the source
database after every batch. A seed is printed; rerun a failure with FEED_SEED=<seed>.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import jinja2
import psycopg2
import pytest
from cdc_lakehouse.feed.arrow import read_changes_arrow
from cdc_lakehouse.feed.consumer import ConsumerResult, block_counts
from cdc_lakehouse.feed.models import FEED_OP_COL, OP_DELETE, OP_UPSERT, FeedError
from cdc_lakehouse.feed.offsets import commit_meta_offset, meta_offset, output_offsets
from cdc_lakehouse.feed.read import read_changes
from cdc_lakehouse.orchestration.dag_parts import FEED_UPTO, announce_snapshots, asset

from devstack.workload import ID_STRIDE
from tests.helpers import lake_connection_json
from tests.integration.conftest import Source


def shard_of(s: Source) -> dict[str, str]:
    return {schema: shard for _, schema, shard in s.block.shards()}


def source_rows(s: Source) -> dict[tuple[str, int], tuple[int, int]]:
    """(shard, id) -> (space_id, version), straight from the source database."""
    conn = psycopg2.connect(s.dsn)
    out = {}
    with conn.cursor() as cur:
        for schema, shard in shard_of(s).items():
            cur.execute(f"SELECT id, space_id, version FROM {schema}.block")
            out.update({(shard, i): (sp, v) for i, sp, v in cur.fetchall()})
    conn.close()
    return out


def source_counts(s: Source) -> dict[tuple[int, str], int]:
    conn = psycopg2.connect(s.dsn)
    out: dict[tuple[int, str], int] = {}
    with conn.cursor() as cur:
        for schema in s.schemas:
            cur.execute(
                f"SELECT space_id, (created_at AT TIME ZONE 'UTC')::date, count(*) FROM {schema}.block GROUP BY 1, 2"
            )
            for sp, day, n in cur.fetchall():
                out[(sp, str(day))] = out.get((sp, str(day)), 0) + n
    conn.close()
    return out


def lake_counts(s: Source, output: str) -> dict[tuple[int, str], int]:
    table = s.lake.qualified(output)
    s.spark.sql(f"REFRESH TABLE {table}")
    return {(r["space_id"], str(r["day"])): r["blocks"] for r in s.spark.table(table).collect()}


def mirror_step(s: Source, state: dict, consumer: str = "mirror"):
    """One run of the mirror consumer; returns the range it applied."""
    since, _ = meta_offset(s.spark, s.lake, consumer, s.block.current_table)
    batch = read_changes(s.spark, s.lake, s.block, consumer, since)
    rows = batch.rows.select(FEED_OP_COL, "_cdc_shard", "id", "space_id", "version").collect()
    keys = [(r["_cdc_shard"], r["id"]) for r in rows]
    assert len(keys) == len(set(keys)), "the feed gave a key twice in one range"
    if batch.range.replaces_state:
        state.clear()
    for r, k in zip(rows, keys, strict=True):
        if r[FEED_OP_COL] == OP_DELETE:
            state.pop(k, None)
        else:
            assert r[FEED_OP_COL] == OP_UPSERT
            state[k] = (r["space_id"], r["version"])
    if batch.range.mode != "noop":
        commit_meta_offset(s.spark, s.lake, batch.range.offset, since)
    return batch.range, len(rows)


def arrow_step(s: Source, state: dict, since):
    """The mirror again, through pyiceberg (no Spark); its offset kept by the caller."""
    rng, t = read_changes_arrow(s.lake, s.block, "mirror_py", since)
    if rng.replaces_state:
        state.clear()
    for op, shard, i, sp, v in zip(
        *[t[c].to_pylist() for c in (FEED_OP_COL, "_cdc_shard", "id", "space_id", "version")]
    ):
        if op == OP_DELETE:
            state.pop((shard, i), None)
        else:
            state[(shard, i)] = (sp, v)
    return rng


def random_batch(s: Source, rng: random.Random, next_id: dict[str, int]) -> list[str]:
    """Updates, deletes, inserts, key changes (a key moved to a new id, and a key re-used by an
    insert after its delete), space moves."""
    sql = []
    for schema in s.schemas:
        base = s.wl.shard_no(schema) * ID_STRIDE
        lo = base + 1

        def pick(lo=lo, schema=schema):
            return rng.randint(lo, next_id[schema] - 1)

        sql.append(f"UPDATE {schema}.block SET version = version + 1 WHERE id IN ({pick()}, {pick()}, {pick()})")
        sql.append(f"DELETE FROM {schema}.block WHERE id IN ({pick()}, {pick()})")
        for _ in range(rng.randint(1, 4)):
            nid = next_id[schema]
            next_id[schema] += 1
            sql.append(
                f"INSERT INTO {schema}.block (id, space_id, type, created_at, updated_at) "
                f"VALUES ({nid}, {base + rng.randint(1, 5)}, 'text', now() - interval '{rng.randint(0, 3)} days', now())"
            )
        nid = next_id[schema]
        next_id[schema] += 1
        sql.append(f"UPDATE {schema}.block SET id = {nid} WHERE id = {pick()}")  # a key change
        sql.append(f"UPDATE {schema}.block SET space_id = {base + rng.randint(1, 5)} WHERE id = {pick()}")
        victim = pick()
        sql.append(f"DELETE FROM {schema}.block WHERE id = {victim}")  # delete, then the key comes back
        sql.append(
            f"INSERT INTO {schema}.block (id, space_id, type, created_at, updated_at) "
            f"VALUES ({victim}, {base + 9}, 'page', now(), now()) ON CONFLICT (id) DO NOTHING"
        )
    return sql


def ingest(s: Source) -> None:
    run = s.capture().manifest.run_id
    assert s.ingest(s.block, run, run=f"i{s.runs}").metrics.status == "ok"


@pytest.fixture
def feed_source(pg, source_uri, spark, lake, unique):
    s = Source(pg, spark, lake, unique, blocks=150)
    s.capture()
    s.bootstrap(s.block)
    yield s
    s.close()


def test_consumers_follow_random_batches_key_changes_truncate_and_rebootstrap(feed_source, unique):
    seed = int(os.environ.get("FEED_SEED", random.randrange(1 << 30)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    s = feed_source
    output = f"feed_t.counts_{unique}"
    state: dict = {}
    first, n = mirror_step(s, state)
    assert first.mode == "full" and n == 300 and state == source_rows(s)
    py_state: dict = {}
    py = arrow_step(s, py_state, None)
    assert py.mode == "full" and py_state == state
    assert block_counts(s.spark, s.lake, s.block, output=output).mode == "full"
    assert lake_counts(s, output) == source_counts(s)
    next_id = dict(s.wl.next_id)
    modes = []
    for i in range(6):
        sql = random_batch(s, rng, next_id)
        if i == 2:  # a truncate of one shard, and new rows after it, in one batch
            lo = s.wl.first_id["s1"]
            sql += [
                "TRUNCATE s1.block",
                "INSERT INTO s1.block (id, space_id, type, created_at, updated_at) "
                f"SELECT g, {2 * ID_STRIDE + 1} + g % 5, 'page', now(), now() FROM generate_series({lo}, {lo + 39}) g",
            ]
        s.execute(*sql)
        if i == 4:  # shard s0 re-bootstrapped (changes in it are then read from its snapshot)
            s.bootstrap(s.block, shards=[shard_of(s)["s0"]])
        ingest(s)
        r, n = mirror_step(s, state)
        modes.append(r.mode)
        print(i, r.mode, r.reason, n)
        assert state == source_rows(s), (seed, i, r)
        py = arrow_step(s, py_state, py.offset)
        assert (py.mode, py.snapshot_id) == (r.mode, r.snapshot_id) and py_state == state, (seed, i, py)
        m = block_counts(s.spark, s.lake, s.block, output=output)
        assert m.mode == r.mode and m.snapshot_id == r.snapshot_id, m
        assert lake_counts(s, output) == source_counts(s), (seed, i, m)
    assert modes[2] == "diff" and modes[4] == "diff", modes  # truncate; re-bootstrap
    assert modes[0] == modes[1] == modes[3] == modes[5] == "changelog", modes
    # Nothing new: a noop that commits nothing; the offset equals the head's.
    assert mirror_step(s, state)[0].mode == "noop"
    assert block_counts(s.spark, s.lake, s.block, output=output) == ConsumerResult(
        mode="noop",
        reason="no complete snapshot after the offset",
        snapshot_id=r.snapshot_id,
        committed=False,
        pairs=0,
    )


def test_reads_are_bounded_by_a_complete_snapshot_an_asset_event_names(feed_source, monkeypatch):
    s = feed_source
    base = s.wl.first_id["s0"]
    since, _ = meta_offset(s.spark, s.lake, "bounded", s.block.current_table)
    assert since is None
    head0 = read_changes(s.spark, s.lake, s.block, "bounded", None).range
    s.execute(f"UPDATE s0.block SET version = 100 WHERE id = {base}")
    ingest(s)
    mid = read_changes(s.spark, s.lake, s.block, "bounded", head0.offset).range
    # What the ingest task's post_execute puts in its Asset event, through the Airflow connection.
    monkeypatch.setenv("AIRFLOW_CONN_CDC_LAKE", lake_connection_json(s.pg, s.lake))
    cur = asset(s.block.current_table)
    events = {cur: SimpleNamespace(extra={})}
    announce_snapshots([s.block])({"outlet_events": events})
    extra = events[cur].extra
    assert extra == {"table": s.block.current_table, "snapshot_id": mid.snapshot_id, "watermark": mid.watermark}
    s.execute(f"UPDATE s0.block SET version = 200 WHERE id = {base}", f"DELETE FROM s0.block WHERE id = {base + 1}")
    ingest(s)
    # Up to the first ingest's snapshot only (what its asset event carried): the later change is not in it.
    upto = jinja2.Template(FEED_UPTO).render(triggering_asset_events={cur: [SimpleNamespace(extra=extra)]})
    assert jinja2.Template(FEED_UPTO).render(triggering_asset_events={}) == ""
    b = read_changes(s.spark, s.lake, s.block, "bounded", head0.offset, upto=int(upto))
    got = {(r["id"], r[FEED_OP_COL], r["version"]) for r in b.rows.collect()}
    assert b.range.snapshot_id == mid.snapshot_id and got == {(base, OP_UPSERT, 100)}, got
    nxt = read_changes(s.spark, s.lake, s.block, "bounded", b.range.offset).rows.collect()
    assert {(r["id"], r[FEED_OP_COL], r["version"]) for r in nxt} == {
        (base, OP_UPSERT, 200),
        (base + 1, OP_DELETE, None),
    }
    with pytest.raises(FeedError, match="no cdc.watermark|does not exist"):
        read_changes(s.spark, s.lake, s.block, "bounded", head0.offset, upto=123)
    with pytest.raises(FeedError, match="consumer name"):
        read_changes(s.spark, s.lake, s.block, "Bad-Name", None)


class Killed(Exception):
    pass


def test_a_consumer_killed_around_its_commit_neither_skips_nor_repeats(feed_source, unique, monkeypatch):
    import cdc_lakehouse.feed.offsets as offsets_mod

    seed = int(os.environ.get("FEED_SEED", random.randrange(1 << 30)))
    print(f"seed={seed}")
    rng = random.Random(seed)
    s = feed_source
    output = f"feed_t.killed_{unique}"
    block_counts(s.spark, s.lake, s.block, output=output)
    next_id = dict(s.wl.next_id)
    table = s.lake.qualified(output)
    for point, then in (("feed_before_output_commit", "changelog"), ("feed_after_output_commit", "noop")):
        s.execute(*random_batch(s, rng, next_id))
        ingest(s)
        before = output_offsets(s.spark, table, "block_counts")

        def crash(name, point=point):
            if name == point:
                raise Killed(name)

        monkeypatch.setattr(offsets_mod, "crash_point", crash)
        with pytest.raises(Killed):
            block_counts(s.spark, s.lake, s.block, output=output)
        monkeypatch.undo()
        moved = output_offsets(s.spark, table, "block_counts") != before
        assert moved == (point == "feed_after_output_commit"), point  # output and offset: both or neither
        m = block_counts(s.spark, s.lake, s.block, output=output)
        assert m.mode == then, (point, m)
        assert lake_counts(s, output) == source_counts(s), (seed, point)

    # At least once (offset in cdc_meta after the output): killed in between, the same range comes again.
    state: dict = {}
    mirror_step(s, state, "mirror_k")
    s.execute(*random_batch(s, rng, next_id))
    ingest(s)
    since, _ = meta_offset(s.spark, s.lake, "mirror_k", s.block.current_table)
    first = read_changes(s.spark, s.lake, s.block, "mirror_k", since)
    delivered = sorted(map(tuple, first.rows.select(FEED_OP_COL, "_cdc_shard", "id", "version").collect()))
    # (the output is written here, then the process dies before commit_meta_offset)
    again = read_changes(
        s.spark, s.lake, s.block, "mirror_k", meta_offset(s.spark, s.lake, "mirror_k", s.block.current_table)[0]
    )
    assert again.range == first.range
    assert sorted(map(tuple, again.rows.select(FEED_OP_COL, "_cdc_shard", "id", "version").collect())) == delivered
    mirror_step(s, state, "mirror_k")
    assert state == source_rows(s)
