"""`bootstrap.reader: copy`: the snapshot read as PostgreSQL's binary COPY straight into Arrow
(the ADBC PostgreSQL driver: libpq and C++), on the executors, inside mapInArrow.

Until issue #56 this reader was psycopg2's `COPY ... TO STDOUT` as CSV text parsed by pyarrow,
and was slower than Spark's JDBC reader (docs/benchmarks-history.md, "Issue 16"). Typed binary COPY reads the
1M-row bench table at about COPY's own rate, and ahead of the typed JDBC reader
(docs/bench-bootstrap-typed.md has the figures).

Each task reads its ctid ranges in order on one connection, under the exported snapshot
(REPEATABLE READ, SET TRANSACTION SNAPSHOT before the first query), with the session settings
every source reader uses (source.session): the tasks of an endpoint are at most
`max_connections_per_host`, the cap on its connections. The statement is the typed select list
(bootstrap.typed_select), so values arrive as int64, float64, date32, timestamp[us] ..., not text:
there is nothing to parse or cast in Spark but numerics, which ADBC hands over as their text
(PostgreSQL's numeric is wider than Arrow's decimal128) and Spark casts without a guard (the
select list checked that they fit).

The DSN, with the password, travels inside the task closure, never in the Spark conf, the plan
or the UI, and no error message repeats it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.columns import SHARD_COL

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pyspark.sql import DataFrame, SparkSession

APPLICATION_NAME = "cdc_lakehouse bootstrap adbc"


@dataclass(frozen=True)
class ReadTask:
    """One ctid range of one shard: the SELECT that reads it and the shard it belongs to."""

    shard: str
    label: str  # schema.table and the range, for error messages
    sql: str


@dataclass(frozen=True)
class ReadSource:
    """What an executor needs to read its tasks. `dsn` holds the password: it travels inside the
    task closure only."""

    dsn: str = field(repr=False)
    snapshot: str
    columns: tuple[tuple[str, str], ...]  # (name, Spark type) as delivered, the shard not included
    table: str  # the config's name, for error messages
    label: str  # host:port/database, for error messages


def select_sql(select_list: str, qualified: str, predicate: str) -> str:
    where = f" WHERE {predicate}" if predicate else ""
    return f"SELECT {select_list} FROM {qualified}{where}"


def spark_type(name: str):
    """The Spark type of a delivered column's type name (typed_select's types: no DDL parser, which
    needs a classic session)."""
    import re

    from pyspark.sql import types as T

    simple = {
        "bigint": T.LongType(),
        "int": T.IntegerType(),
        "boolean": T.BooleanType(),
        "float": T.FloatType(),
        "double": T.DoubleType(),
        "date": T.DateType(),
        "timestamp": T.TimestampType(),
        "timestamp_ntz": T.TimestampNTZType(),
        "binary": T.BinaryType(),
        "string": T.StringType(),
    }
    if name in simple:
        return simple[name]
    m = re.fullmatch(r"decimal\((\d+),(\d+)\)", name.replace(" ", ""))
    if m:
        return T.DecimalType(int(m.group(1)), int(m.group(2)))
    raise ValueError(f"the typed reader delivers no column of type {name!r}")


def output_schema(columns: tuple[tuple[str, str], ...]):
    from pyspark.sql.types import StringType, StructField, StructType

    return StructType(
        [StructField(n, spark_type(t), True) for n, t in columns] + [StructField(SHARD_COL, StringType())]
    )


def arrow_schema(columns: tuple[tuple[str, str], ...]):
    """The Arrow schema Spark expects back (plus the shard); timestamps with time zone in UTC."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_type

    return pa.schema([pa.field(f.name, to_arrow_type(f.dataType)) for f in output_schema(columns)])


def connect(dsn: str, application_name: str = APPLICATION_NAME):
    """An autocommit ADBC connection with the session settings every source reader uses."""
    import adbc_driver_postgresql.dbapi as adbc  # type: ignore[import-untyped]  # no type information shipped
    from psycopg2.extensions import make_dsn

    from cdc_lakehouse.source.session import SESSION_OPTIONS

    return adbc.connect(make_dsn(dsn, options=SESSION_OPTIONS, application_name=application_name), autocommit=True)


def _open(src: ReadSource, task: ReadTask):
    """An ADBC connection whose transaction sees the exported snapshot."""
    try:
        conn = connect(src.dsn)
    except Exception as exc:  # noqa: BLE001 - the driver's errors name no secret; re-raised plainly
        raise RuntimeError(
            f"{src.table}: the bootstrap cannot connect to {src.label} to read {task.label}: {_first_line(exc)}; "
            "check the Airflow connection and that the executors reach the host"
        ) from None
    cur = conn.cursor()
    try:
        cur.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        cur.execute("SET TRANSACTION SNAPSHOT '" + src.snapshot.replace("'", "''") + "'")
    except Exception as exc:  # noqa: BLE001
        cur.close()
        conn.close()
        raise RuntimeError(
            f"{src.table}: cannot import the exported snapshot {src.snapshot} on {src.label} to read "
            f"{task.label}: {_first_line(exc)}; the snapshot lives while the bootstrap's slot connection "
            "is open: rerun the bootstrap"
        ) from None
    return conn, cur


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def conform(batch, schema, shard: str):
    """A driver batch as the declared schema: extension types (numeric as text) by their storage,
    the shard appended."""
    import pyarrow as pa

    cols = []
    for i, f in enumerate(schema):
        if f.name == SHARD_COL:
            break
        col = batch.column(i)
        if isinstance(col.type, pa.ExtensionType):
            col = col.storage
        cols.append(col if col.type == f.type else col.cast(f.type))
    cols.append(pa.array([shard] * batch.num_rows, pa.string()))
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def _task_batches(cur, src: ReadSource, task: ReadTask, schema) -> Iterator:
    """One task's rows as Arrow record batches, streamed from the driver."""
    try:
        cur.execute(task.sql)
        reader = cur.fetch_record_batch()
        for batch in reader:
            yield conform(batch, schema, task.shard)
    except RuntimeError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"{src.table}: the read of {task.label} failed: {_first_line(exc)}") from None


def read_tasks(batches, *, src: ReadSource, tasks: tuple[ReadTask, ...]) -> Iterator:
    """Executor side (mapInArrow): the input rows are task indexes; each partition reads its tasks
    one after another on one connection, under the exported snapshot."""
    schema = arrow_schema(src.columns)
    opened: Any = None
    try:
        for batch in batches:
            for i in batch.column(0).to_pylist():
                opened = opened or _open(src, tasks[i])
                yield from _task_batches(opened[1], src, tasks[i], schema)
    finally:
        if opened is not None:
            opened[1].close()
            opened[0].close()


def read_with_copy(spark: SparkSession, src: ReadSource, tasks: list[ReadTask], max_connections: int) -> DataFrame:
    """All tasks of one endpoint as the select list's columns (plus the shard), at most
    `max_connections` tasks (connections) at once."""
    import functools

    parts = max(1, min(max_connections, len(tasks)))
    # range cuts the task list into `parts` contiguous slices, one connection each.
    index = spark.range(0, len(tasks), 1, parts).selectExpr("CAST(id AS INT) AS task")
    fn = functools.partial(read_tasks, src=src, tasks=tuple(tasks))
    return index.mapInArrow(fn, output_schema(src.columns))
