"""The snapshot read through `COPY (SELECT ...) TO STDOUT`, parsed into Arrow on the executors.

`bootstrap.reader: copy`; the default, `jdbc`, is Spark's JDBC reader, which measured faster on
the 2-core machine (docs/benchmarks-history.md: 10M rows read alone in 29.8 s against 42.4 s here, COPY itself
29.7 s): Spark's JDBC reader already reads at COPY's rate there, and this path adds a Python worker
per task and the Arrow hand-over. Both send the same SELECT (text_select_list: every column as the text its output function
prints) under the same exported snapshot, and both hand the same text columns to typed_rows, so
the lake gets the same values whichever reader ran; only the transport differs: here PostgreSQL
writes CSV, pyarrow parses it in C++ and the batches enter Spark through mapInArrow.

Each task reads its ctid ranges in order on one connection: the tasks of an endpoint are at most
`max_connections_per_host`, so that is the cap on its connections. Every connection imports the
exported snapshot before its first query (REPEATABLE READ, SET TRANSACTION SNAPSHOT), and
libpq's options carry the session settings the JDBC path sets (source.session).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cdc_lakehouse.config import SHARD_COL

if TYPE_CHECKING:
    from collections.abc import Iterator

    from pyspark.sql import DataFrame, SparkSession

# Rows are handed to the parser in buffers of about this size: big enough that pyarrow's per-call
# cost vanishes, small enough that a few in flight per task stay a few MB.
BUFFER_BYTES = 8 << 20
_QUEUED_BUFFERS = 3


@dataclass(frozen=True)
class CopyTask:
    """One ctid range of one shard: the COPY statement that reads it and the shard it belongs to."""

    shard: str
    label: str  # schema.table and the range, for error messages
    sql: str


@dataclass(frozen=True)
class CopySource:
    """What an executor needs to read its tasks. `dsn` holds the password: it travels inside the
    task closure (as in the serving export), never in the Spark conf, the plan or the UI."""

    dsn: str = field(repr=False)
    snapshot: str
    columns: tuple[str, ...]
    table: str  # the config's name, for error messages
    label: str  # host:port/database, for error messages


def copy_sql(select_list: str, qualified: str, predicate: str) -> str:
    where = f" WHERE {predicate}" if predicate else ""
    return f"COPY (SELECT {select_list} FROM {qualified}{where}) TO STDOUT WITH (FORMAT csv)"


class _RowBuffer:
    """The file psycopg2's copy_expert writes to (one call per row, as libpq returns rows): rows
    are joined into buffers that end on a row boundary and queued for the parser."""

    def __init__(self, out: queue.Queue, stop: threading.Event) -> None:
        self.out, self.stop = out, stop
        self.parts: list[bytes] = []
        self.size = 0

    def write(self, data: bytes) -> int:
        self.parts.append(data)
        self.size += len(data)
        if self.size >= BUFFER_BYTES:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self.parts:
            self.put(b"".join(self.parts))
            self.parts, self.size = [], 0

    def put(self, item: Any) -> None:
        # A bounded queue keeps memory flat; the stop flag frees the thread if the reader is gone.
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.5)
                return
            except queue.Full:
                continue
        raise RuntimeError("the COPY reader stopped")


def _csv_options(columns: tuple[str, ...]):
    import pyarrow as pa
    from pyarrow import csv

    # PostgreSQL's CSV: NULL is an unquoted empty field, an empty string is quoted (""); values
    # may hold newlines inside quotes. Every column stays text: typed_rows casts it, as for JDBC.
    return (
        csv.ReadOptions(column_names=list(columns), block_size=BUFFER_BYTES + (1 << 20), use_threads=False),
        csv.ParseOptions(newlines_in_values=True),
        csv.ConvertOptions(
            column_types={c: pa.string() for c in columns},
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        ),
    )


def _open(src: CopySource, task: CopyTask):
    """A connection whose transaction sees the exported snapshot, with the sources' session settings."""
    import psycopg2

    from cdc_lakehouse.source.session import SESSION_OPTIONS

    try:
        conn = psycopg2.connect(src.dsn, options=SESSION_OPTIONS, application_name="cdc_lakehouse bootstrap copy")
    except psycopg2.OperationalError as exc:
        raise RuntimeError(
            f"{src.table}: the bootstrap cannot connect to {src.label} to read {task.label}: {str(exc).strip()}; "
            "check the Airflow connection and that the executors reach the host"
        ) from None
    try:
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        with conn.cursor() as cur:
            cur.execute("SET TRANSACTION SNAPSHOT %s", (src.snapshot,))
    except psycopg2.Error as exc:
        conn.close()
        raise RuntimeError(
            f"{src.table}: cannot import the exported snapshot {src.snapshot} on {src.label} to read "
            f"{task.label}: {str(exc).strip()}; the snapshot lives while the bootstrap's slot connection "
            "is open: rerun the bootstrap"
        ) from None
    return conn


def _copy_into(conn, task: CopyTask, out: queue.Queue, stop: threading.Event) -> None:
    """Thread body: run the COPY into the queue; ends with None, or the exception that stopped it."""
    buf = _RowBuffer(out, stop)
    try:
        with conn.cursor() as cur:
            cur.copy_expert(task.sql, buf, size=1 << 16)
        buf.flush()
        buf.put(None)
    except BaseException as exc:  # noqa: BLE001 - handed to the reading thread, which raises it
        if not stop.is_set():
            try:
                buf.put(exc)
            except RuntimeError:
                pass


def _task_batches(conn, src: CopySource, task: CopyTask) -> Iterator:
    """One task's rows as Arrow record batches (the shard column last, as the JDBC reader's), streamed."""
    import pyarrow as pa
    from pyarrow import csv

    read, parse, convert = _csv_options(src.columns)
    out: queue.Queue = queue.Queue(maxsize=_QUEUED_BUFFERS)
    stop = threading.Event()
    worker = threading.Thread(target=_copy_into, args=(conn, task, out, stop), daemon=True)
    worker.start()
    try:
        while (item := out.get()) is not None:
            if isinstance(item, BaseException):
                raise RuntimeError(f"{src.table}: COPY of {task.label} failed: {item}") from item
            table = csv.read_csv(pa.py_buffer(item), read_options=read, parse_options=parse, convert_options=convert)
            shard = pa.array([task.shard] * table.num_rows, pa.string())
            for batch in table.combine_chunks().to_batches():
                yield pa.RecordBatch.from_arrays([*batch.columns, shard[: batch.num_rows]], [*src.columns, SHARD_COL])
    finally:
        stop.set()
        worker.join(timeout=60)


def read_tasks(batches, *, src: CopySource, tasks: tuple[CopyTask, ...]) -> Iterator:
    """Executor side (mapInArrow): the input rows are task indexes; each partition reads its tasks
    one after another on one connection, under the exported snapshot."""
    conn = None
    try:
        for batch in batches:
            for i in batch.column(0).to_pylist():
                conn = conn or _open(src, tasks[i])
                yield from _task_batches(conn, src, tasks[i])
    finally:
        if conn is not None:
            conn.close()


def output_schema(columns: tuple[str, ...]):
    from pyspark.sql.types import StringType, StructField, StructType

    return StructType([StructField(c, StringType(), True) for c in (*columns, SHARD_COL)])


def read_with_copy(spark: SparkSession, src: CopySource, tasks: list[CopyTask], max_connections: int) -> DataFrame:
    """All tasks of one endpoint as text columns (plus the shard), at most `max_connections`
    tasks (connections) at once."""
    import functools

    parts = max(1, min(max_connections, len(tasks)))
    # range cuts the task list into `parts` contiguous slices, one connection each.
    index = spark.range(0, len(tasks), 1, parts).selectExpr("CAST(id AS INT) AS task")
    fn = functools.partial(read_tasks, src=src, tasks=tuple(tasks))
    return index.mapInArrow(fn, output_schema(src.columns))
