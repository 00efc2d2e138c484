"""Row lineage on a format-v3 table (issue #55): Iceberg 1.12 gives every row a `_row_id` and the
sequence number of the commit that last changed it (`_last_updated_sequence_number`). A reader
can then ask "what changed since snapshot S" of the table itself, without diffing, provided
every writer keeps them: the ingest's MERGE (updates whose unchanged TOAST values it filled,
deletes, inserts, key changes) and the maintenance's compaction.
"""

from __future__ import annotations

from cdc_lakehouse.lake.changelog import changes_between
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.maintenance.rewrite import compact
from cdc_lakehouse.maintenance.targets import table_targets
from pyspark.sql import functions as F

from tests.conftest import make_config
from tests.helpers import assert_lake_equals_source


def lineage(spark, table: str) -> dict[tuple[str, int], tuple[int, int]]:
    """(shard, id) -> (_row_id, _last_updated_sequence_number)."""
    rows = spark.sql(f"SELECT _cdc_shard, id, _row_id, _last_updated_sequence_number FROM {table}").collect()
    return {(r[0], r[1]): (r[2], r[3]) for r in rows}


def test_row_lineage_survives_the_merge_the_toast_fill_and_compaction(source, spark, lake, unique):
    s = source
    shards = {"conn_id": "cdc_test_source", "database": s.db, "schemas": s.schemas}
    cfg = make_config(f"b3_{unique}", [], source={"table": "block", "shards": [shards]}, lake={"format_version": 3})
    table = lake.qualified(cfg.current_table)
    s.capture()
    s.bootstrap(cfg)
    before = lineage(spark, table)
    ids = [v[0] for v in before.values()]
    assert None not in ids and len(set(ids)) == len(ids), "every row has a row id of its own"

    lo = read_watermark(spark, table)
    s.wl.step(300, pk_changes=2)  # most updates leave the TOASTed content alone
    assert s.ingest(cfg, s.capture().manifest.run_id).metrics.status == "ok"
    after = lineage(spark, table)
    hi = read_watermark(spark, table)
    assert lo is not None and hi is not None
    changed = {
        (r[0], r[1])
        for r in changes_between(spark, lake, cfg, lo.shard_lsns(), hi.shard_lsns())
        .filter(F.col("id").isNotNull())
        .select("_cdc_shard", "id")
        .collect()
    }
    kept = set(before) & set(after)
    updated = kept & changed
    assert len(updated) > 100 and len(kept - changed) > 1000
    seq_before = max(v[1] for v in before.values())
    for k in kept - changed:
        assert after[k] == before[k], f"{k}: an unchanged row keeps its row id and sequence number"
    for k in updated:
        assert after[k][0] == before[k][0], f"{k}: an updated row keeps its row id"
        assert after[k][1] > seq_before, f"{k}: an updated row gets the MERGE's sequence number"
    new = set(after) - set(before)
    assert new and all(after[k][1] > seq_before for k in new)
    assert not {after[k][0] for k in new} & set(ids), "a new row (an insert, a key change) gets a new row id"

    out = compact(spark, lake, table_targets(lake, cfg)[0])
    assert out.get("rewritten_data_files", 0) > 0, out
    assert lineage(spark, table) == after, "compaction keeps every row's lineage"
    assert_lake_equals_source(spark, lake, cfg, s.dsn)
