"""The bootstrap's COPY -> Arrow reader (bootstrap.reader: copy) against Spark's JDBC reader (the
default) (issue 16): the same values for every supported type, the exported snapshot honoured by
every range, the per-host connection cap, the watermark in the same commit, and errors that name
the table and the range."""

from __future__ import annotations

import psycopg2
import pytest
from cdc_lakehouse.audit.hashing import spark_canonical
from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
from cdc_lakehouse.bootstrap.snapshot import (
    ctid_ranges,
    export_snapshot,
    read_shards,
    shards_by_endpoint,
    source_schema,
)
from cdc_lakehouse.columns import SHARD_COL
from cdc_lakehouse.config import parse_table_config
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.source.catalog import describe_table
from cdc_lakehouse.source.session import SESSION_OPTIONS
from pyspark.sql import functions as F

from tests.conftest import make_config
from tests.helpers import assert_lake_equals_source
from tests.integration.test_parity import ROWS, edge_db, insert_rows  # noqa: F401 - edge_db is a fixture

# Text that CSV must quote or escape, on top of the parity test's edge values.
TRICKY_TEXT = ["'a,b'", "'\"q\"'", "E'line1\\nline2'", "E'cr\\r'", "'\\N'", "'\"\"'", "E'\\\\'", "','"]


def _lake_values(spark, lake, cfg) -> dict:
    """id -> every column's canonical text (floats by their IEEE bits), as the audit compares them."""
    table = lake.qualified(cfg.current_table)
    cols = source_columns_of(spark, table, cfg)
    rows = spark.table(table).select("id", *[spark_canonical(F.col(c), t).alias(c) for c, t in cols]).collect()
    return {r["id"]: tuple(r) for r in rows}


def _edge_config(db: str, name: str, reader: str):
    return make_config(
        name,
        [],
        source={"table": "edge", "shards": [{"conn_id": "cdc_test_source", "database": db, "schemas": ["public"]}]},
        bootstrap={"reader": reader},
    )


def test_copy_reader_gives_the_jdbc_readers_values_for_every_type(pg, spark, lake, edge_db):  # noqa: F811
    db, conn = edge_db
    with conn.cursor() as cur:
        insert_rows(cur, 1)
        for i, v in enumerate(TRICKY_TEXT):
            cur.execute(f"INSERT INTO public.edge (id, t, a_t) VALUES ({500 + i}, {v}, ARRAY[{v}, NULL, ''])")
    configs = {r: _edge_config(db, f"edge{r[0]}_{db[4:]}", r) for r in ("copy", "jdbc")}
    endpoint = configs["copy"].source.shards[0].endpoint_id
    tables = {endpoint: {"edge": (["public"], ["id"])}}
    results = {
        r: bootstrap_table(spark, lake, c, run_id=f"edge-{r}", all_endpoint_tables=tables) for r, c in configs.items()
    }
    expected_rows = ROWS + 1 + len(TRICKY_TEXT)
    assert results["copy"].rows == results["jdbc"].rows == expected_rows
    copy_values, jdbc_values = (_lake_values(spark, lake, configs[r]) for r in ("copy", "jdbc"))
    assert len(copy_values) == expected_rows
    diffs = [(i, v, jdbc_values.get(i)) for i, v in copy_values.items() if v != jdbc_values.get(i)]
    assert diffs == []
    # Not only equal to each other: equal to the source, NULL and empty string kept apart.
    assert_lake_equals_source(spark, lake, configs["copy"], pg.dsn(db))
    t = dict(spark.table(lake.qualified(configs["copy"].current_table)).select("id", "t").collect())
    assert t[500 + TRICKY_TEXT.index("'\\N'")] == "\\N" and t[1] == "" and t[ROWS + 1] is None
    assert t[500 + TRICKY_TEXT.index("E'line1\\nline2'")] == "line1\nline2"
    # The watermark sits in the commit that wrote the rows, at the snapshot's consistent point.
    wm = read_watermark(spark, lake.qualified(configs["copy"].current_table))
    point = results["copy"].endpoints[endpoint]["consistent_point"]
    (shard,) = results["copy"].endpoints[endpoint]["shards"]
    assert wm.shards[shard].lsn == point > 0


def _block_config(source, name: str, reader: str):
    return make_config(
        name,
        [],
        source=source.block.source.model_dump(),
        bootstrap={"reader": reader, "partitions_per_shard": 4, "max_connections_per_host": 2},
    )


def _source_rows(source, cfg):
    """(columns, pg types, every shard's (shard, id, version, content) now, read outside Spark)."""
    with psycopg2.connect(source.dsn, options=SESSION_OPTIONS) as c, c.cursor() as cur:
        info = describe_table(cur, "s0", "block")
        columns = source_schema(cfg, info)
        pg_types = {col.name: col.pg_type for col in info.columns}
        rows = set()
        for _, schema, shard in cfg.shards():
            cur.execute(f"SELECT id, version, content FROM {schema}.block")
            rows |= {(shard, *r) for r in cur.fetchall()}
    return columns, pg_types, rows


def _read(spark, cfg, snapshot, columns, pg_types):
    """The reader's rows: every column (typed), and the (shard, id, version, content) of each."""
    sources = next(iter(shards_by_endpoint(cfg, None).values()))
    df = read_shards(spark, cfg, sources, snapshot, columns, pg_types)
    rows = df.collect()
    every = {tuple(tuple(v) if isinstance(v, list) else v for v in r) for r in rows}  # tags: a list
    return df, every, {(r[SHARD_COL], r["id"], r["version"], r["content"]) for r in rows}


def test_every_range_reads_the_exported_snapshot_within_the_connection_cap(source, spark, lake):
    cfgs = {r: _block_config(source, f"{r}_{source.db}", r) for r in ("copy", "jdbc")}
    columns, pg_types, before = _source_rows(source, cfgs["copy"])
    ep = next(iter(shards_by_endpoint(cfgs["copy"], None).values()))[0].endpoint
    conn, _point, snapshot, _ = export_snapshot(ep, source.endpoint, "arrowtest")
    try:
        # After the export: changes the snapshot must not see.
        source.execute(
            "DELETE FROM s0.block WHERE id IN (SELECT id FROM s0.block ORDER BY id LIMIT 50)",
            "UPDATE s1.block SET version = version + 1, content = E'changed,\\n\"'",
        )
        copy_df, copy_rows, copy_seen = _read(spark, cfgs["copy"], snapshot, columns, pg_types)
        _, jdbc_rows, jdbc_seen = _read(spark, cfgs["jdbc"], snapshot, columns, pg_types)
        # One task per connection (read while the snapshot lives: reading runs the tasks again).
        copy_tasks = copy_df.select(F.spark_partition_id()).distinct().count()
    finally:
        conn.close()
    assert len(before) == 2 * 1500
    assert copy_seen == before
    assert jdbc_seen == before
    assert copy_rows == jdbc_rows  # every column, typed, the same through both readers
    # Several ctid ranges per shard, over at most max_connections_per_host connections (tasks).
    sources = next(iter(shards_by_endpoint(cfgs["copy"], None).values()))
    assert len(ctid_ranges(ep, "s0", "block", 4)) == 4 and len(sources) == 2
    assert copy_tasks == 2


def test_a_snapshot_that_cannot_be_imported_names_the_table_and_the_fix(source, spark, lake):
    cfg = _block_config(source, f"bad_{source.db}", "copy")
    columns, pg_types, _ = _source_rows(source, cfg)
    sources = next(iter(shards_by_endpoint(cfg, None).values()))
    df = read_shards(spark, cfg, sources, "00000003-0000DEAD-1", columns, pg_types)
    with pytest.raises(Exception) as exc:
        df.count()
    text = str(exc.value)
    assert f"{cfg.name}: cannot import the exported snapshot 00000003-0000DEAD-1" in text
    assert "rerun the bootstrap" in text
    password = sources[0].endpoint.password
    assert not password or password not in text


def test_reader_is_configuration_with_jdbc_the_default():
    assert make_config("r1", ["s0"]).bootstrap.reader == "jdbc"
    assert make_config("r2", ["s0"], bootstrap={"reader": "copy"}).bootstrap.reader == "copy"
    _, errors = parse_table_config(
        {
            "name": "r3",
            "source": {"table": "t", "shards": [{"conn_id": "c", "schemas": ["s"]}]},
            "primary_key": ["id"],
            "bootstrap": {"reader": "odbc"},
        },
        "r3.yaml",
    )
    assert errors and "reader" in str(errors)


@pytest.mark.parametrize("reader", ["copy", "jdbc"])
def test_a_value_that_does_not_fit_stops_the_bootstrap_before_anything_is_written(source, spark, lake, reader):
    cfg = make_config(
        f"nofit_{reader}_{source.db}",
        [],
        source=source.block.source.model_dump(),
        column_types={"type": "bigint"},  # the block type is a word ('page', 'text', ...)
        bootstrap={"reader": reader},
    )
    with pytest.raises(Exception) as exc:
        source.bootstrap(cfg)
    text = str(exc.value)
    assert f"{cfg.name}: bootstrap stopped, nothing was written: row " in text
    assert "column type: value '" in text and "' does not fit bigint" in text
    assert "Set column_types in the table config" in text
    for table in (cfg.current_table, cfg.changelog_table):
        assert spark.table(lake.qualified(table)).count() == 0


def test_current_table_files_are_sorted_by_key_within_each_shard(source, spark, lake):
    # The current table is written with hash distribution (no sampling pass): each file must still
    # hold one shard's rows in key order, which later MERGEs rely on to skip files.
    import pyarrow.parquet as pq

    cfg = _block_config(source, f"sorted_{source.db}", "jdbc")
    source.bootstrap(cfg)
    files = spark.sql(f"SELECT file_path FROM {lake.qualified(cfg.current_table)}.files").collect()
    assert files
    rows = 0
    for (path,) in files:
        # One file, not a dataset: the directory's `_cdc_shard=...` is not read as a partition.
        t = pq.ParquetFile(path.removeprefix("file:")).read(columns=[SHARD_COL, "id"])
        ids = t.column("id").to_pylist()
        assert len(set(t.column(SHARD_COL).to_pylist())) == 1
        assert ids == sorted(ids)
        rows += len(ids)
    assert rows == 2 * 1500
