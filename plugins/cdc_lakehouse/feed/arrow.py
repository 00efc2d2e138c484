"""The change feed from plain Python (pyiceberg + pyarrow), for consumers too small for Spark.

Same plan (feed.plan), same rows as feed.read: `_feed_op`, the lake key, the table's columns at
the range's snapshot (NULL for a delete). The reads are table scans into the process's memory,
so this suits tables of up to a few million rows; larger consumers use the Spark reader.
Offsets: commit them with the output when it is Iceberg (pyiceberg's `snapshot_properties=` on
append/overwrite, with offsets.offsets_property), else in cdc_meta.feed_offsets from Spark."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cdc_lakehouse.columns import LSN_COL, META_PREFIX, OP_COL, SEQ_COL, SHARD_COL
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.feed.models import (
    FEED_OP_COL,
    OP_DELETE,
    OP_UPSERT,
    FeedOffset,
    FeedRange,
    check_consumer_name,
)
from cdc_lakehouse.feed.plan import plan_range
from cdc_lakehouse.lake.ranges import pyiceberg_snapshots
from cdc_lakehouse.settings import LakeSettings

if TYPE_CHECKING:
    import pyarrow as pa


def load_catalog_for(lake: LakeSettings) -> Any:
    from pyiceberg.catalog import load_catalog

    return load_catalog(lake.catalog_name, **lake.pyiceberg_properties())


def _live(tbl: Any, cfg: TableConfig, snapshot_id: int) -> pa.Table:
    import pyarrow.compute as pc

    t = tbl.scan(snapshot_id=snapshot_id).to_arrow()
    if cfg.deletes == "soft":
        t = t.filter(pc.invert(pc.fill_null(t[cfg.soft_delete_columns.flag], False)))
    return t


def _keys_of(t: pa.Table, key: list[str]) -> list[tuple]:
    return list(zip(*[t[c].to_pylist() for c in key], strict=True)) if t.num_rows else []


def _changelog_keys(catalog: Any, lake: LakeSettings, cfg: TableConfig, rng: FeedRange) -> set[tuple] | None:
    """Keys the changelog gained between the two watermarks (feed.read.changelog_keys' rule:
    exclusive positions, a bootstrap's snapshot rows (seq < 0) belong to its position); None on
    a truncate marker."""
    from pyiceberg.expressions import GreaterThanOrEqual

    lo, hi = rng.lo_watermark, rng.watermark
    floor = min((lo.get(shard, -1) for shard in hi), default=0)  # a shard new in hi starts from -1
    # Keywords: pyiceberg's (term, literal) constructor takes the model's field names too, and the
    # pydantic type-checker plugin knows only those.
    row_filter = GreaterThanOrEqual(term=LSN_COL, value=floor)
    cl = catalog.load_table(cfg.changelog_table).scan(row_filter=row_filter).to_arrow()
    found: set[tuple] = set()
    cols = [SHARD_COL, LSN_COL, SEQ_COL, OP_COL, *cfg.primary_key]
    for row in zip(*[cl[c].to_pylist() for c in cols], strict=True):
        shard, lsn, seq, op, *pk = row
        lo_s, hi_s, snap_row = lo.get(shard, -1), hi.get(shard, -1), seq < 0
        if not ((lsn > lo_s or (lsn == lo_s and not snap_row)) and (lsn < hi_s or (lsn == hi_s and snap_row))):
            continue
        if op == "t":
            return None
        if pk[-1] is not None:
            found.add((shard, *pk))
    return found


def _diff_keys(at_lo: pa.Table, at_hi: pa.Table, key: list[str]) -> set[tuple]:
    def rows(t: pa.Table) -> dict[tuple, tuple]:
        cols = sorted(c for c in t.column_names if not c.startswith(META_PREFIX))
        return dict(zip(_keys_of(t, key), zip(*[t[c].to_pylist() for c in cols], strict=True), strict=True))

    was, now = rows(at_lo), rows(at_hi)
    return {k for k in was.keys() | now.keys() if was.get(k) != now.get(k)}


def _net(at_hi: pa.Table, keys: set[tuple], key: list[str]) -> pa.Table:
    import pyarrow as pa

    index = {k: i for i, k in enumerate(_keys_of(at_hi, key))}
    present = sorted(index[k] for k in keys if k in index)
    gone = sorted(k for k in keys if k not in index)
    ups = at_hi.take(pa.array(present, pa.int64()))
    ups = ups.add_column(0, FEED_OP_COL, pa.array([OP_UPSERT] * ups.num_rows, pa.string()))
    dels = {FEED_OP_COL: pa.array([OP_DELETE] * len(gone), pa.string())}
    for i, c in enumerate(key):
        dels[c] = pa.array([k[i] for k in gone], at_hi.schema.field(c).type)
    for f in at_hi.schema:
        if f.name not in key:
            dels[f.name] = pa.nulls(len(gone), f.type)
    return pa.concat_tables([ups, pa.table(dels).select(ups.column_names).cast(ups.schema)])


def read_changes_arrow(
    lake: LakeSettings, cfg: TableConfig, consumer: str, since: FeedOffset | None, *, upto=None, catalog=None
) -> tuple[FeedRange, pa.Table]:
    """(range, net rows) after `since` up to the newest complete snapshot (or `upto`)."""
    import pyarrow as pa

    check_consumer_name(consumer)
    catalog = catalog or load_catalog_for(lake)
    tbl = catalog.load_table(cfg.current_table)
    snaps, current = pyiceberg_snapshots(tbl)
    rng = plan_range(cfg.current_table, consumer, snaps, current, since, upto)
    at_hi = _live(tbl, cfg, rng.snapshot_id)
    key = cfg.lake_key
    if rng.mode == "full":
        return rng, at_hi.add_column(0, FEED_OP_COL, pa.array([OP_UPSERT] * at_hi.num_rows, pa.string()))
    if rng.mode == "noop":
        return rng, _net(at_hi, set(), key)
    assert since is not None, "without an offset the range is full"
    keys = _changelog_keys(catalog, lake, cfg, rng) if rng.mode == "changelog" else None
    if keys is None:
        keys = _diff_keys(_live(tbl, cfg, since.snapshot_id), at_hi, key)
        if rng.mode == "changelog":
            from dataclasses import replace

            rng = replace(rng, mode="diff", reason="a truncate or re-bootstrap in the range")
    return rng, _net(at_hi, keys, key)
