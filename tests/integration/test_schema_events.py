"""Schema changes as events (source.ddl, ingest.renames) against real PostgreSQL, capture, Spark
and Iceberg: the event trigger writes each DDL into the WAL in order with the data.

A rename of block.type to kind happens on shard s0 in one batch and on s1 in the next, each
between writes of the same batch; the lake renames the column once (same Iceberg field id, so
the changelog keeps its history under the new name) and reads each shard's old name as the new
one until that shard's own rename. On s0, a column added back under the old name after the
rename is a new column. Every row equals the source's after each batch."""

from __future__ import annotations

import json

import psycopg2
import pytest
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.source.ddl import DDL_PREFIX, DDL_SCHEMA, TRIGGER, ensure_ddl_capture

from tests.conftest import make_config
from tests.helpers import assert_lake_equals_source
from tests.integration.conftest import Source


@pytest.fixture
def ddl_source(pg, source_uri, spark, lake, unique):
    s = Source(pg, spark, lake, unique, blocks=100)
    yield s
    s.close()


def source_values(s: Source, column: dict[str, str]) -> set[tuple]:
    """(schema, id, value of the column named column[schema] there)."""
    conn = psycopg2.connect(s.dsn)
    try:
        with conn.cursor() as cur:
            out = set()
            for schema, col in column.items():
                cur.execute(f"SELECT id, {col} FROM {schema}.block")
                out |= {(schema, i, v) for i, v in cur.fetchall()}
            return out
    finally:
        conn.close()


def lake_values(s: Source, column: str) -> set[tuple]:
    table = s.lake.qualified(s.block.current_table)
    s.spark.sql(f"REFRESH TABLE {table}")
    rows = s.spark.table(table).select("_cdc_shard", "id", column).collect()
    return {(r["_cdc_shard"].rsplit(".", 1)[-1], r["id"], r[column]) for r in rows}


def timing(r) -> str:
    t = r.metrics.timings
    return f"{r.metrics.total_seconds:.2f} s (plan {t.get('plan', 0):.2f} s, {r.spark_jobs} Spark jobs)"


def field_id(s: Source, table: str, column: str) -> int:
    from pyiceberg.catalog import load_catalog

    catalog = load_catalog(s.lake.catalog_name, **s.lake.pyiceberg_properties())
    return catalog.load_table(table).schema().find_field(column).field_id


def test_a_rename_on_two_shards_at_different_times_keeps_the_column(ddl_source, spark, lake):
    s = ddl_source
    s.capture()  # installs the trigger and records the tables' columns
    s.bootstrap(s.block)
    cur, cl = s.block.current_table, s.block.changelog_table
    type_id = field_id(s, cur, "type")
    b0, b1 = s.wl.first_id["s0"], s.wl.first_id["s1"]

    # Batch 0, for comparison: the same writes as batch 1, no DDL.
    s.execute(
        f"UPDATE s0.block SET type = 'x' WHERE id = {b0}",
        f"UPDATE s0.block SET type = 'y' WHERE id = {b0 + 1}",
        f"UPDATE s1.block SET type = 'z' WHERE id = {b1}",
    )
    r0 = s.ingest(s.block, s.capture().manifest.run_id)
    assert r0.metrics.status == "ok", r0

    # Batch 1: s0 renames between two of its writes, all three in one transaction (the writes
    # share the rename's commit LSN); s1 writes under the old name.
    s.execute(
        f"BEGIN; UPDATE s0.block SET type = 'before' WHERE id = {b0}; "
        "ALTER TABLE s0.block RENAME COLUMN type TO kind; "
        f"UPDATE s0.block SET kind = 'after' WHERE id = {b0 + 1}; COMMIT",
        "ALTER TABLE s0.block ALTER COLUMN kind SET DEFAULT 'text'",
        f"UPDATE s1.block SET type = 'old-name' WHERE id = {b1}",
    )
    m = s.capture().manifest
    assert [(d.table, d.renamed) for d in m.ddl if d.renamed] == [("s0.block", [["type", "kind"]])], m.ddl
    assert any(d.defaults and d.defaults[0]["column"] == "kind" for d in m.ddl), m.ddl
    r = s.ingest(s.block, m.run_id)
    assert r.metrics.status == "ok" and not r.metrics.quarantined, r
    assert "type" not in spark.table(lake.qualified(cur)).columns
    assert field_id(s, cur, "kind") == type_id  # an Iceberg rename: the same field
    assert lake_values(s, "kind") == source_values(s, {"s0": "kind", "s1": "type"})
    print(f"schema events: ingest without DDL {timing(r0)}; with a rename and a SET DEFAULT {timing(r)}")

    # Batch 2: s1 renames too; s0 adds a new column under the old name after its rename. Anyone
    # may emit a message with the trigger's prefix: a forged rename and a malformed message are
    # left out (the trigger's own log has neither).
    forged = {
        "table": "s0.block",
        "tag": "ALTER TABLE",
        "before": {"3": {"name": "parent_id", "type": "bigint"}},
        "after": {"3": {"name": "hijacked", "type": "bigint"}},
    }
    s.execute(
        f"SELECT pg_logical_emit_message(true, '{DDL_PREFIX}', '{json.dumps(forged)}')",
        f"SELECT pg_logical_emit_message(true, '{DDL_PREFIX}', 'not json')",
        f"UPDATE s1.block SET type = 'still-old' WHERE id = {b1 + 1}",
        "ALTER TABLE s1.block RENAME COLUMN type TO kind",  # and s1 writes nothing after it
        "ALTER TABLE s0.block ADD COLUMN type text",
        f"UPDATE s0.block SET type = 'a new column' WHERE id = {b0}",
    )
    m = s.capture().manifest
    assert [(d.table, d.renamed) for d in m.ddl if d.renamed] == [("s1.block", [["type", "kind"]])], m.ddl
    r = s.ingest(s.block, m.run_id)
    assert r.metrics.status == "ok" and not r.metrics.quarantined, r
    assert field_id(s, cur, "kind") == type_id and field_id(s, cur, "type") != type_id
    assert "parent_id" in spark.table(lake.qualified(cur)).columns
    # s1 wrote nothing after its rename: its known columns follow the rename all the same.
    wm = read_watermark(spark, lake.qualified(cur))
    s1_known = next(p.columns for shard, p in wm.shards.items() if shard.endswith("s1"))
    assert "kind" in s1_known and "type" not in s1_known, s1_known
    assert lake_values(s, "kind") == source_values(s, {"s0": "kind", "s1": "kind"})
    assert lake_values(s, "type") == {
        (sh, i, "a new column" if (sh, i) == ("s0", b0) else None) for sh, i, _ in lake_values(s, "kind")
    }
    assert_lake_equals_source(spark, lake, s.block, s.dsn, skip=("type",))

    # The changelog kept the column's history under its new name.
    hist = spark.table(lake.qualified(cl)).where(f"id = {b0} AND _cdc_shard LIKE '%s0'").select("kind").collect()
    assert "before" in {row["kind"] for row in hist}, hist


def ddl_between_writes(s: Source, schema: str, b: int, new_id: int) -> None:
    """Every DDL kind the trigger records, each between writes, on one shard: ADD with a default
    (older rows get it), a widening type change, SET DEFAULT (an insert after it takes it), DROP."""
    s.execute(
        f"UPDATE {schema}.block SET version = version + 1 WHERE id = {b}",
        f"ALTER TABLE {schema}.block ADD COLUMN note text DEFAULT 'pre-existing'",
        f"UPDATE {schema}.block SET note = 'written' WHERE id = {b + 1}",
        f"ALTER TABLE {schema}.block ALTER COLUMN version TYPE bigint",
        f"UPDATE {schema}.block SET version = 3000000000 WHERE id = {b + 2}",
        f"ALTER TABLE {schema}.block ALTER COLUMN type SET DEFAULT 'dflt'",
        f"INSERT INTO {schema}.block (id, space_id, created_at, updated_at) VALUES ({new_id}, 1, now(), now())",
        f"ALTER TABLE {schema}.block DROP COLUMN created_day",
        f"UPDATE {schema}.block SET score = 1 WHERE id = {b + 3}",
    )


def test_each_ddl_kind_between_writes_on_two_shards_at_different_times(ddl_source, spark, lake, unique):
    s = ddl_source
    shards = {"conn_id": "cdc_test_source", "database": s.db, "schemas": s.schemas}
    cfg = make_config(
        f"k_{unique}",
        [],
        source={"table": "block", "shards": [shards]},
        schema_changes={"dropped_columns": {"created_day": "keep_null"}},
    )
    s.capture()
    s.bootstrap(cfg)
    kinds = {"added": "note", "retyped": "version", "defaults": "type", "dropped": "created_day"}
    for n, schema in enumerate(s.schemas):  # s0 in one batch, s1 in the next
        other = s.schemas[1 - n]
        b = s.wl.first_id[schema]
        s.execute(f"UPDATE {other}.block SET score = score + 1 WHERE id = {s.wl.first_id[other]}")
        ddl_between_writes(s, schema, b, b + 900_000)
        m = s.capture().manifest
        seen = {k for d in m.ddl if d.table == f"{schema}.block" for k in kinds if getattr(d, k)}
        assert seen == set(kinds), m.ddl
        r = s.ingest(cfg, m.run_id)
        assert r.metrics.status == "ok" and not r.metrics.quarantined, r
        # Until its own ADD, the other shard has no `note`: compared column by column below.
        assert_lake_equals_source(spark, lake, cfg, s.dsn, skip=("created_day", "note") if n == 0 else ("created_day",))
        s.block = cfg  # for lake_values
        notes = lake_values(s, "note")
        added = s.schemas[: n + 1]  # the shards that ran their ADD so far
        assert {v for v in notes if v[0] in added} == source_values(s, dict.fromkeys(added, "note"))
        assert all(v[2] is None for v in notes if v[0] not in added)
        table = spark.table(lake.qualified(cfg.current_table))
        assert dict(table.dtypes)["version"] == "bigint"
        # The dropped column is kept NULL from the drop on (keep_null); older values stay.
        dropped = table.where(f"_cdc_shard LIKE '%{schema}' AND id = {b + 3}").select("created_day").first()
        assert dropped is not None and dropped[0] is None
        inserted = table.where(f"_cdc_shard LIKE '%{schema}' AND id = {b + 900_000}").select("type").first()
        assert inserted is not None and inserted[0] == "dflt"


def test_without_the_privilege_nothing_is_installed_and_the_miss_is_named(ddl_source, pg, unique):
    s = ddl_source
    role = f"cdc_noddl_{unique}"
    s.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'x'", f"GRANT ALL ON SCHEMA s0 TO {role}")
    conn = psycopg2.connect(pg.dsn(s.db, user=role, password="x"))
    try:
        missed = ensure_ddl_capture(conn, [("s0", "block")])
        assert missed and "superuser" in missed and "drop plus an add" in missed
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_event_trigger WHERE evtname = %s", (TRIGGER,))
            assert cur.fetchone()[0] == 0
    finally:
        conn.close()
        s.execute(f"DROP OWNED BY {role}", f"DROP ROLE {role}")
    assert DDL_SCHEMA == "_cdc_lakehouse"
