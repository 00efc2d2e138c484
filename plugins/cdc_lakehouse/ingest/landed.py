"""ingest.landed: the batch's landing files as the ingest reads them, whichever format they are in.

Two formats reach the ingest (landing.format). Typed files (format 2, what the capture writes)
hold each image as a struct typed when the values entered, with the text of the values that did
not fit beside it; text files (format 1: runs landed before the upgrade, the Debezium staging, a
quarantined event's payload) hold maps of PostgreSQL text. `Landed` is the batch's files read,
one frame per format and schema version (Spark reads each with its own schema), and `Images`
is how validation (ingest.validate) gets, per format, each lake column's value in its lake type
and the reason it does not fit:

    typed, same type       the value as landed; misfits: the text kept at capture
    typed, another type    a cast to the lake's type, kept only if it casts back to the same value
                           (a column widened since, or shards typed differently); else a reason
    typed as text          lake.casts.cast_text, the text path (a column_types override)
    text (format 1)        lake.casts.cast_text: a format check and a cast per value

The typed path runs no pattern check: at 200k events the typing step was about 14 us per event on
the text path (docs/benchmarks-history.md, "Ingest on Spark 4.1, side by side").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.casts import cast_text
from cdc_lakehouse.landing.format import RAW_SUFFIX, LandedColumn, landing_spark_schema, typed_spark_schema
from cdc_lakehouse.landing.reader import Plan

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from cdc_lakehouse.ingest.renames import Renames

UPSERT_OPS = ("c", "u", "r")


@dataclass(frozen=True)
class LandedFrame:
    """Landing rows of one format and schema version: `columns` None for text files (format 1)."""

    rows: DataFrame
    columns: tuple[LandedColumn, ...] | None = None
    from_files: bool = False  # read from landing files (else built in memory: no file to name)


@dataclass(frozen=True)
class Landed:
    """The batch's events as read from its landing files, per format and schema version."""

    frames: tuple[LandedFrame, ...]
    renames: Renames | None = None  # source column renames, applied as the images are read
    shard: Column | None = field(default=None, compare=False)  # the events' shard (for renames)

    @classmethod
    def of(cls, rows: DataFrame) -> Landed:
        """Text rows (format 1) built elsewhere: a quarantined payload, a test's events."""
        return cls((LandedFrame(rows),))

    def renamed(self, renames: Renames, shard: Column) -> Landed:
        """The images' column names in the lake's, as of each event's position (ingest.renames)."""
        from cdc_lakehouse.ingest.renames import rename_fields

        if not renames.renames:
            return self
        frames = tuple(f if f.columns else replace(f, rows=rename_fields(f.rows, renames, shard)) for f in self.frames)
        return replace(self, frames=frames, renames=renames, shard=shard)

    def table_schemas(self) -> DataFrame:
        """The events' `table_schema` and `source` (what the schema check reads when manifests
        lack schemas)."""
        from functools import reduce

        return reduce(lambda a, b: a.unionByName(b), [f.rows.select("table_schema", "source") for f in self.frames])


def read_landed(spark: SparkSession, cfg: TableConfig, plan: Plan) -> Landed:
    """The table's events in the plan's files: text files in one frame, typed files in one frame
    per schema version (files of one version share a Spark read)."""
    from pyspark.sql import functions as F

    groups: dict[tuple[LandedColumn, ...] | None, list[str]] = {}
    for uri, cols in plan.file_columns().items():
        groups.setdefault(None if cols is None else tuple((n, t) for n, t in cols), []).append(uri)
    frames = []
    for version, files in groups.items():
        schema = landing_spark_schema() if version is None else typed_spark_schema(version)
        rows = spark.read.schema(schema).parquet(*files).filter(F.col("source.table") == cfg.source.table)
        frames.append(LandedFrame(rows, version, from_files=True))
    return Landed(tuple(frames))


# --- a frame's values in the lake's types -----------------------------------------------------------


def does_not_fit(name: str, text: Column, lake_type: str) -> Column:
    """The reason of a value that does not fit its column (the one wording every path uses)."""
    from pyspark.sql import functions as F

    return F.concat(F.lit(f"column {name}: value '"), F.substring(text, 1, 80), F.lit(f"' does not fit {lake_type}"))


class Images:
    """A frame's row images as validation reads them: a column's value in its lake type with the
    reason it does not fit (NULL when it fits), whether an image or a key is present, and the
    event's payload as text (format 1's shape) for the quarantine.

    `which` picks the image: "row" is the event's row (the new row of an insert or update, the old
    row of a delete), "old_key" the old row of an update (its key, when the key changed), "after"
    and "before" the image of that name whatever the event."""

    def __init__(self, frame: LandedFrame, landed: Landed):
        self.frame = frame
        self.landed = landed

    def present(self, image: str) -> Column:
        from pyspark.sql import functions as F

        return F.col(image).isNotNull()

    def value(self, name: str, lake_type: str, which: str = "row") -> tuple[Column, Column | None]:
        """(the value, the reason it does not fit; None when it cannot fail)."""
        raise NotImplementedError

    def has_key(self, image: str, name: str) -> Column:
        raise NotImplementedError

    def payload(self) -> Column:
        raise NotImplementedError


def pick(which: str, after: Column, before: Column) -> Column:
    """The image `which` names (Images): one expression per event, evaluated once."""
    from pyspark.sql import functions as F

    op = F.col("op")
    if which in ("after", "before"):
        return after if which == "after" else before
    if which == "old_key":
        return F.when(op == "u", before)
    return F.when(op.isin(*UPSERT_OPS), after).when(op == "d", before)


class TextImages(Images):
    """Format 1: maps of PostgreSQL text, cast per value behind a format check (lake.casts)."""

    def value(self, name: str, lake_type: str, which: str = "row") -> tuple[Column, Column | None]:
        from pyspark.sql import functions as F

        raw = pick(which, F.col("after")[name], F.col("before")[name])
        typed = cast_text(raw, lake_type)
        if lake_type.replace(" ", "") == "string":
            return typed, None
        return typed, F.when(raw.isNotNull() & typed.isNull(), does_not_fit(name, raw, lake_type))

    def has_key(self, image: str, name: str) -> Column:
        from pyspark.sql import functions as F

        return F.col(image)[name].isNotNull()

    def payload(self) -> Column:
        from pyspark.sql import functions as F

        return F.to_json(F.struct("op", "before", "after", "unavailable", "source", "run_id"))


class TypedImages(Images):
    """Format 2: structs typed at capture; the text of the values that did not fit beside them."""

    def __init__(self, frame: LandedFrame, landed: Landed):
        super().__init__(frame, landed)
        self.types = dict(frame.columns or ())

    def _fields(self, name: str) -> list[tuple[Column | None, str]]:
        """The frame's fields that may hold the lake column `name`, each with the condition under
        which it does (None: always): the column itself, or a column the source renamed to it
        (ingest.renames: the lake's name of a field depends on the event's position)."""
        from pyspark.sql import functions as F

        renames, shard = self.landed.renames, self.landed.shard
        if renames is None or shard is None or not renames.renames:
            return [(None, name)] if name in self.types else []
        commit, lsn, olds = F.col("source.commit_lsn"), F.col("source.lsn"), {r.old for r in renames.renames}
        return [
            (renames.column(F.lit(k), shard, commit, lsn) == F.lit(name), k)
            for k in self.types
            if k == name or k in olds
        ]

    def value(self, name: str, lake_type: str, which: str = "row") -> tuple[Column, Column | None]:
        from pyspark.sql import functions as F

        values, reasons = [], []
        for hit, k in self._fields(name):
            value = pick(which, F.col("after")[k], F.col("before")[k])
            raw = pick(which, F.col("after" + RAW_SUFFIX)[k], F.col("before" + RAW_SUFFIX)[k])
            v, reason = convert(name, value, raw, self.types[k], lake_type)
            if hit is None:
                return v, reason
            values.append(F.when(hit, v))
            reasons.append(F.when(hit, reason))
        if not values:
            return F.lit(None).cast(lake_type.replace(" ", "")), None
        return F.coalesce(*values), F.coalesce(*reasons)

    def has_key(self, image: str, name: str) -> Column:
        from pyspark.sql import functions as F

        present = F.lit(False)
        for hit, k in self._fields(name):
            found = F.col(image)[k].isNotNull() | F.col(image + RAW_SUFFIX)[k].isNotNull()
            present = present | (found if hit is None else (hit & found))
        return present

    def payload(self) -> Column:
        """Format 1's shape (maps of text), so a quarantined event replays through the text path:
        the text kept at capture where a value did not fit, else the value written as text."""
        from pyspark.sql import functions as F

        def as_text(image: str) -> Column:
            cols = list(self.types.items())
            keys = F.array(*[F.lit(k) for k, _ in cols]) if cols else F.array().cast("array<string>")
            vals = [F.coalesce(F.col(image + RAW_SUFFIX)[k], _text_of(F.col(image)[k], t)) for k, t in cols]
            texts = F.array(*vals) if vals else F.array().cast("array<string>")
            return F.when(F.col(image).isNotNull(), F.map_from_arrays(keys, texts))

        before, after = as_text("before").alias("before"), as_text("after").alias("after")
        return F.to_json(F.struct("op", before, after, "unavailable", "source", "run_id"))


def convert(name: str, value: Column, raw: Column, landed: str, lake_type: str) -> tuple[Column, Column]:
    """A typed value (landed as `landed`, with the text kept where it did not fit) in the lake
    column's type, and the reason it does not fit (NULL when it does)."""
    from pyspark.sql import functions as F

    want, have = lake_type.replace(" ", ""), landed.replace(" ", "")
    kept = F.when(raw.isNotNull(), does_not_fit(name, raw, lake_type))
    if want == have:
        return value, kept
    if have == "string":  # landed as text (a column_types override): the text path
        typed = cast_text(value, lake_type)
        return typed, F.coalesce(kept, F.when(value.isNotNull() & typed.isNull(), does_not_fit(name, value, want)))
    if want == "string":
        # PostgreSQL's text of a typed value is not kept, and Spark's differs from the bootstrap's
        # (1.5 against 1.500000000000000000): quarantined; the audit's repair re-reads the row.
        reason = F.lit(
            f"column {name}: landed as {have} before the lake column became string (column_types); "
            "the audit's repair re-reads the row from the source"
        )
        return F.lit(None).cast("string"), F.when(value.isNotNull() | raw.isNotNull(), reason)
    # Another type (the lake column widened since, or shards typed apart): kept if it casts back.
    cast = value.try_cast(want)
    fits = value.isNull() | (cast.isNotNull() & (cast.cast(have) == value))
    return F.when(fits, cast), F.coalesce(kept, F.when(~fits, does_not_fit(name, value.cast("string"), want)))


def images_of(frame: LandedFrame, landed: Landed) -> Images:
    return TextImages(frame, landed) if frame.columns is None else TypedImages(frame, landed)


def _text_of(value: Column, lake_type: str) -> Column:
    """A typed value as text the text path reads back to the same value (lake.casts.cast_text):
    bytea as '\\x' hex, arrays as JSON, the rest as Spark writes them."""
    from pyspark.sql import functions as F

    t = lake_type.replace(" ", "")
    if t == "binary":
        return F.when(value.isNotNull(), F.concat(F.lit("\\x"), F.lower(F.hex(value))))
    if t.startswith("array<"):
        elem = t[6:-1]
        return F.when(value.isNotNull(), F.to_json(F.transform(value, lambda x: _text_of(x, elem))))
    return value.cast("string")
