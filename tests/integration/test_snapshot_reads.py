"""Reads of a table's snapshots skip Spark's REFRESH only when the table has not moved (#56).

lake.snapshots reads snapshots with pyiceberg and refreshes the Spark session's cached copy of
the table only when its metadata file changed since that session's last refresh; lake.tables'
table_exists asks the catalog, not the session. These tests try to catch a session reading a
stale copy: another session commits, or drops the table, between two reads.
"""

from __future__ import annotations

from typing import Any


class CountingSession:
    """The suite's session, counting the REFRESH TABLE statements sent through it."""

    def __init__(self, spark: Any) -> None:
        self._spark = spark
        self.refreshes = 0

    def sql(self, text: str, *args: Any, **kwargs: Any) -> Any:
        if text.startswith("REFRESH TABLE"):
            self.refreshes += 1
        return self._spark.sql(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spark, name)


def test_a_read_refreshes_the_session_only_after_another_writer_moved_the_table(spark, lake, spark_server, unique):
    from cdc_lakehouse.lake.snapshots import read_snapshots
    from cdc_lakehouse.lake.tables import table_exists

    from tests.helpers import suite_spark_session

    table = lake.qualified(f"t.snap_reads_{unique}")
    spark.sql(f"CREATE TABLE {table} (id BIGINT) USING iceberg")
    spark.sql(f"INSERT INTO {table} VALUES (1)")
    other = suite_spark_session(lake, spark_server.url)
    assert other.session_id != spark.session_id
    mine = CountingSession(spark)
    try:
        first = read_snapshots(mine, table)
        assert mine.refreshes == 1 and mine.table(table).count() == 1
        # Unmoved: neither read sends a REFRESH, and the session still reads the table as it is.
        assert read_snapshots(mine, table).current_id == first.current_id
        assert read_snapshots(mine, table).current_id == first.current_id
        assert mine.refreshes == 1 and mine.table(table).count() == 1

        # Another session commits: the next read sees its snapshot and refreshes this session's
        # copy, so what it reads through Spark next has the other writer's row.
        other.sql(f"INSERT INTO {table} VALUES (2)")
        moved = read_snapshots(mine, table)
        assert moved.current_id != first.current_id and moved.current.parent_id == first.current_id
        assert mine.refreshes == 2
        assert sorted(r.id for r in mine.table(table).collect()) == [1, 2]

        # This session's own commit moves the table too: refreshed once, then quiet again.
        mine.sql(f"INSERT INTO {table} VALUES (3)")
        assert read_snapshots(mine, table).current.parent_id == moved.current_id
        read_snapshots(mine, table)
        assert mine.refreshes == 3

        # A drop by the other session: the catalog says so, whatever this session has cached.
        assert table_exists(mine, table)
        other.sql(f"DROP TABLE {table} PURGE")
        assert not table_exists(mine, table)
        assert not table_exists(mine, lake.qualified(f"no_such_namespace_{unique}.t"))
        # Created again under the same name: a new metadata file, so a refresh and the new table.
        other.sql(f"CREATE TABLE {table} (id BIGINT) USING iceberg")
        other.sql(f"INSERT INTO {table} VALUES (4)")
        again = read_snapshots(mine, table)
        assert again.current_id not in first.by_id and len(again.by_id) == 1
        assert mine.refreshes == 4
        assert [r.id for r in mine.table(table).collect()] == [4]
    finally:
        other.sql(f"DROP TABLE IF EXISTS {table} PURGE")
        other.stop()


def test_a_checked_append_to_a_table_without_snapshots_takes_one_spark_job(spark, lake, unique):
    """commit_unless_moved needs a snapshot to branch from: a new table gets an empty one from
    pyiceberg (lake.commits.commit_empty_snapshot), not from a Spark append of no rows. The
    check sees an empty table, the append is the one Spark job, and main is the empty snapshot
    then the append; a second call with the same check publishes nothing."""
    from cdc_lakehouse.lake.commits import commit_unless_moved
    from cdc_lakehouse.lake.snapshots import current_ancestors
    from cdc_lakehouse.runtime.phases import SparkJobs

    table = lake.qualified(f"t.first_snap_{unique}")
    spark.sql(f"CREATE TABLE {table} (id BIGINT) USING iceberg")
    seen: list[int] = []

    def plan(snapshots):
        chain = list(snapshots)
        seen.append(len(chain))
        return None if any(s.operation == "append" and s.summary.get("added-records") for s in chain) else [1, 2]

    def write(target, ids):
        spark.createDataFrame([(i,) for i in ids], "id BIGINT").writeTo(target).append()

    with SparkJobs(spark, "first append") as jobs:
        assert commit_unless_moved(spark, table, plan, write, what="first append") == [1, 2]
    assert jobs.count == 1, jobs.sites
    chain = list(current_ancestors(spark, table))
    assert [s.summary.get("added-records", "0") for s in chain] == ["2", "0"], chain
    assert commit_unless_moved(spark, table, plan, write, what="again") is None
    assert seen == [1, 2] and sorted(r.id for r in spark.table(table).collect()) == [1, 2]
