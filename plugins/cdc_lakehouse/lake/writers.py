"""Who made a commit: the registry of the pipeline's writers of a table, one definition.

Every commit our code makes to a current table (and to its changelog) carries the snapshot
property `cdc.writer` naming its writer. Readers of ranges (lake.ranges: the change feed, serving
exports, derived trees) trust the changelog to name every key a range changed only across the
commits of a writer that promises it (`names_its_changes`: the ingest alone). Identification is
positive: a commit that names another writer, or none (a manual UPDATE, a tool we do not know, a
commit made before writers were named), makes them diff the two snapshots instead.

Pure Python, no Spark import, like cdc_lakehouse.columns.
"""

from __future__ import annotations

from dataclasses import dataclass

WRITER_PROP = "cdc.writer"
# A commit of rows read from the source at some time (a chunk between WAL markers) says how far,
# per shard, those reads reached: JSON {shard: LSN of the chunk's high marker}. Below that
# position its values may be newer than the watermark says (lake.points).
READ_UPTO_PROP = "cdc.read-upto"


@dataclass(frozen=True)
class Writer:
    name: str  # the value of `cdc.writer`
    doc: str
    # Every key a commit of this writer changes has a changelog row between the watermark before
    # the commit and the one after it (exclusive positions, lake.changelog.changes_between).
    names_its_changes: bool = False

    def props(self) -> dict[str, str]:
        """The snapshot property each of the writer's commits carries."""
        return {WRITER_PROP: self.name}


INGEST = Writer(
    "ingest",
    "an ingest batch (ingest.ingest_table): its events appended to the changelog, then merged into the current "
    "table with the watermark moved past them; also a commit that only moves the watermark",
    names_its_changes=True,
)
REPAIR = Writer(
    "repair",
    "an audit repair (audit.repair): rows re-read from the source, merged at the watermark, which the "
    "commit restates unchanged: its changelog rows sit at the watermark itself, in no range that ends there",
)
REPLAY = Writer(
    "replay",
    "a quarantine replay (ingest.replay): quarantined events merged below the watermark, no changelog rows",
)
BACKFILL = Writer(
    "backfill",
    "an added column's values for the rows that predate it (ingest.backfill): merged below the watermark",
)
BOOTSTRAP = Writer(
    "bootstrap",
    "a snapshot bootstrap or re-bootstrap of shards (bootstrap.bootstrap_table, landing.debezium): their rows replaced",
)
CHUNKED_BOOTSTRAP = Writer(
    "chunked-bootstrap",
    "a chunked bootstrap (bootstrap.chunked): start positions, and rounds of chunks merged at their own "
    "low watermarks, below or above the table's watermark",
)

COLUMN_BACKFILL = Writer(
    "column-backfill",
    "a one-column backfill (bootstrap.column): some columns of rows below a chunk's low watermark set "
    "from the source, no changelog rows",
)

WRITERS: tuple[Writer, ...] = (INGEST, REPAIR, REPLAY, BACKFILL, BOOTSTRAP, CHUNKED_BOOTSTRAP, COLUMN_BACKFILL)
BY_NAME: dict[str, Writer] = {w.name: w for w in WRITERS}


def names_its_changes(writer: str | None) -> bool:
    """Whether a commit whose `cdc.writer` is `writer` (None: it has none) is one whose changed keys
    the changelog names. Unknown names are not trusted."""
    known = BY_NAME.get(writer or "")
    return known is not None and known.names_its_changes
