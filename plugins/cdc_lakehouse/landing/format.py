"""The landing zone: change events as Parquet files, grouped by endpoint, table and run.

Layout under the landing URI (a local path or an s3:// prefix):

    <endpoint>/<table>/run=<run_id>/part-00000.parquet   events of one source table (all shards)
    <endpoint>/_manifests/<run_id>.json                  what the run wrote and where the slot stands

A run's files count only once its manifest exists; the manifest is written after the files
are durable and before the slot is confirmed. Event schema: see LANDING_FIELDS and
docs/landing-format.md.
"""

from __future__ import annotations

MANIFEST_DIR = "_manifests"
FORMAT_VERSION = 1

# Field list of a landing event (Debezium envelope). `before`/`after` hold PostgreSQL's text
# output of each column; `unavailable` lists columns whose unchanged TOASTed value the source
# did not send (never to be read as NULL); `table_schema` is the relation's columns as JSON.
LANDING_FIELDS = [
    "op",
    "before",
    "after",
    "unavailable",
    "source",
    "table_schema",
    "ts_ms",
    "run_id",
]
SOURCE_FIELDS = [
    "connector",
    "endpoint",
    "host",
    "db",
    "schema",
    "table",
    "commit_lsn",
    "lsn",
    "xid",
    "seq",
    "commit_ts",
]


def landing_arrow_schema():
    import pyarrow as pa

    kv = pa.map_(pa.string(), pa.string())
    return pa.schema(
        [
            ("op", pa.string()),
            ("before", kv),
            ("after", kv),
            ("unavailable", pa.list_(pa.string())),
            (
                "source",
                pa.struct(
                    [
                        ("connector", pa.string()),
                        ("endpoint", pa.string()),
                        ("host", pa.string()),
                        ("db", pa.string()),
                        ("schema", pa.string()),
                        ("table", pa.string()),
                        ("commit_lsn", pa.int64()),
                        ("lsn", pa.int64()),
                        ("xid", pa.int64()),
                        ("seq", pa.int64()),
                        ("commit_ts", pa.timestamp("us", tz="UTC")),
                    ]
                ),
            ),
            ("table_schema", pa.string()),
            ("ts_ms", pa.int64()),
            ("run_id", pa.string()),
        ]
    )


def run_dir(endpoint: str, table: str, run_id: str) -> str:
    return f"{endpoint}/{table}/run={run_id}"


def manifest_path(endpoint: str, run_id: str) -> str:
    return f"{endpoint}/{MANIFEST_DIR}/{run_id}.json"
