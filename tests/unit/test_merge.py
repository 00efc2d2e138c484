"""The MERGE that applies a reduced batch: its SQL text, the LSN guard, and the statement run
against two tiny Iceberg tables (filesystem catalog, no PostgreSQL)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from cdc_lakehouse.columns import COMMIT_TS_COL, LSN_COL, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.identifiers import IdentifierError
from cdc_lakehouse.lake.merge import lsn_newer, merge_sql
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from tests.conftest import make_config
from tests.unit.conftest import UNIT_CATALOG

NEWER = f"(s.{LSN_COL} > t.{LSN_COL} OR (s.{LSN_COL} = t.{LSN_COL} AND s.{SEQ_COL} > t.{SEQ_COL}))"
DATA = ["order", "title"]  # `order` is a SQL keyword: it only works quoted
COLUMNS = [SHARD_COL, "id", *DATA, OP_COL, LSN_COL, SEQ_COL, COMMIT_TS_COL]


def hard_cfg():
    return make_config("mg", ["s1", "s2"])


def soft_cfg():
    return make_config("mg", ["s1", "s2"], deletes="soft")


# --- the SQL text ----------------------------------------------------------------------------------


def test_hard_merge_guards_both_matched_clauses_with_the_lsn_order():
    sql = merge_sql(hard_cfg(), "cat.ns.cur", "batch", COLUMNS, [])
    assert sql.startswith(
        "MERGE INTO cat.ns.cur t USING batch s ON t.`_cdc_shard` = s.`_cdc_shard` AND t.`id` = s.`id` "
    )
    matched = re.findall(r"WHEN MATCHED AND (.*?) THEN", sql)
    assert len(matched) == 2
    assert all(m.startswith(NEWER) for m in matched)
    assert sql.count(NEWER) == 2
    # The delete clause comes first: a matched delete must not fall through to the update.
    assert sql.index(f"{NEWER} AND s.{OP_COL} = 'd' THEN DELETE") < sql.index(f"{NEWER} THEN UPDATE SET")
    assert f"WHEN NOT MATCHED AND s.{OP_COL} <> 'd' THEN INSERT" in sql
    assert "NOT MATCHED BY SOURCE" not in sql


def test_every_column_is_quoted_in_set_insert_and_values():
    sql = merge_sql(hard_cfg(), "cur", "batch", COLUMNS, [])
    for c in COLUMNS:
        assert f"t.`{c}` = s.`{c}`" in sql
    ins_cols = re.search(r"THEN INSERT \((.*?)\) VALUES \((.*?)\)", sql)
    assert ins_cols.group(1) == ", ".join(f"`{c}`" for c in COLUMNS)
    assert ins_cols.group(2) == ", ".join(f"s.`{c}`" for c in COLUMNS)


def test_invalid_column_name_is_refused_not_spliced():
    with pytest.raises(IdentifierError):
        merge_sql(hard_cfg(), "cur", "batch", [*COLUMNS, "x = 1 --"], [])


def test_truncated_shards_delete_rows_the_batch_did_not_touch():
    sql = merge_sql(hard_cfg(), "cur", "batch", COLUMNS, ["s1", "s2"])
    assert sql.endswith(f" WHEN NOT MATCHED BY SOURCE AND t.{SHARD_COL} IN ('s1', 's2') THEN DELETE")


def test_soft_merge_flags_deletes_and_clears_the_flag_on_upsert():
    sql = merge_sql(soft_cfg(), "cur", "batch", COLUMNS, [])
    assert sql.count(NEWER) == 2
    assert "THEN DELETE" not in sql
    assert (
        f"WHEN MATCHED AND {NEWER} AND s.{OP_COL} = 'd' THEN UPDATE SET t.`is_deleted` = true, "
        f"t.`deleted_at` = s.{COMMIT_TS_COL}, t.{OP_COL} = 'd', t.{LSN_COL} = s.{LSN_COL}, "
        f"t.{SEQ_COL} = s.{SEQ_COL}, t.{COMMIT_TS_COL} = s.{COMMIT_TS_COL} "
    ) in sql
    assert "t.`is_deleted` = false, t.`deleted_at` = NULL WHEN NOT MATCHED" in sql
    assert sql.endswith(
        "`is_deleted`, `deleted_at`) VALUES (" + ", ".join(f"s.`{c}`" for c in COLUMNS) + ", false, NULL)"
    )


def test_soft_merge_of_truncated_shards_flags_only_live_rows():
    cfg = make_config("mg", ["s1"], deletes="soft", soft_delete_columns={"flag": "gone", "timestamp": "gone_at"})
    sql = merge_sql(cfg, "cur", "batch", COLUMNS, ["s1"])
    assert sql.endswith(
        f" WHEN NOT MATCHED BY SOURCE AND t.{SHARD_COL} IN ('s1') AND NOT t.`gone` THEN UPDATE SET "
        "t.`gone` = true, t.`gone_at` = current_timestamp()"
    )


# --- the LSN order -----------------------------------------------------------------------------------


def test_lsn_newer_orders_by_commit_lsn_then_seq(spark):
    df = spark.createDataFrame(
        [
            ("later commit", 101, 0, 100, 9, True),
            ("same commit, later seq", 100, 5, 100, 4, True),
            ("same event", 100, 4, 100, 4, False),
            ("same commit, earlier seq", 100, 3, 100, 4, False),
            ("earlier commit", 99, 9, 100, 0, False),
            ("no row in the table", 100, 4, None, None, None),
        ],
        "case string, a_lsn bigint, a_seq bigint, b_lsn bigint, b_seq bigint, expected boolean",
    )
    got = df.select("case", lsn_newer(F.col("a_lsn"), F.col("a_seq"), F.col("b_lsn"), F.col("b_seq")).alias("newer"))
    assertDataFrameEqual(got, df.select("case", F.col("expected").alias("newer")))


# --- the statement run on Iceberg --------------------------------------------------------------------

SCHEMA = (
    f"{SHARD_COL} string, id bigint, `order` int, title string, {OP_COL} string, "
    f"{LSN_COL} bigint, {SEQ_COL} bigint, {COMMIT_TS_COL} timestamp"
)
T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = datetime(2026, 1, 2, tzinfo=UTC)

TARGET = [
    ("s1", 1, 1, "a", "u", 100, 2, T0),
    ("s1", 2, 2, "b", "u", 100, 2, T0),
    ("s1", 3, 3, "c", "u", 100, 2, T0),
    ("s1", 5, 5, "e", "u", 100, 2, T0),
    ("s2", 1, 1, "x", "u", 50, 2, T0),
    ("s2", 2, 2, "y", "u", 50, 2, T0),
]
BATCH = [
    ("s1", 1, 10, "a2", "u", 100, 4, T1),  # same commit, later seq: update
    ("s1", 2, 20, "stale", "u", 100, 2, T1),  # the event the table has: ignored
    ("s1", 3, None, None, "d", 101, 0, T1),  # later commit: delete
    ("s1", 4, 40, "new", "c", 100, 2, T1),  # new key: insert
    ("s1", 6, None, None, "d", 100, 2, T1),  # delete of a key the table lacks: nothing
    ("s2", 1, None, None, "d", 40, 0, T1),  # older than the table's row: ignored
]


def _tables(spark, unique, extra_cols=""):
    ns = f"{UNIT_CATALOG}.merge_{unique}"
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {ns}")
    cur = f"{ns}.cur"
    spark.sql(f"CREATE TABLE {cur} ({SCHEMA}{extra_cols}) USING iceberg")
    return cur


def _run(spark, cfg, cur, target_rows, truncated, unique):
    spark.createDataFrame(target_rows, spark.table(cur).schema).writeTo(cur).append()
    view = f"batch_{unique}"
    spark.createDataFrame(BATCH, SCHEMA).createOrReplaceTempView(view)
    spark.sql(merge_sql(cfg, cur, view, COLUMNS, truncated))
    return spark.table(cur)


def test_hard_merge_applies_only_newer_events(spark, unique):
    cur = _tables(spark, unique)
    out = _run(spark, hard_cfg(), cur, TARGET, ["s2"], unique)
    expected = [
        ("s1", 1, 10, "a2", "u", 100, 4, T1),
        ("s1", 2, 2, "b", "u", 100, 2, T0),
        ("s1", 4, 40, "new", "c", 100, 2, T1),
        ("s1", 5, 5, "e", "u", 100, 2, T0),  # untouched: s1 was not truncated
        ("s2", 1, 1, "x", "u", 50, 2, T0),  # s2 was truncated, but the batch has this key
    ]
    assertDataFrameEqual(out, spark.createDataFrame(expected, SCHEMA))


def test_soft_merge_flags_instead_of_deleting(spark, unique):
    cur = _tables(spark, unique, ", is_deleted boolean, deleted_at timestamp")
    target = [(*r, False, None) for r in TARGET]
    out = _run(spark, soft_cfg(), cur, target, ["s2"], unique)
    truncated = out.filter("_cdc_shard = 's2' AND id = 2").collect()
    assert len(truncated) == 1
    assert truncated[0]["is_deleted"] is True
    assert truncated[0]["deleted_at"] is not None  # the MERGE's current_timestamp()
    expected = [
        ("s1", 1, 10, "a2", "u", 100, 4, T1, False, None),
        ("s1", 2, 2, "b", "u", 100, 2, T0, False, None),
        ("s1", 3, 3, "c", "d", 101, 0, T1, True, T1),  # values kept, flagged at the commit time
        ("s1", 4, 40, "new", "c", 100, 2, T1, False, None),
        ("s1", 5, 5, "e", "u", 100, 2, T0, False, None),
        ("s2", 1, 1, "x", "u", 50, 2, T0, False, None),
    ]
    assertDataFrameEqual(out.filter("NOT (_cdc_shard = 's2' AND id = 2)"), spark.createDataFrame(expected, out.schema))


def test_soft_deleted_row_comes_back_on_a_newer_upsert(spark, unique):
    cur = _tables(spark, unique, ", is_deleted boolean, deleted_at timestamp")
    spark.createDataFrame([("s1", 7, 7, "g", "d", 90, 2, T0, True, T0)], spark.table(cur).schema).writeTo(cur).append()
    view = f"batch_{unique}"
    spark.createDataFrame([("s1", 7, 8, "back", "c", 95, 0, T1)], SCHEMA).createOrReplaceTempView(view)
    spark.sql(merge_sql(soft_cfg(), cur, view, COLUMNS, []))
    assertDataFrameEqual(
        spark.table(cur),
        spark.createDataFrame([("s1", 7, 8, "back", "c", 95, 0, T1, False, None)], spark.table(cur).schema),
    )


# --- the unchanged TOAST values taken from the table before the MERGE (ingest.ingest_table) ---


@pytest.mark.parametrize("broadcast_bytes", [32 * 1024 * 1024, 0], ids=["broadcast", "shuffled"])
def test_table_fill_gives_matched_rows_the_table_value_and_leaves_orphans_unfilled(spark, monkeypatch, broadcast_bytes):
    """What the MERGE's TOAST CASE used to do, done by classify + fill_from_table: a matched row
    whose `title` the batch could not supply takes the table's; a column the batch did supply is
    kept; a key the table lacks keeps its unfilled mark (an orphan: held, never applied)."""
    from cdc_lakehouse.ingest import ingest_table as run
    from cdc_lakehouse.ingest.batch import ReducedTotals
    from cdc_lakehouse.ingest.toast import UNAV_LEFT

    monkeypatch.setattr(run, "BASE_BROADCAST_BYTES", broadcast_bytes)
    key = [SHARD_COL, "id"]
    table = spark.createDataFrame(TARGET, SCHEMA)
    batch_schema = f"{SCHEMA}, {UNAV_LEFT} array<string>"
    batch = spark.createDataFrame(
        [
            ("s1", 1, 10, None, "u", 101, 0, T1, ["title"]),  # title unchanged: the table's "a"
            ("s1", 2, 20, "b2", "u", 101, 0, T1, []),  # title sent: kept
            ("s1", 3, None, None, "d", 101, 0, T1, []),  # a delete needs nothing
            ("s1", 9, 90, None, "u", 101, 0, T1, ["title"]),  # not in the table: an orphan
            ("s2", 1, 11, None, "u", 40, 0, T1, ["title"]),  # stale, still filled (the guard skips it)
        ],
        batch_schema,
    )
    cfg = hard_cfg()
    totals = ReducedTotals(reduced=5)
    c, base = run.classify(batch, run.table_positions(cfg, table, ["title"]), key, totals, ["title"])
    assert (c.based, c.matched_upserts, c.updates, c.deletes, c.stale) == (2, 3, 2, 1, 1), c
    got = run.fill_from_table(batch, base, key, ["title"])
    expected = [
        ("s1", 1, 10, "a", "u", 101, 0, T1, []),
        ("s1", 2, 20, "b2", "u", 101, 0, T1, []),
        ("s1", 3, None, None, "d", 101, 0, T1, []),
        ("s1", 9, 90, None, "u", 101, 0, T1, ["title"]),
        ("s2", 1, 11, "x", "u", 40, 0, T1, []),
    ]
    assertDataFrameEqual(got, spark.createDataFrame(expected, batch_schema))
    # What reduce_and_classify hands the MERGE: the orphan is gone.
    assert [r["id"] for r in got.filter(~run.needs_base()).orderBy(*key).collect()] == [1, 2, 3, 1]


@pytest.mark.parametrize("mode", ["merge-on-read", "copy-on-write"])
def test_the_merge_summary_counts_what_the_classification_counts(spark, unique, mode):
    """ingest.ingest_table takes inserts, updates and deletes from the MERGE's snapshot summary when no row
    needs a table value (counts_from_merge) instead of classifying the batch against the table
    first. Random tables and batches (stale and newer events, deletes of absent keys, a truncated
    shard): both give the same counts."""
    import random

    from cdc_lakehouse.ingest import ingest_table as run
    from cdc_lakehouse.ingest.batch import ReducedTotals
    from cdc_lakehouse.ingest.toast import UNAV_LEFT
    from cdc_lakehouse.lake.commits import snapshot_summary
    from cdc_lakehouse.lake.ingest_metrics import IngestMetrics

    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    cfg, key = hard_cfg(), [SHARD_COL, "id"]
    target = [(s, i, i, f"t{i}", "u", 100, 2, T0) for s in ("s1", "s2") for i in range(1, 41) if rng.random() < 0.7]
    batch = []
    for s in ("s1", "s2"):
        for i in rng.sample(range(1, 61), 35):
            op, lsn = rng.choice(["c", "u", "d"]), rng.choice([90, 100, 100, 110])
            row = (None, None) if op == "d" else (i * 10, f"b{i}")
            batch.append((s, i, *row, op, lsn, rng.choice([1, 2, 3]), T1))
    cur = _tables(spark, unique)
    spark.sql(f"ALTER TABLE {cur} SET TBLPROPERTIES ('write.merge.mode' = '{mode}')")
    spark.createDataFrame(target, spark.table(cur).schema).writeTo(cur).append()
    reduced = spark.createDataFrame(batch, SCHEMA).withColumn(UNAV_LEFT, F.array().cast("array<string>"))
    totals = ReducedTotals(reduced=len(batch), upserts=sum(r[4] != "d" for r in batch))
    c, _ = run.classify(reduced, run.table_positions(cfg, spark.table(cur)), key, totals)
    counted = run.Outcome(len(batch), 0, None, None, totals.upserts - c.matched_upserts, c.updates, c.deletes)

    view = f"batch_{unique}"
    reduced.drop(UNAV_LEFT).createOrReplaceTempView(view)
    spark.sql(merge_sql(cfg, cur, view, COLUMNS, rng.choice([[], ["s2"]])))
    by_merge, by_classify = (
        IngestMetrics(table_name="mg", ingest_run="r", write_mode=mode),
        IngestMetrics(table_name="mg", ingest_run="r", write_mode=mode),
    )
    assert by_merge.take_merge_counts(snapshot_summary(spark, cur), len(batch))
    counted.set_counts(by_classify)
    got = (by_merge.inserts, by_merge.updates, by_merge.deletes, by_merge.stale_skipped)
    want = (by_classify.inserts, by_classify.updates, by_classify.deletes, by_classify.stale_skipped)
    assert got == want and sum(want[:3]) > 0, (seed, got, want)


def test_the_run_reads_its_own_merge_commit_not_a_later_one(spark, unique):
    """A commit that lands after the MERGE (a compaction, another writer) must not lend the run
    its summary: merge_summary finds the batch's own commit by its id and state."""
    from cdc_lakehouse.ingest import ingest_table as run
    from cdc_lakehouse.lake.batches import BATCH_PROP, BATCH_STATE_PROP, BatchId

    cur = _tables(spark, unique)
    batch = BatchId.of("ingest:test", {"a": 1}, {"a": 2})
    rows = spark.createDataFrame(TARGET, spark.table(cur).schema)
    props = {BATCH_PROP: batch.value, BATCH_STATE_PROP: "{}", "spark.merge-into.num-target-rows-inserted": "6"}
    w = rows.writeTo(cur)
    for k, v in props.items():
        w = w.option(f"snapshot-property.{k}", v)
    w.append()
    rows.writeTo(cur).option("snapshot-property.other", "x").append()  # a later commit, not the batch's
    got = run.merge_summary(spark, cur, batch)
    assert got.get("spark.merge-into.num-target-rows-inserted") == "6" and "other" not in got, got
    assert "other" in run.merge_summary(spark, cur, BatchId("not-this-one"))  # none found: the head's
