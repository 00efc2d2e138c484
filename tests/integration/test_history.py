"""History tables (docs/history-tables.md): every version of every row, against the source's own
sequence of states.

The reference is the source itself: after each step of the workload the test reads every row of
the source table and the WAL position, and the history read as of that position (the versions
valid there) must equal it. Steps between two captures cover a batch's inner versions; updates
that leave the TOASTed content alone, key changes, deletes and re-inserts of the same key,
multi-statement transactions, a TRUNCATE followed by new rows, and a re-bootstrap of one shard
after changes the stream never delivers; two writers of one batch, one held at its publish. The
permission table's history is checked the same way beside it: a key of two columns, soft deletes
in its current table, a key change of one key column, a key deleted and inserted again.
Then every key change links its two versions, the maintenance's compaction changes nothing, and a
rebuild from the changelog equals the table the runs kept.
"""

from __future__ import annotations

import psycopg2
import yaml
from cdc_lakehouse.columns import (
    IS_CURRENT_COL,
    MOVED_FROM_COL,
    MOVED_TO_COL,
    SHARD_COL,
    VALID_FROM_LSN_COL,
    VALID_TO_LSN_COL,
)
from cdc_lakehouse.config import HistoryConfig
from cdc_lakehouse.history.maintain import maintain_history
from cdc_lakehouse.lake.snapshots import current_snapshot
from cdc_lakehouse.lake.tables import source_columns_of
from cdc_lakehouse.maintenance.maintain_table import maintain_table
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from tests.helpers import source_df
from tests.integration.test_overlapping_writers import overlapping, session_of_its_own


def _lsn(dsn: str) -> int:
    """The WAL's insert position: past every commit so far (the write position can lag behind
    one while synchronous_commit is off)."""
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
            return int(cur.fetchone()[0])
    finally:
        conn.close()


class States:
    """The source's states, each with the WAL position after it, still to be checked."""

    def __init__(self, s, cfg):
        self.s, self.cfg, self.pending = s, cfg, []
        self.cols = source_columns_of(s.spark, s.lake.qualified(cfg.current_table), cfg)

    def record(self) -> None:
        self.pending.append((_lsn(self.s.dsn), source_df(self.s.spark, self.cfg, self.s.dsn, self.cols)))

    def check(self) -> int:
        """The history as of each recorded position equals the source's state there."""
        hist = self.s.spark.table(self.s.lake.qualified(self.cfg.history_table))
        names = [SHARD_COL, *[c for c, _ in self.cols]]
        for lsn, expected in self.pending:
            at = hist.filter(
                (F.col(VALID_FROM_LSN_COL) <= lsn)
                & (F.col(VALID_TO_LSN_COL).isNull() | (F.col(VALID_TO_LSN_COL) > lsn))
            )
            got, want = at.select(*names), expected.select(*names)
            extra, missing = got.exceptAll(want), want.exceptAll(got)
            short = [c for c in names if c != "content"]
            key = [SHARD_COL, *self.cfg.primary_key]
            assert extra.isEmpty() and missing.isEmpty(), (
                f"{self.cfg.name} as of {lsn}: history has {extra.select(*short).collect()[:5]}, "
                f"the source {missing.select(*short).collect()[:5]}; versions "
                f"{hist.join(missing.select(*key), key).drop('content').collect()[:8]}"
            )
        n, self.pending = len(self.pending), []
        return n


def _history_job(tmp_path, s, cfg, mode: str) -> int:
    """The history job (spark_jobs/history.py) on cfg, written as the YAML a deployment has."""
    from cdc_lakehouse.config import parse_table_config
    from cdc_lakehouse.jobs.history import HistoryParams, main

    data = {
        "name": cfg.name,
        "source": {
            "table": "block",
            "shards": [{"conn_id": "cdc_test_source", "database": s.db, "schemas": s.schemas}],
        },
        "primary_key": ["id"],
        "lake": {"namespace": "t"},
        "history": {"enabled": cfg.history.enabled},
    }
    assert parse_table_config(data, "t.yaml")[0] == cfg, "the YAML is the test's config"
    tables = tmp_path / f"tables-{mode}"
    tables.mkdir()
    (tables / f"{cfg.name}.yaml").write_text(yaml.safe_dump(data))
    return main(HistoryParams(tables=(cfg.name,), mode=mode, config_dir=str(tables)))


def test_history_equals_the_sources_states_and_a_rebuild(source, spark, lake, tmp_path):
    s = source
    cfg = s.block.model_copy(update={"history": HistoryConfig(enabled=True)})
    assert _history_job(tmp_path, s, s.block, "incremental") == 1, "a table without a history is refused"
    hist = lake.qualified(cfg.history_table)
    # Keys with a scripted life (s0's highest ids): updated three times per transaction, updated
    # to the values it has, moved to another key and changed again in the same transaction.
    multi, same, moving, moved = 7_000_000_002, 7_000_000_003, 7_000_000_004, 7_000_000_005
    back = 7_000_000_001  # deleted and inserted again in every step
    s.execute(
        "INSERT INTO s0.block (id, space_id, type, content, created_at, updated_at) "
        f"SELECT g, 1, 'text', repeat('y', 4000), now(), now() FROM unnest(ARRAY[{multi}, {same}, {moving}]) g"
    )
    # The permission table beside it: a key of two columns, soft deletes in the current table
    # (the history closes the version all the same), a key change of one of its columns, and a
    # key deleted and inserted again (a soft-deleted row the current table revives).
    perm = s.perm.model_copy(update={"history": HistoryConfig(enabled=True)})
    s.capture()
    s.bootstrap(cfg)
    s.bootstrap(perm)
    first = maintain_history(spark, lake, cfg)
    assert (first.mode, first.reason) == ("full", "the first run")
    assert maintain_history(spark, lake, perm).mode == "full"
    states, perm_states = States(s, cfg), States(s, perm)
    states.record()
    perm_states.record()
    assert states.check() == 1 and perm_states.check() == 1
    assert maintain_history(spark, lake, cfg).mode == "noop"

    for batch in range(3):
        for step in range(2):
            s.wl.step(150, pk_changes=2)  # updates mostly leave the TOASTed content alone
            # A delete and a re-insert of the same key; three updates of one row in one
            # transaction (one version); an update to the same values (no version).
            s.execute(
                f"DELETE FROM s0.block WHERE id = {back}",
                "INSERT INTO s0.block (id, space_id, type, content, created_at, updated_at) "
                f"VALUES ({back}, 1, 'text', 'back {batch} {step}', now(), now())",
                "BEGIN; UPDATE s1.block SET version = version + 1 WHERE id = (SELECT max(id) FROM s1.block); "
                "UPDATE s1.block SET version = version + 1 WHERE id = (SELECT max(id) FROM s1.block); "
                "UPDATE s1.block SET type = 'todo' WHERE id = (SELECT max(id) FROM s1.block); COMMIT",
                "UPDATE s1.block SET type = type WHERE id = (SELECT min(id) FROM s1.block)",
                f"BEGIN; UPDATE s0.block SET version = version + 1 WHERE id = {multi}; "
                f"UPDATE s0.block SET version = version + 1 WHERE id = {multi}; "
                f"UPDATE s0.block SET type = 'todo {batch} {step}' WHERE id = {multi}; COMMIT",
                f"UPDATE s0.block SET type = type WHERE id = {same}",
            )
            # On permission: one key's user_id changed (a key change of one column of two), one
            # key deleted and inserted again with another role.
            s.execute(
                "UPDATE s1.permission SET user_id = user_id + 1000 WHERE (block_id, user_id) = "
                "(SELECT block_id, user_id FROM s1.permission WHERE user_id < 1000 ORDER BY block_id LIMIT 1)",
                f"DELETE FROM s0.permission WHERE block_id = {multi}",
                f"INSERT INTO s0.permission (block_id, user_id, role) VALUES ({multi}, 7, 'role {batch} {step}')",
            )
            if batch == 0 and step == 0:
                s.execute(
                    f"BEGIN; UPDATE s0.block SET id = {moved} WHERE id = {moving}; "
                    f"UPDATE s0.block SET version = version + 1 WHERE id = {moved}; COMMIT"
                )
            if batch == 1 and step == 1:
                s.execute(
                    "TRUNCATE s1.block",
                    "INSERT INTO s1.block (id, space_id, type, content, created_at, updated_at) "
                    "SELECT g, 1, 'page', repeat('x', 5000), now(), now() FROM generate_series(1, 40) g",
                )
            states.record()
            perm_states.record()
        upto = s.capture().manifest.run_id
        r = s.ingest(cfg, upto, run=f"h{batch}")
        assert r.metrics.status == "ok"
        assert s.ingest(perm, upto, run=f"h{batch}").metrics.status == "ok"
        hp = maintain_history(spark, lake, perm)
        assert (hp.mode, hp.late, hp.unresolved) == ("incremental", 0, 0), hp
        assert perm_states.check() == 2
        if batch == 2:
            # Two writers of the same rows: A is held between its write and its publish while B
            # commits; A's publish then finds B's position, the one it would have written.
            other = session_of_its_own(lake)
            with overlapping(hist, lambda other=other: maintain_history(other, lake, cfg)) as a:
                h = maintain_history(spark, lake, cfg)
            assert a.error is None and a.result.mode == "incremental", a.error
            assert maintain_history(spark, lake, cfg).mode == "noop"
        else:
            h = maintain_history(spark, lake, cfg)
        assert (h.mode, h.late, h.unresolved) == ("incremental", 0, 0), h
        assert h.changelog_rows > 0 and h.written > 0
        assert states.check() == 2

    # The permission key changes link both columns of the key; the re-inserted key's versions
    # (one per step, deleted and inserted again each time) follow one another.
    plinks = spark.table(lake.qualified(perm.history_table)).filter(F.col(MOVED_FROM_COL).isNotNull()).collect()
    assert len(plinks) == 6 and all(r[MOVED_FROM_COL].startswith('{"block_id":') for r in plinks), plinks[:2]
    assert spark.table(lake.qualified(perm.history_table)).filter(f"block_id = {multi}").count() == 6

    # One version per transaction that changed the row, none for one that did not; the key
    # change links its two versions though the transaction changed the new key again.
    per_key = {
        r["id"]: r["n"]
        for r in spark.table(hist)
        .filter(F.col("id") >= multi)
        .groupBy("id")
        .count()
        .withColumnRenamed("count", "n")
        .collect()
    }
    assert (per_key[multi], per_key[same], per_key[moving], per_key[moved]) == (7, 1, 1, 1), per_key
    link = spark.table(hist).filter(F.col("id") == moved).collect()[0]
    assert (link[MOVED_FROM_COL], link["version"], link["_cdc_op"]) == (f'{{"id":{moving}}}', 2, "c")
    gone = spark.table(hist).filter(F.col("id") == moving).collect()[0]
    assert gone[MOVED_TO_COL] == f'{{"id":{moved}}}' and gone[VALID_TO_LSN_COL] == link[VALID_FROM_LSN_COL]
    assert spark.table(hist).filter(F.col(VALID_FROM_LSN_COL) >= F.col(VALID_TO_LSN_COL)).isEmpty()

    # A re-bootstrap of one shard after changes the stream will skip (they are below its new
    # position): only the rows that changed get a version, only they and the deleted are closed.
    versions_before = spark.table(hist).count()
    s.execute(
        "UPDATE s0.block SET content = 'rebooted' WHERE id IN (SELECT id FROM s0.block ORDER BY id LIMIT 3)",
        f"DELETE FROM s0.block WHERE id IN (SELECT id FROM s0.block WHERE id < {back} ORDER BY id DESC LIMIT 2)",
    )
    boot = s.bootstrap(cfg, shards=[cfg.shards()[0][2]])
    states.record()
    h = maintain_history(spark, lake, cfg)
    assert h.mode == "incremental"
    after = spark.table(hist)
    assert after.count() == versions_before + 3, "3 new versions; the closed ones are updated in place"
    assert states.check() == 1
    assert s.ingest(cfg, s.capture().manifest.run_id, run="after-boot").metrics.status == "ok"
    maintain_history(spark, lake, cfg)
    assert spark.table(hist).count() == versions_before + 3, f"the stream's skipped changes add nothing ({boot})"

    # Every key change links the version it closed to the one it opened.
    moved = spark.table(hist).filter(F.col(MOVED_FROM_COL).isNotNull())
    assert moved.count() > 0
    closed = spark.table(hist).filter(F.col(MOVED_TO_COL).isNotNull())
    pairs = moved.alias("n").join(
        closed.alias("o"),
        (F.col("n." + SHARD_COL) == F.col("o." + SHARD_COL))
        & (F.col("n." + MOVED_FROM_COL) == F.to_json(F.struct(F.col("o.id").alias("id"))))
        & (F.col("o." + MOVED_TO_COL) == F.to_json(F.struct(F.col("n.id").alias("id"))))
        & (F.col("o." + VALID_TO_LSN_COL) == F.col("n." + VALID_FROM_LSN_COL)),
    )
    assert pairs.count() == moved.count()
    assert (
        spark.table(hist)
        .groupBy(SHARD_COL, "id")
        .agg(F.sum(F.col(IS_CURRENT_COL).cast("int")).alias("n"))
        .filter("n > 1")
        .isEmpty()
    )

    # The table's maintenance compacts and expires it too (its MERGEs leave delete files), content
    # and position unchanged (the run checks the position itself).
    kept = spark.table(hist).collect()
    done = maintain_table(spark, lake, cfg, run_id="h-maint").targets["history"]
    assert done.after["delete_files"] == 0 < done.before["delete_files"] and done.rewritten_data_files
    assertDataFrameEqual(spark.table(hist), spark.createDataFrame(kept, spark.table(hist).schema))
    assert maintain_history(spark, lake, cfg).mode == "noop"

    # A rebuild from the changelog equals what the runs kept: the history job's rebuild (what
    # cdc_history__<table> runs), on the table's YAML.
    before = current_snapshot(spark, hist).snapshot_id
    assert _history_job(tmp_path, s, cfg, "rebuild") == 0
    spark.sql(f"REFRESH TABLE {hist}")
    assert current_snapshot(spark, hist).snapshot_id != before, "the rebuild committed"
    assertDataFrameEqual(spark.table(hist), spark.createDataFrame(kept, spark.table(hist).schema))
    assert maintain_history(spark, lake, cfg).mode == "noop"
