"""What every change-feed consumer job takes: dag_parts.feed_consumer_dag passes it to the job it
names, whose registry entry (jobs.registry) declares these parameters or a subclass of them (with
other defaults, say). A consumer's main reads them and runs its consume per table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cdc_lakehouse.jobs.params import JobParams, flag
from cdc_lakehouse.lake.holds import DEFAULT_MAX_LAG_HOURS

FeedMode = Literal["auto", "full"]


@dataclass(frozen=True, kw_only=True)
class FeedConsumerParams(JobParams):
    description = "Change-feed consumer (docs/change-feed.md)"

    tables: tuple[str, ...] = flag(help="the table whose feed it reads (config 'name')")
    consumer: str = flag(help="the consumer's name: its offsets and holds carry it")
    output: str = flag(help="namespace.table of its Iceberg output")
    mode: FeedMode = flag("auto", help="auto: from the committed offset; full: reset, every live row")
    max_lag_hours: int = flag(DEFAULT_MAX_LAG_HOURS, help="how long the table keeps its offset's snapshot")
    upto: int | None = flag(None, help="snapshot id to read up to (an asset event's); empty: the newest")
