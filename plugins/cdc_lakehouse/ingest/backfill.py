"""Values of columns added at the source, for the rows that existed before the ALTER.

`ALTER TABLE ... ADD COLUMN c ... DEFAULT x` writes no change events for existing rows: with a
constant default PostgreSQL records the value once in the catalog (`attmissingval`, the "fast
default") and every old row reads it; a volatile default (`DEFAULT random()`) rewrites the table,
again without events. Left alone, the lake would show NULL for those rows forever.

For each shard whose change events announce the new column (the capture's schema change, at the
commit LSN L of the first transaction that used it), the rows the lake holds at a position below
L get the source's value:
  - nothing to do when the column has no default (the rows are NULL at the source too);
  - the catalog's missing value when it has one (exact, no scan);
  - otherwise the column re-read from the source for those keys (its current value; a row
    changed since has events at or after L, which the ingest applies afterwards).
Each backfilled row is also written to the changelog at (L, -1), between its last event and
any later one, so the changelog's latest-per-key view agrees. A re-read value may be newer than
the watermark (a later transaction set it): the commit carries how far the read reached
(`cdc.read-upto`), so no consistent point forms below that (lake.points; #51).

It runs after the batch's MERGE (rows updated by the batch's events from before the ALTER need
the value too), so the MERGE's watermark lists the pending backfill and the next ingest run
finishes it if this one dies first; every step is idempotent.

A quiet shard sends no relation message: a column added on every shard reaches the lake with the
first written shard's events (or a re-bootstrap of some shards), while the other shards' rows
would stay NULL where their source holds the default. So after every batch, each shard whose
known columns (its watermark's `columns`, and its `filled` columns below) lack a lake column is
filled the same way at its new position P, (P, -1): every row the lake holds for it is below P,
and the changelog's readers count a row at (P, < 0) in the table at P, like a bootstrap's. Only a
shard whose position moved in the batch: at an unmoved position a bootstrap's rows may sit at
(P, -1) already. The columns its source has are then recorded in its watermark's `filled` (one
commit), so this happens once; a column its source lacks is looked up again after the next batch
(a shard-by-shard migration). The shard's own relation message later announces the column as
new and the per-shard backfill above runs as well: same values, and it also covers a row changed
by an event from before the shard's ALTER. Not covered: such an event committed between the
shard's last capture and the fill when the shard sends nothing after its ALTER (the audit finds
it). A column kept after a drop (schema_changes.dropped_columns: keep_null) is not filled.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from cdc_lakehouse.columns import (
    INGESTED_COL,
    LSN_COL,
    LSN_EVENT_COL,
    OP_COL,
    RUN_COL,
    SEQ_COL,
    SHARD_COL,
    UNAVAILABLE_COL,
    XID_COL,
)
from cdc_lakehouse.config import ShardGroup, TableConfig
from cdc_lakehouse.identifiers import pg_qualified, spark_ident
from cdc_lakehouse.lake import writers
from cdc_lakehouse.lake.casts import cast_text
from cdc_lakehouse.lake.commits import (
    ConcurrentWriterError,
    fenced_commit,
    sql_with_commit_properties,
    with_commit_retries,
)
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import conform_to, null_metadata, source_columns_of
from cdc_lakehouse.landing.reader import Plan
from cdc_lakehouse.runtime.phases import local_checkpoint
from cdc_lakehouse.settings import LakeSettings, SourceEndpoint, source_uri
from cdc_lakehouse.source.catalog import describe_table
from cdc_lakehouse.source.session import SESSION_OPTIONS
from cdc_lakehouse.source.slots import wal_insert_position
from cdc_lakehouse.watermark import PendingBackfill, Watermark

if TYPE_CHECKING:
    from collections.abc import Callable

    from psycopg2.extensions import connection
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)


def columns_to_backfill(cfg: TableConfig, plan: Plan, wm: Watermark) -> list[PendingBackfill]:
    """The batch's schema changes that added columns to a shard, each with the columns it added.

    A shard's known columns are kept in its watermark (set by the bootstrap): a column seen for
    the first time since is new even when the capture had no earlier schema to diff with (no
    events of the shard since its bootstrap). Updates the new watermark's known columns."""
    shard_of = {(g.endpoint_id, schema): shard for g, schema, shard in cfg.shards()}
    known = {s: set(v.columns) for s, v in wm.shards.items() if v.columns is not None}
    out = []
    for c in plan.schema_changes:
        ch = c.change
        shard = shard_of.get((c.endpoint, ch.table.rpartition(".")[0]))
        if shard is None:
            continue
        if shard in known and ch.columns is not None:
            new = [col for col in ch.columns if col not in known[shard]]
        else:
            new = list(ch.added)
        if ch.columns is not None:
            known[shard] = set(ch.columns)
        if new:
            # As the watermark's pending backfill keeps it: the change, its endpoint, what it added.
            out.append(PendingBackfill.model_validate({**ch.to_dict(), "endpoint": c.endpoint, "added": new}))
    for shard, cols in known.items():
        pos = plan.new_watermark.shards.get(shard)
        if pos is not None:
            pos.columns = sorted(cols)
            if pos.filled:  # a column the shard has announced itself is no longer the fill's
                pos.filled = sorted(set(pos.filled) - cols)
    return out


def quiet_shard_fills(
    cfg: TableConfig, old_wm: Watermark, new_wm: Watermark, lake_cols: list[tuple[str, str]]
) -> list[PendingBackfill]:
    """For each shard whose position moved and whose known columns lack lake columns, the fill at
    its new position, shaped like a schema change (see the module's docstring). A Debezium-fed
    table has no relation messages, known columns or source connection for this: none."""
    if cfg.landing.kind == "debezium_s3":
        return []
    # keep_null: the column was dropped at the source and stays NULL from then on, by choice.
    kept = {c for c, policy in cfg.schema_changes.dropped_columns.items() if policy == "keep_null"}
    out = []
    for group, schema, shard in cfg.shards():
        pos, was = new_wm.shards.get(shard), old_wm.shards.get(shard)
        if pos is None or pos.columns is None or was is None or pos.lsn <= was.lsn:
            continue
        have = set(pos.columns) | set(pos.filled or [])
        missing = [c for c, _ in lake_cols if c not in have and c not in kept and c not in cfg.primary_key]
        if missing:
            table = f"{schema}.{cfg.source.table}"
            out.append(PendingBackfill(table=table, endpoint=group.endpoint_id, at_commit_lsn=pos.lsn, added=missing))
    return out


def fill_quiet_shards(
    spark: SparkSession, lake: LakeSettings, cfg: TableConfig, cur: str, plan: Plan, old_wm: Watermark, run: str
) -> int:
    """Fill the lake columns the batch's quiet shards lack (quiet_shard_fills), then record the
    columns their sources have in their watermark's `filled`. Returns rows filled."""
    lake_cols = source_columns_of(spark, cur, cfg)
    fills = quiet_shard_fills(cfg, old_wm, plan.new_watermark, lake_cols)
    if not fills:
        return 0
    shard_of: dict[tuple[str | None, str], str] = {(g.endpoint_id, schema): shard for g, schema, shard in cfg.shards()}
    new = plan.new_watermark.model_copy(deep=True)
    total = 0
    for ch in fills:
        n, present = backfill_change(spark, lake, cfg, ch, dict(lake_cols), f"quiet-{run}")
        total += n
        if present:
            pos = new.shards[shard_of[ch.shard_schema()]]
            pos.filled = sorted({*(pos.filled or []), *present})
    if new != plan.new_watermark:
        mark = backfill_marker(spark, cur, new)
        fenced_commit(spark, cur, plan.new_watermark, new, mark, what=f"{cfg.name} quiet shards filled")
        plan.new_watermark = new
    return total


def finish_backfill(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    cur: str,
    plan: Plan,
    added: list[PendingBackfill],
    ingest_run: str,
) -> tuple[int, bool]:
    """Fill the columns the batch added for rows that predate them, then clear the pending mark.
    Returns the rows filled, and False when another writer moved the table first and had
    cleared the mark: this run's MERGE applied the batch, that writer finished its backfill
    (the next run's start does, ingest.ingest_table.plan_batch) and filled its own quiet shards. Merging
    the values again is harmless (rows still below the column's position only, source values);
    the run converges instead of failing a task whose batch is in (#51)."""
    lake_cols = source_columns_of(spark, cur, cfg)
    n = backfill_added_columns(spark, lake, cfg, added, lake_cols, ingest_run)
    done = plan.new_watermark.without_backfill()
    clear = backfill_marker(spark, cur, done)
    try:
        fenced_commit(spark, cur, plan.new_watermark, done, clear, what=f"{cfg.name} backfill done")
    except ConcurrentWriterError:
        now = read_watermark(spark, cur)
        if now is None or _change_ids(now.backfill or []) & _change_ids(added):
            raise  # the mark is still there: the table moved some other way
        log.warning(
            "%s: another writer moved the table past this batch and finished its backfill of %s; this "
            "run's MERGE applied the batch, nothing more to do",
            cfg.name,
            sorted({c for ch in added for c in ch.added}),
        )
        return n, False
    plan.new_watermark = done
    return n, True


def _change_ids(changes: list[PendingBackfill]) -> set[tuple[str | None, str | None, int | None]]:
    return {ch.change_id() for ch in changes}


def backfill_marker(spark: SparkSession, cur: str, watermark: Watermark) -> Callable[[str], None]:
    """The write of a backfill's closing commit for lake.commits.fenced_commit: no rows, only the
    new watermark, named a backfill (lake.writers) so readers of ranges diff across it."""

    def write(target: str) -> None:
        spark.createDataFrame([], spark.table(cur).schema).writeTo(target).option(
            "snapshot-property.cdc.watermark", watermark.to_json()
        ).option(f"snapshot-property.{writers.WRITER_PROP}", writers.BACKFILL.name).append()

    return write


#: Added columns' values that are constants: column -> the source catalog's missing value, as
#: text (pg_attribute.attmissingval), cast to the lake's type where it is used.
MissingValues = dict[str, str | None]


def added_column_source(conn: connection, schema: str, table: str, column: str) -> tuple[str, str | None]:
    """How the rows that predate `column` get their value: ("none", None) (no default: NULL),
    ("missing", text), ("reread", None), or ("absent", None) when the source has no such column."""
    with conn.cursor() as cur:
        cur.execute(
            """
            SELECT a.atthasmissing, (a.attmissingval::text::text[])[1], d.adbin IS NOT NULL
            FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
            WHERE a.attrelid = %s::regclass AND a.attname = %s AND NOT a.attisdropped
            """,
            (pg_qualified(schema, table), column),
        )
        row = cur.fetchone()
    if row is None:
        return "absent", None  # not (or no longer) at this shard's source: nothing to fill
    has_missing, missing, has_default = row
    if has_missing:
        return "missing", missing
    return ("reread", None) if has_default else ("none", None)


def backfill_added_columns(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    changes: list[PendingBackfill],
    lake_cols: list[tuple[str, str]],
    run_label: str,
) -> int:
    """Fill columns added by `changes` (the batch's schema changes); returns rows backfilled."""
    types = dict(lake_cols)
    return sum(backfill_change(spark, lake, cfg, ch, types, run_label)[0] for ch in changes)


def backfill_change(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    ch: PendingBackfill,
    types: dict[str, str],
    run_label: str,
) -> tuple[int, list[str]]:
    """Fill the columns one schema change added, for its shard's rows below its position.
    Returns the rows filled and the added columns the shard's source has."""
    import psycopg2

    groups: dict[tuple[str | None, str], tuple[ShardGroup, str]] = {
        (g.endpoint_id, schema): (g, shard) for g, schema, shard in cfg.shards()
    }
    if ch.table is None:
        raise ValueError(
            f"{cfg.name}: a pending column backfill in the table's watermark names no source table "
            f"({ch.to_json()}); the ingest writes every entry with one: re-bootstrap the table's shards"
        )
    schema = ch.shard_schema()[1]
    target = groups.get(ch.shard_schema()) if ch.endpoint is not None else None
    added = [c for c in ch.added if c in types]
    if target is None or not added or ch.at_commit_lsn is None:
        return 0, []
    group, shard = target
    ep = SourceEndpoint.from_uri(source_uri(group.conn_id), group.database)
    conn = psycopg2.connect(ep.dsn(), options=SESSION_OPTIONS, application_name="cdc_lakehouse backfill")
    try:
        how = {c: added_column_source(conn, schema, cfg.source.table, c) for c in added}
        present = [c for c, (kind, _) in how.items() if kind != "absent"]
        wanted = {c: v for c, v in how.items() if v[0] in ("missing", "reread")}
        if not wanted:
            return 0, present
        values = _values(spark, cfg, conn, ep.dsn(), schema, shard, wanted, types)
        upto = None if isinstance(values, dict) else wal_insert_position(conn)
    finally:
        conn.close()
    return _apply(spark, lake, cfg, shard, ch.at_commit_lsn, values, list(wanted), run_label, upto), present


def _values(
    spark: SparkSession,
    cfg: TableConfig,
    conn: connection,
    dsn: str,
    schema: str,
    shard: str,
    wanted: dict[str, tuple[str, str | None]],
    types: dict[str, str],
) -> DataFrame | MissingValues:
    """Constants (catalog missing values) as a dict, or the re-read columns as a DataFrame by key,
    read typed as the snapshot bootstrap reads them (bootstrap.typed_select, ADBC's binary COPY
    into Arrow)."""
    import pyarrow as pa

    from cdc_lakehouse.bootstrap.copy_read import arrow_schema, conform, connect, output_schema
    from cdc_lakehouse.bootstrap.typed_select import typed_select

    if all(kind == "missing" for kind, _ in wanted.values()):
        return {c: v for c, (_, v) in wanted.items()}
    with conn.cursor() as cur:
        info = describe_table(cur, schema, cfg.source.table)
        info_types = {c.name: c.pg_type for c in info.columns} if info else {}
    cols = [*cfg.primary_key, *wanted]
    select = typed_select([(c, types[c]) for c in cols], info_types)
    delivered = tuple(select.spark_types(numeric_as_text=True))
    arrow = arrow_schema(delivered)
    with connect(dsn, "cdc_lakehouse backfill") as reader, reader.cursor() as cur:
        cur.execute(f"SELECT {select.select_list()} FROM {pg_qualified(schema, cfg.source.table)}")
        table = pa.Table.from_batches([conform(b, arrow, shard) for b in cur.fetch_record_batch()], schema=arrow)
    # As before this reader: a value that does not fit is NULL here (not checked, unlike the bootstrap).
    return select.lake_values(spark.createDataFrame(table, output_schema(delivered)))


def _apply(
    spark: SparkSession,
    lake: LakeSettings,
    cfg: TableConfig,
    shard: str,
    at_lsn: int,
    values: DataFrame | MissingValues,
    columns: list[str],
    run_label: str,
    read_upto: int | None,
) -> int:
    """The filled rows into the changelog, then the current table. `read_upto`: where the
    source's values were re-read (None for a catalog constant, which is the value at the ALTER)."""
    cur = lake.qualified(cfg.current_table)
    cl = lake.qualified(cfg.changelog_table)
    filled = local_checkpoint(_filled_rows(spark, cfg, cur, shard, at_lsn, values, columns))
    n = filled.count()
    if n == 0:
        return 0
    # The changelog first (history of the value), then the current table; both idempotent.
    _backfill_changelog(spark, cfg, cl, shard, at_lsn, filled, run_label)
    _backfill_current(spark, cfg, cur, shard, at_lsn, filled, columns, read_upto)
    log.info("%s: %d row(s) of shard %s got the source's value of added column(s) %s", cfg.name, n, shard, columns)
    return n


def _filled_rows(
    spark: SparkSession,
    cfg: TableConfig,
    cur: str,
    shard: str,
    at_lsn: int,
    values: DataFrame | MissingValues,
    columns: list[str],
) -> DataFrame:
    """The shard's live rows from before the ALTER, with the added columns' values."""
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    types = {f.name: f.dataType.simpleString() for f in spark.table(cur).schema.fields}
    older = spark.table(cur).filter((F.col(SHARD_COL) == shard) & (F.col(LSN_COL) < at_lsn))
    if cfg.deletes == "soft":
        older = older.filter(~F.col(cfg.soft_delete_columns.flag))
    if isinstance(values, dict):
        filled = older
        for c, text in values.items():
            filled = filled.withColumn(c, cast_text(F.lit(text), types[c]))
        return filled
    return older.drop(*columns).join(values.drop(*[c for c in values.columns if c not in key + columns]), key, "inner")


def _backfill_changelog(
    spark: SparkSession, cfg: TableConfig, cl: str, shard: str, at_lsn: int, filled: DataFrame, run_label: str
) -> None:
    """Each filled row as an event at (L, -1), unless an earlier attempt wrote it already."""
    from pyspark.sql import functions as F

    key = [SHARD_COL, *cfg.primary_key]
    at = F.lit(at_lsn).cast("bigint")
    events = (
        filled.withColumn(OP_COL, F.lit("r"))
        .withColumn(LSN_COL, at)
        .withColumn(SEQ_COL, F.lit(-1).cast("bigint"))
        .withColumn(LSN_EVENT_COL, at)
        .withColumn(XID_COL, null_metadata(XID_COL))
        .withColumn(UNAVAILABLE_COL, null_metadata(UNAVAILABLE_COL))
        .withColumn(RUN_COL, F.lit(f"backfill-{run_label}"))
        .withColumn(INGESTED_COL, F.current_timestamp())
    )
    done = spark.table(cl).filter((F.col(SHARD_COL) == shard) & (F.col(LSN_COL) == at_lsn) & (F.col(SEQ_COL) == -1))
    events = events.join(done.select(*key), key, "left_anti")
    with_commit_retries(
        lambda: (
            conform_to(events, spark.table(cl).schema)
            .writeTo(cl)
            .option(f"snapshot-property.{writers.WRITER_PROP}", writers.BACKFILL.name)
            .append()
        ),
        what=f"{cfg.name} backfill changelog",
    )


def _backfill_current(
    spark: SparkSession,
    cfg: TableConfig,
    cur: str,
    shard: str,
    at_lsn: int,
    filled: DataFrame,
    columns: list[str],
    read_upto: int | None,
) -> None:
    """The values into the rows still below L: a row an event changed since keeps that event's.

    Re-read values are the source's at the read, which may be past the watermark (#51: a
    transaction after it that also wrote another table): the commit says how far the read
    reached (`cdc.read-upto`), so no consistent point forms below that (lake.points)."""
    key = [SHARD_COL, *cfg.primary_key]
    view = f"cdc_backfill_{cfg.name}"
    filled.select(*key, *columns).createOrReplaceTempView(view)
    on = " AND ".join(f"t.{spark_ident(k)} = s.{spark_ident(k)}" for k in key)
    sets = ", ".join(f"t.{spark_ident(c)} = s.{spark_ident(c)}" for c in columns)
    sql = f"MERGE INTO {cur} t USING {view} s ON {on} AND t.{LSN_COL} < {at_lsn} WHEN MATCHED THEN UPDATE SET {sets}"
    # Rows changed below the watermark, and no changelog range ends here: readers of ranges diff
    # across this commit (lake.ranges), which its writer property tells them.
    props = writers.BACKFILL.props()
    if read_upto is not None:
        props[writers.READ_UPTO_PROP] = json.dumps({shard: read_upto})
    with_commit_retries(lambda: sql_with_commit_properties(spark, sql, props), what=f"{cfg.name} backfill")
