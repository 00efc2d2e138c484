"""Consumers that lag behind snapshot expiry (lake.holds), and maintenance of derived and feed
outputs, against real PostgreSQL, capture, ingest, Spark + Iceberg and Redis.

Each consumer (a feed consumer, a derived tree, a serving export) reads once, then lags while the
source table takes more ingests. Maintenance runs "two hours later" with a one-hour retention:
what the consumer holds survives (older snapshots do not), and its next incremental run is
correct. Maintenance "past its max lag" drops the hold and the snapshot: the consumer's next run
fails naming the consumer, the table and the fix, writes nothing, and the fix works.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

import pytest
from cdc_lakehouse.config import OutputMaintenanceConfig, TableConfig
from cdc_lakehouse.derived.derive_tree import read_tree_watermark
from cdc_lakehouse.feed.consumer import block_counts
from cdc_lakehouse.feed.offsets import output_offsets
from cdc_lakehouse.lake.tables import table_stats
from cdc_lakehouse.maintenance.maintain_table import maintain_table
from cdc_lakehouse.maintenance.result import TableMaintenanceResult
from cdc_lakehouse.serving.stores import store_uri_env

from devstack.workload import ID_STRIDE
from tests.integration.conftest import Source
from tests.integration.test_derived_tree import GROUP, assert_tree_is_reference, derive, tree_cfg
from tests.integration.test_feed import lake_counts, source_counts
from tests.integration.test_serving_export import assert_store_equals, make_export
from tests.integration.test_serving_export import run as export_run

MAX_LAG = 336  # lake.holds.DEFAULT_MAX_LAG_HOURS: the configs below keep the default
LAGGED = MAX_LAG + 2  # hours after now at which maintenance finds every hold lapsed


def short_retention(cfg: TableConfig) -> TableConfig:
    """Snapshots kept one hour (at least one); no latest view (not what these tests are about)."""
    update = {"snapshot_retention_hours": 1, "min_snapshots_to_keep": 1, "latest_view": "none"}
    m = cfg.maintenance.model_copy(update=update)
    return cfg.model_copy(update={"maintenance": m})


def maintain(s: Source, *cfgs: TableConfig, hours: int) -> list[TableMaintenanceResult]:
    """Each table's daily maintenance as if run `hours` from now."""
    now = datetime.now(UTC) + timedelta(hours=hours)
    return [maintain_table(s.spark, s.lake, c, run_id=f"m{hours}_{s.runs}", now=now) for c in cfgs]


def snapshots(s: Source, cfg: TableConfig) -> list[int]:
    return output_snapshots(s, s.lake.qualified(cfg.current_table))


def output_snapshots(s: Source, t: str) -> list[int]:
    s.spark.sql(f"REFRESH TABLE {t}")
    return [r[0] for r in s.spark.sql(f"SELECT snapshot_id FROM {t}.snapshots ORDER BY committed_at").collect()]


def taken_before(s: Source, cfg: TableConfig, snapshot: int) -> list[int]:
    """The table's snapshots committed before `snapshot`: what expiry may remove."""
    found = snapshots(s, cfg)
    return found[: found.index(snapshot)]


def tags(s: Source, table: str) -> set[str]:
    return {r[0] for r in s.spark.sql(f"SELECT name FROM {table}.refs WHERE type = 'TAG'").collect()}


def change(s: Source, i: int) -> None:
    """An update, a delete, an insert and a move of blocks in each shard, ingested. Blocks only:
    every consumer here holds the block table's snapshots (a tree holds each input the same way)."""
    sql = []
    for schema in s.schemas:
        base = s.wl.shard_no(schema) * ID_STRIDE
        sql += [
            f"UPDATE {schema}.block SET version = version + 1, space_id = {base + 1 + i % 3} WHERE id = {base + 3 + i}",
            f"DELETE FROM {schema}.block WHERE id = {base + 30 + i}",
            f"INSERT INTO {schema}.block (id, space_id, parent_id, type, created_at, updated_at) "
            f"VALUES ({base + 900 + i}, {base + 1}, {base + 1}, 'text', now() - interval '{i} days', now())",
            f"UPDATE {schema}.block SET parent_id = {base + 2} WHERE id = {base + 20 + i}",
        ]
    s.execute(*sql)
    assert s.ingest(s.block, s.capture().manifest.run_id, run=f"i{s.runs}").metrics.status == "ok"


@pytest.fixture
def held_source(pg, source_uri, spark, lake, unique):
    """Two shards of one 40-block tree each, the block table bootstrapped, then one ingest (the
    permission table only for a tree: with_grants). Snapshots kept one hour, at least one."""
    s = Source(pg, spark, lake, unique, blocks=GROUP)
    s.block, s.perm = short_retention(s.block), short_retention(s.perm)
    for schema in s.schemas:
        base = s.wl.shard_no(schema) * ID_STRIDE
        s.execute(f"UPDATE {schema}.block SET parent_id = CASE WHEN id = {base + 1} THEN NULL ELSE id - 1 END")
    s.capture()
    s.bootstrap(s.block)
    change(s, 0)
    yield s
    s.close()


def with_grants(s: Source) -> Source:
    """The tree's second input, bootstrapped (it takes no changes: one held input proves the point)."""
    s.bootstrap(s.perm)
    return s


def test_a_lagging_feed_consumer_keeps_its_offset_snapshot_until_its_max_lag(held_source, unique):
    s = held_source
    output = f"feed_t.held_{unique}"
    assert block_counts(s.spark, s.lake, s.block, output=output).mode == "full"
    table = s.lake.qualified(output)
    offset = output_offsets(s.spark, table, "block_counts")[s.block.current_table].snapshot_id
    older = taken_before(s, s.block, offset)
    change(s, 1)  # the consumer lags an ingest
    maintain(s, s.block, hours=2)
    kept = snapshots(s, s.block)
    assert offset in kept, f"the consumer's snapshot {offset} was expired (left: {kept})"
    assert older and not set(older) & set(kept), "maintenance expired nothing: the scenario proves nothing"
    m = block_counts(s.spark, s.lake, s.block, output=output)
    assert m.mode == "changelog", m  # the history between its two snapshots is still there
    assert lake_counts(s, output) == source_counts(s)

    # Its output, maintained two hours later with a one-hour retention: its first snapshot
    # expired, the snapshot carrying its offsets kept (the next run below reads them).
    from cdc_lakehouse.maintenance.maintain_table import maintain_feed_output

    offsets, first = output_offsets(s.spark, table, "block_counts"), output_snapshots(s, table)[0]
    settings = OutputMaintenanceConfig(min_input_files=2, snapshot_retention_hours=1, min_snapshots_to_keep=1)
    later = datetime.now(UTC) + timedelta(hours=2)
    r = maintain_feed_output(s.spark, s.lake, "block_counts", output, settings, run_id="f1", now=later)
    assert r.targets["feed_output"].after["data_files"] <= r.targets["feed_output"].before["data_files"], r
    assert first not in output_snapshots(s, table), "the output's maintenance expired nothing: it proves nothing"
    assert output_offsets(s.spark, table, "block_counts") == offsets
    assert lake_counts(s, output) == source_counts(s)

    # Past its max lag: the hold goes, then the snapshot; the consumer stops with the fix.
    change(s, 2)
    (m,) = maintain(s, s.block, hours=LAGGED)
    assert "cdc_consumer_feed_block_counts" in m.targets["current"].holds_dropped, m.targets["current"]
    counts = lake_counts(s, output)
    with pytest.raises(RuntimeError) as err:
        block_counts(s.spark, s.lake, s.block, output=output)
    msg = str(err.value)
    assert "feed consumer block_counts" in msg and s.block.current_table in msg, msg
    assert "expired" in msg and "mode=full" in msg and "since=None" in msg, msg
    assert lake_counts(s, output) == counts  # nothing written
    assert block_counts(s.spark, s.lake, s.block, output=output, mode="full").mode == "full"
    assert lake_counts(s, output) == source_counts(s)
    assert block_counts(s.spark, s.lake, s.block, output=output).mode == "noop"


def test_a_lagging_derived_tree_keeps_its_input_snapshots_until_its_max_lag(held_source, unique):
    """And its output's maintenance: compacted (the incremental run left delete files), expired,
    the watermark's snapshots kept on both tables, so the next run is incremental and right."""
    from cdc_lakehouse.maintenance.maintain_table import maintain_derived

    s = with_grants(held_source)
    cfg = tree_cfg(s, f"held_{unique}")
    m = cfg.maintenance.model_copy(update={"snapshot_retention_hours": 1, "min_snapshots_to_keep": 1})
    cfg = cfg.model_copy(update={"maintenance": m})
    assert derive(s, cfg).mode == "full"
    inputs = read_tree_watermark(s.spark, s.lake.qualified(cfg.output_table)).inputs
    pinned = {name: p.snapshot for name, p in inputs.items()}
    older = taken_before(s, s.block, pinned[s.block.name])
    change(s, 1)
    maintain(s, s.block, hours=2)
    kept = snapshots(s, s.block)
    assert pinned[s.block.name] in kept, f"the tree's input snapshot {pinned[s.block.name]} was expired ({kept})"
    assert older and not set(older) & set(kept), "nothing expired: the scenario proves nothing"
    m = derive(s, cfg)
    assert m.mode == "incremental", m
    assert_tree_is_reference(s, cfg)

    # Its output, two hours later with a one-hour retention.
    out = s.lake.qualified(cfg.output_table)
    rows = sorted(map(tuple, s.spark.table(out).collect()))
    before, first = table_stats(s.spark, out), output_snapshots(s, out)[0]
    assert before["delete_files"] > 0, before  # merge-on-read: the incremental run left delete files
    r = maintain_derived(s.spark, s.lake, cfg, run_id="d1", now=datetime.now(UTC) + timedelta(hours=2))
    after = table_stats(s.spark, out)
    assert after["delete_files"] == 0 and after["data_files"] <= before["data_files"], (before, after)
    assert first not in output_snapshots(s, out), "the output's maintenance expired nothing: it proves nothing"
    assert {"output", "unresolved"} <= set(r.targets), r
    assert sorted(map(tuple, s.spark.table(out).collect())) == rows
    change(s, 2)
    assert derive(s, cfg).mode == "incremental"
    assert_tree_is_reference(s, cfg)

    # Past its max lag.
    change(s, 3)
    (m,) = maintain(s, s.block, hours=LAGGED)
    assert f"cdc_consumer_derived_{cfg.name}" in m.targets["current"].holds_dropped
    with pytest.raises(RuntimeError) as err:
        derive(s, cfg)
    msg = str(err.value)
    assert f"derived consumer {cfg.name} of lake.{s.block.current_table}" in msg and "expired" in msg, msg
    assert f"cdc_derived__{cfg.name} with mode=full" in msg and f"{MAX_LAG} h" in msg, msg
    assert derive(s, cfg, full=True).mode == "full"
    assert_tree_is_reference(s, cfg)


@pytest.fixture
def held_export(held_source, redis_server, unique):
    conn = f"serving_held_{unique}"
    os.environ[store_uri_env(conn)] = redis_server.uri
    yield make_export(
        ("redis", conn, {"buckets": 4}),
        f"held_{unique}",
        {"table": held_source.block.name},
        values=["space_id", "parent_id", "version"],
    )
    os.environ.pop(store_uri_env(conn), None)


class Killed(Exception):
    pass


def test_a_lagging_export_keeps_its_position_and_pending_snapshots_until_its_max_lag(
    held_source, held_export, monkeypatch
):
    import cdc_lakehouse.serving.export as run_mod

    s, ecfg = held_source, held_export
    live = s.lake.qualified(s.block.current_table)
    first = export_run(s.spark, s.lake, ecfg, s)
    assert first.mode == "full"
    position = first.snapshot
    change(s, 1)
    maintain(s, s.block, hours=2)
    assert position in snapshots(s, s.block), "the exported snapshot was expired"
    m = export_run(s.spark, s.lake, ecfg, s)
    assert m.mode == "incremental" and m.keys_from == "changelog", m
    assert_store_equals(s.spark, ecfg, live)

    # A run killed after its writes leaves a pending snapshot: held too, until a run moves past it.
    change(s, 2)

    def crash(name):
        if name == "export_before_position":
            raise Killed(name)

    monkeypatch.setattr(run_mod, "crash_point", crash)
    with pytest.raises(Killed):
        export_run(s.spark, s.lake, ecfg, s)
    monkeypatch.undo()
    pending = snapshots(s, s.block)[-1]
    assert f"cdc_consumer_export_{ecfg.name}__pending_{pending}" in tags(s, live)
    change(s, 3)
    maintain(s, s.block, hours=2)
    assert pending in snapshots(s, s.block)
    # Its position is a compaction's snapshot (maintenance ran before the run that set it): the
    # snapshot below it carrying the watermark stays too, so the range is still read from the changelog.
    m = export_run(s.spark, s.lake, ecfg, s)
    assert m.mode == "incremental" and m.keys_from == "changelog", m
    assert_store_equals(s.spark, ecfg, live)
    assert tags(s, live) == {f"cdc_consumer_export_{ecfg.name}"}  # the pending hold went with the move

    change(s, 4)
    maintain(s, s.block, hours=LAGGED)
    with pytest.raises(RuntimeError) as err:
        export_run(s.spark, s.lake, ecfg, s)
    msg = str(err.value)
    assert f"export consumer {ecfg.name} of {live}" in msg and "expired" in msg, msg
    assert f"cdc_export__{ecfg.name} with mode=full" in msg, msg
    assert export_run(s.spark, s.lake, ecfg, s, mode="full").mode == "full"
    assert_store_equals(s.spark, ecfg, live)
