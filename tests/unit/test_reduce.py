"""Pre-combine of a batch: lake order (`_cdc_seq`), primary-key changes, latest event per key."""

from __future__ import annotations

from cdc_lakehouse.columns import LSN_COL, OP_COL, SEQ_COL, SHARD_COL, UNAVAILABLE_COL
from cdc_lakehouse.ingest.reduce import latest_per_key, split_pk_changes
from cdc_lakehouse.ingest.validate import REASONS, typed_events
from pyspark.testing import assertDataFrameEqual

from tests.conftest import make_config

COLS = [("id", "bigint"), ("title", "string"), ("n", "decimal(10,2)")]
SHARDS = {("ep", "s1"): "s1", ("ep", "s2"): "s2"}
OUT = f"{SHARD_COL} string, id bigint, {OP_COL} string, {LSN_COL} bigint, {SEQ_COL} bigint, title string"


def split(landing_events, cfg, *overrides, cols=COLS):
    typed = typed_events(landing_events(*overrides), cfg, cols, SHARDS)
    return split_pk_changes(typed.drop(REASONS, "_raw", "_file"), cfg)


def test_lake_seq_is_twice_the_source_seq_without_key_changes(spark, landing_events):
    cfg = make_config("rd", ["s1"])
    out = split(
        landing_events,
        cfg,
        {"source": {"seq": 1}},
        {"op": "c", "source": {"seq": 2}, "after": {"id": "2", "title": "b", "n": "1.00"}},
        # A before image with the same key (REPLICA IDENTITY FULL) is not a key change.
        {"before": {"id": "1", "title": "a"}, "after": {"id": "1", "title": "z"}, "source": {"seq": 3}},
        {"op": "d", "before": {"id": "2"}, "after": None, "source": {"seq": 4}},
    )
    assertDataFrameEqual(
        out.select(SHARD_COL, "id", OP_COL, LSN_COL, SEQ_COL, "title"),
        spark.createDataFrame(
            [
                ("s1", 1, "u", 100, 2, "a"),
                ("s1", 2, "c", 100, 4, "b"),
                ("s1", 1, "u", 100, 6, "z"),
                ("s1", 2, "d", 100, 8, None),
            ],
            OUT,
        ),
    )


def test_key_change_on_a_composite_key_deletes_the_old_key_first(spark, landing_events):
    cfg = make_config("rd", ["s1"], key=("ws", "id"))
    # body is a lake column: an unavailable column the lake does not hold is dropped (validate).
    cols = [("ws", "bigint"), ("id", "bigint"), ("title", "string"), ("body", "string")]
    out = split(
        landing_events,
        cfg,
        {
            "before": {"ws": "7", "id": "1", "title": "old"},
            "after": {"ws": "7", "id": "2", "title": "moved"},
            "unavailable": ["body"],
            "source": {"seq": 5},
        },
        cols=cols,
    )
    got = out.select("ws", "id", OP_COL, SEQ_COL, "title", "_fill_key_ws", "_fill_key_id", UNAVAILABLE_COL)
    assertDataFrameEqual(
        got,
        spark.createDataFrame(
            [
                # The old key's delete carries no values and nothing unavailable...
                (7, 1, "d", 10, None, 7, 1, None),
                # ...the new key's upsert follows it, and fills unchanged TOAST values from the old key.
                (7, 2, "u", 11, "moved", 7, 1, ["body"]),
            ],
            f"ws bigint, id bigint, {OP_COL} string, {SEQ_COL} bigint, title string, "
            f"_fill_key_ws bigint, _fill_key_id bigint, {UNAVAILABLE_COL} array<string>",
        ),
    )


def test_after_a_key_change_the_old_key_ends_deleted_and_the_new_one_live(spark, landing_events):
    cfg = make_config("rd", ["s1", "s2"])
    out = split(
        landing_events,
        cfg,
        {"op": "c", "after": {"id": "1", "title": "a", "n": "1.00"}, "source": {"commit_lsn": 90, "seq": 9}},
        {"before": {"id": "1"}, "after": {"id": "9", "title": "moved", "n": "1.00"}, "source": {"seq": 2}},
        {"after": {"id": "9", "title": "again", "n": "1.00"}, "source": {"seq": 1}},  # earlier in the commit
        {"after": {"id": "1", "title": "other shard"}, "source": {"schema": "s2", "seq": 1}},
    )
    assertDataFrameEqual(
        latest_per_key(out, [SHARD_COL, "id"]).select(SHARD_COL, "id", OP_COL, LSN_COL, SEQ_COL, "title"),
        spark.createDataFrame(
            [
                ("s1", 1, "d", 100, 4, None),
                ("s1", 9, "u", 100, 5, "moved"),
                ("s2", 1, "u", 100, 2, "other shard"),
            ],
            OUT,
        ),
    )


def test_latest_per_key_keeps_a_final_delete_and_every_other_column(spark):
    schema = f"{SHARD_COL} string, id bigint, {OP_COL} string, {LSN_COL} bigint, {SEQ_COL} bigint, title string"
    df = spark.createDataFrame(
        [
            ("s1", 1, "c", 100, 2, "a"),
            ("s1", 1, "u", 100, 4, "b"),
            ("s1", 1, "d", 200, 0, None),  # later commit, lower seq: still the latest
            ("s1", 2, "u", 300, 2, "x"),
            ("s1", 2, "u", 200, 8, "y"),
        ],
        schema,
    )
    latest = latest_per_key(df, [SHARD_COL, "id"])
    assert latest.columns == df.columns, "no helper column may leak into the batch"
    expected = spark.createDataFrame([("s1", 1, "d", 200, 0, None), ("s1", 2, "u", 300, 2, "x")], schema)
    assertDataFrameEqual(latest, expected)
    assertDataFrameEqual(latest_per_key(latest, [SHARD_COL, "id"]), expected)
