"""bootstrap.debezium: A Debezium-fed table's bootstrap: its lake tables from the connector's snapshot events."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.lake.tables import create_lake_tables, table_exists
from cdc_lakehouse.lake.writers import BOOTSTRAP, WRITER_PROP
from cdc_lakehouse.landing.debezium.connect_types import DebeziumFormatError, table_columns
from cdc_lakehouse.landing.debezium.plan import pending_files, read_bytes
from cdc_lakehouse.landing.debezium.records import records, schema_field, shape_of
from cdc_lakehouse.landing.errors import NotBootstrapped
from cdc_lakehouse.landing.reader import LandingFS, spark_uri
from cdc_lakehouse.source.catalog import SchemaColumn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_lakehouse.settings import LakeSettings
    from cdc_lakehouse.watermark import Watermark


# --- bootstrap ---------------------------------------------------------------------------------------


def first_columns(spark: SparkSession, cfg: TableConfig) -> list[SchemaColumn]:
    """The table's columns from the value schema of the first record of its topics (the snapshot's
    'r' events when the connector took one)."""
    src, shape = cfg.landing, shape_of(cfg)
    fs, base = LandingFS(spark), spark_uri(str(src.uri).rstrip("/")) + "/" + src.topics_dir
    firsts = []
    for topic, _ in shape.endpoints:
        files = pending_files(fs, base, topic, {}, False)
        firsts += sorted(files, key=lambda f: f.start)[:1]
    for f in sorted(firsts, key=lambda f: f.uri):
        for schema, payload in records(read_bytes(fs, f.uri), shape.fmt, f.uri):
            value_schema = schema and (schema_field(schema, "after") or schema_field(schema, "before"))
            if payload is not None and value_schema and value_schema.get("fields"):
                return table_columns(value_schema, cfg.primary_key, f"{cfg.name}: {f.uri}")
    raise NotBootstrapped(
        f"{cfg.name}: no Debezium record of the table under {src.uri}/{src.topics_dir} to take its columns from; "
        "start the connector (snapshot.mode=initial) and the S3 sink, then run the bootstrap again"
    )


def bootstrap_debezium(spark: SparkSession, lake: LakeSettings, cfg: TableConfig) -> Watermark:
    """Create the lake tables of a Debezium-fed table, with every shard at the start of its topics:
    the first ingest then loads the connector's snapshot ('r' events) and the changes after it.
    Returns the watermark the tables start at."""
    from cdc_lakehouse.watermark import ShardPosition, Watermark

    cur = lake.qualified(cfg.current_table)
    if table_exists(spark, cur):
        raise ValueError(f"{cfg.name}: lake table {cur} exists already; drop it first to bootstrap again")
    cols = first_columns(spark, cfg)
    typed = {c["name"]: cfg.column_types.get(c["name"]) or c["lake_type"] for c in cols}
    bad = [name for name, t in typed.items() if not t]
    if bad:
        raise DebeziumFormatError(f"{cfg.name}: columns {bad} have no lake type; set column_types for them")
    create_lake_tables(spark, lake, cfg, [(name, t) for name, t in typed.items() if t])
    names = [c["name"] for c in cols]
    wm = Watermark(
        v=1,
        shards={shard: ShardPosition(lsn=0, endpoint=g.endpoint_id, columns=names) for g, _, shard in cfg.shards()},
        runs={},
        debezium={"offsets": {}, "last": {}, "heartbeats": {}},
    )
    empty = spark.createDataFrame([], spark.table(cur).schema)
    empty.writeTo(cur).option("snapshot-property.cdc.watermark", wm.to_json()).option(
        f"snapshot-property.{WRITER_PROP}", BOOTSTRAP.name
    ).append()
    return wm
