"""What Airflow tasks run. Imported by DAG files, so only light imports at module level;
heavy ones (psycopg2, pyarrow, pyiceberg) happen inside the functions, at run time."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from cdc_lakehouse.config import ConfigSet, load_table_configs
from cdc_lakehouse.lake.meta_rows import CaptureRun
from cdc_lakehouse.orchestration.metrics import capture_metrics
from cdc_lakehouse.settings import PROJECT_ROOT, LakeSettings, connection_uri, source_uri_env, tables_dir

if TYPE_CHECKING:
    from cdc_lakehouse.landing.format import Manifest

log = logging.getLogger(__name__)
LAKE_CONN_ID = os.environ.get("CDC_LAKE_CONN_ID", "cdc_lake")


def run_id_for(interval_end: datetime) -> str:
    """Capture run ids sort like the data intervals they belong to."""
    return interval_end.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")


def schedule_tick_passed(cron: str, since: datetime | None, now: datetime) -> bool:
    """Whether a tick of the 5-field `cron` (UTC) lies in (since, now]: a job that rides along with
    another DAG's runs (a feed output's maintenance) runs once per tick, in the first run after it.
    No earlier success (since None): not yet, the first run only created what it would maintain."""
    from croniter import croniter

    # `not`, not `is None`: Airflow hands prev_start_date_success over as a lazy proxy, which is
    # never None itself but is falsy when what it stands for is.
    if not since:
        return False
    return croniter(cron, now.astimezone(UTC)).get_prev(datetime) > since.astimezone(UTC)


def lake_settings() -> LakeSettings:
    from airflow.sdk import BaseHook

    lake = LakeSettings.from_airflow_connection(BaseHook.get_connection(LAKE_CONN_ID))
    return with_aws_connection(lake) if lake.uses_s3 else lake


def _path_style(extra: dict[str, Any]) -> bool:
    """Path-style addressing asked for by an AWS connection's extra: our `s3_path_style`, or
    botocore's own `config_kwargs: {s3: {addressing_style: path}}`."""
    botocore_s3 = (extra.get("config_kwargs") or {}).get("s3") or {}
    return bool(extra.get("s3_path_style")) or botocore_s3.get("addressing_style") == "path"


def with_aws_connection(lake: LakeSettings) -> LakeSettings:
    """Fill the S3 endpoint, region and credentials from the lake's AWS connection (the Amazon
    provider resolves keys, assumed roles and profiles); settings given on the lake connection win."""
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    from cdc_lakehouse.settings import S3Credentials

    hook = AwsBaseHook(aws_conn_id=lake.aws_conn_id, client_type="s3")
    cfg = hook.conn_config
    creds = hook.get_credentials()
    return lake.with_(
        s3_endpoint=lake.s3_endpoint or cfg.get_service_endpoint_url("s3"),
        s3_region=lake.s3_region or hook.conn_region_name,
        s3_path_style=lake.s3_path_style or _path_style(cfg.extra_config),
        s3_credentials=S3Credentials(creds.access_key, creds.secret_key, creds.token) if creds.access_key else None,
    )


def source_uri_from_connection(conn_id: str) -> str:
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    if conn.host and "," in conn.host:
        # A host list (a primary and its standbys): get_uri would quote it into one host name
        # and append the port field after it; each host keeps its own port here.
        return connection_uri(conn.host, conn.port, conn.login, conn.password, conn.schema)
    uri = conn.get_uri()
    return uri.replace("postgres://", "postgresql://", 1)


def configs() -> ConfigSet:
    return load_table_configs(tables_dir())


def capture_endpoint(
    endpoint_id: str, interval_end: datetime, context: dict[str, Any] | None = None, **_: Any
) -> dict[str, Any]:
    """Capture task: one bounded run of the endpoint's slot into the landing zone; then the
    slot's retained-WAL alert (cdc_lakehouse.orchestration.alerts), which never fails the task."""
    from cdc_lakehouse.capture.capture_run import CaptureLimits, capture_run
    from cdc_lakehouse.landing.stores import open_landing
    from cdc_lakehouse.settings import SourceEndpoint
    from cdc_lakehouse.source.catalog import EndpointTables

    cs = configs()
    members = cs.endpoints().get(endpoint_id)
    if not members:
        raise ValueError(f"endpoint {endpoint_id!r} is not used by any valid table config in {tables_dir()}")
    group = members[0][1]
    tables = cs.endpoint_tables()[endpoint_id]
    limits = CaptureLimits(
        max_events=min(t.ingest.max_events_per_run for t, _ in members),
        max_bytes=min(t.ingest.max_bytes_per_run for t, _ in members),
        decoding_work_mem_kb=min(
            (t.ingest.decoding_work_mem_kb for t, _ in members if t.ingest.decoding_work_mem_kb), default=None
        ),
    )
    ep = SourceEndpoint.from_uri(source_uri_from_connection(group.conn_id), group.database)
    lake = lake_settings()
    store = open_landing(lake.landing_uri, lake.landing_conn_id)
    run_id = run_id_for(interval_end)
    started = datetime.now(UTC)
    result = capture_run(
        EndpointTables(endpoint_id, group.conn_id, tables, cs.endpoint_column_types().get(endpoint_id, {})),
        ep.dsn(),
        store,
        run_id,
        host_label=ep.label,
        database=ep.database,
        limits=limits,
        # Publication column lists for consumed-columns tables; none while a config is broken,
        # whose columns cannot be narrowed out (a broken config loses nothing).
        table_configs=[t for t, _ in members] if not cs.errors else None,
    )
    if not result.reused:
        record_capture_metrics(lake, result.manifest, started)
    from cdc_lakehouse.orchestration.alerts import notify_wal

    notify_wal(result, [t for t, _ in members], lake, context)
    return result.xcom()


def record_capture_metrics(lake: LakeSettings, manifest: Manifest, started: datetime) -> None:
    """Append the run's row to cdc_meta.capture_runs with pyiceberg (no Spark needed in the worker),
    and send its figures as Airflow metrics.

    Best effort: the run is already durable and confirmed; a metrics failure is logged, not raised."""
    try:
        run = _capture_run(manifest, started)
        capture_metrics(run)
        import pyarrow as pa
        from pyiceberg.catalog import load_catalog
        from pyiceberg.exceptions import NoSuchTableError

        catalog = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
        try:
            table = catalog.load_table(lake.meta_table("capture_runs"))
        except NoSuchTableError:
            log.info(
                "capture metrics: %s does not exist yet (created by the first Spark job)",
                lake.meta_table("capture_runs"),
            )
            return
        table.append(pa.Table.from_pylist([asdict(run)], schema=table.schema().as_arrow()))
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a confirmed capture
        log.warning("capture metrics not recorded: %s", exc)


def _capture_run(manifest: Manifest, started: datetime) -> CaptureRun:
    """The run's row of cdc_meta.capture_runs."""
    if manifest.endpoint is None:  # every capture run writes its endpoint; an older manifest may not
        raise ValueError(f"capture run {manifest.run_id}: its manifest names no endpoint")
    after = manifest.slot_after or {}
    finished = datetime.fromisoformat(manifest.finished_at or "")
    return CaptureRun(
        endpoint=manifest.endpoint,
        run_id=manifest.run_id,
        events=manifest.events,
        bytes=manifest.bytes,
        transactions=manifest.transactions,
        capped=manifest.capped,
        start_lsn=manifest.start_lsn,
        end_lsn=manifest.end_lsn,
        retained_wal_bytes=after.get("retained_wal_bytes"),
        lag_bytes=after.get("lag_bytes"),
        seconds=(finished - started).total_seconds(),
        started_at=started,
        finished_at=finished,
    )


def store_uri_from_connection(kind: str, conn_id: str) -> str:
    """A serving store's URI (a secret) from its Airflow connection: a Redis connection, or an AWS
    connection for DynamoDB (keys, role and endpoint resolved by the Amazon provider's hook)."""
    from urllib.parse import quote

    if kind == "redis":
        from airflow.sdk import BaseHook

        c = BaseHook.get_connection(conn_id)
        auth = f"{quote(c.login or '', safe='')}:{quote(c.password, safe='')}@" if c.password else ""
        scheme = "rediss" if c.extra_dejson.get("ssl") else "redis"
        host, port, db = redis_address(c)
        return f"{scheme}://{auth}{host}:{port}/{db}"
    hook = dynamodb_hook(conn_id)
    creds = hook.get_credentials()
    region, scheme, endpoint = dynamodb_address(hook)
    auth = f"{quote(creds.access_key, safe='')}:{quote(creds.secret_key, safe='')}@" if creds.access_key else ""
    query = {"region": region, "scheme": scheme}
    if creds.token:
        query["session_token"] = creds.token
    return f"dynamodb://{auth}{endpoint}/?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())


def redis_address(conn: Any) -> tuple[str, int, str]:
    """(host, port, db) a Redis connection points at: public, unlike its password (lineage names
    the store by them)."""
    return conn.host or "127.0.0.1", int(conn.port or 6379), str(conn.extra_dejson.get("db", conn.schema or 0))


def dynamodb_hook(conn_id: str) -> Any:
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    return AwsBaseHook(aws_conn_id=conn_id, client_type="dynamodb")


def dynamodb_address(hook: Any) -> tuple[str, str, str]:
    """(region, scheme, host[:port]) of a DynamoDB connection's endpoint ("" for AWS's regional
    one): read from the connection's settings, no credentials resolved (the caller asks the hook
    for those when it needs them)."""
    endpoint = urlsplit(hook.conn_config.get_service_endpoint_url("dynamodb") or "")
    # netloc, not hostname: the port stays; whatever user info an endpoint URL carried does not.
    return hook.conn_region_name or "us-east-1", endpoint.scheme or "https", endpoint.netloc.rpartition("@")[2]


def spark_job_env(
    source_conn_ids: list[str], store_conns: Sequence[tuple[str, str]] = ()
) -> tuple[dict[str, str], dict[str, str]]:
    """(public, secrets) environment of a Spark job. Public: lake settings without secrets and
    PYTHONPATH, fit for env_vars (a --conf on YARN/Kubernetes). Secrets: catalog password,
    secret catalog properties, S3 keys, source URIs, serving store URIs; they go through
    job_secrets only (cdc_lakehouse.secrecy decides what is secret)."""
    from cdc_lakehouse.secrecy import secrets_of_env
    from cdc_lakehouse.serving.stores import store_uri_env

    lake = lake_settings()
    public, secrets = lake.public_env(), lake.secret_env()
    for cid in sorted(set(source_conn_ids)):
        secrets[source_uri_env(cid)] = source_uri_from_connection(cid)
    for kind, cid in sorted(set(store_conns)):
        secrets[store_uri_env(cid)] = store_uri_from_connection(kind, cid)
    secrets_of_env(secrets)  # known from now on: redact() and Airflow's log masker hide them
    # The job imports the package from --py-files (as on a cluster), not from this checkout.
    plugins = str(PROJECT_ROOT / "plugins")
    public["PYTHONPATH"] = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != plugins
    )
    return public, secrets


def spark_jars() -> list[str]:
    from cdc_lakehouse.runtime.session import default_jars

    return default_jars()


# The temporal partition mappers' default input_format (airflow.sdk StartOfHourMapper & co.), so a
# DAG of a user's own can roll the hourly keys up by day without a format of its own.
PARTITION_KEY_FORMAT = "%Y-%m-%dT%H:%M:%S"


def run_partition_key(context: Any) -> str:
    """The partition key of what a run landed: a partitioned run's own key (a downstream run
    passes on the key it was started for), else the start of its data interval (an ingest: the
    interval whose changes it applied), else its logical date, else when it was due (UTC)."""
    dag_run = context["dag_run"]
    if getattr(dag_run, "partition_key", None):
        return str(dag_run.partition_key)
    start = context.get("data_interval_start") or context.get("logical_date") or dag_run.run_after
    return start.astimezone(UTC).strftime(PARTITION_KEY_FORMAT)


class KeyOutletEvents:
    """post_execute of a task with outlets: after `then` (another post_execute, or None), each
    outlet's asset event carries the run's partition key (run_partition_key), so the DAGs
    scheduled on it with a PartitionedAssetTimetable get one run per key: a re-run or backfill
    of one interval re-runs that interval's dependents and no others (docs/operating.md)."""

    def __init__(self, then: Any = None) -> None:
        self.then = then

    def __call__(self, context: Any, result: Any = None) -> None:
        if self.then is not None:
            self.then(context, result)
        key = run_partition_key(context)
        for outlet in context["task"].outlets:
            context["outlet_events"][outlet].add_partitions(key)


class AnnounceLakeSnapshots:
    """post_execute of an ingest task: each current table's Asset event carries the snapshot the
    run left complete (the newest carrying a `cdc.watermark`) and that watermark's shard positions,
    so a DAG scheduled on the Asset reads exactly up to it (cdc_lakehouse.feed; docs/change-feed.md).

    A failure here only leaves the event without them (logged): the data is committed, and failing
    the task would re-run the ingest for nothing; a consumer then reads up to the newest complete
    snapshot, which includes this run's."""

    def __init__(self, assets: dict[str, Any], points: dict[str, Any] | None = None) -> None:
        self.assets = assets  # lake table (namespace.name) -> its Asset
        self.points = points or {}  # endpoint -> the Asset of its consistent points

    def __call__(self, context: Any, result: Any = None) -> None:
        from cdc_lakehouse.feed.arrow import load_catalog_for
        from cdc_lakehouse.feed.plan import complete_head
        from cdc_lakehouse.lake.ranges import pyiceberg_snapshots

        try:
            lake = lake_settings()
            catalog = load_catalog_for(lake)
            for table, asset in self.assets.items():
                snaps, current = pyiceberg_snapshots(catalog.load_table(table))
                head, head_wm = complete_head(table, snaps, current, None)
                context["outlet_events"][asset].extra = {
                    "table": table,
                    "snapshot_id": head.snapshot_id,
                    "watermark": head_wm.shard_lsns(),
                }
            self.announce_points(context, lake, catalog)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("asset events of %s go without their snapshot: %s", sorted(self.assets), exc)

    def announce_points(self, context: Any, lake: Any, catalog: Any) -> None:
        """Each endpoint's newest consistent point (lake.points), read after this task's commits:
        of two ingests committing at once, the later one's post_execute sees the point both made."""
        if not self.points:
            return
        from cdc_lakehouse.lake.points import read_points

        found = read_points(lake, configs(), self.points, catalog=catalog)
        for endpoint, asset in self.points.items():
            newest = found.get(endpoint) or []
            context["outlet_events"][asset].extra = (
                {"endpoint": endpoint, "point": newest[0].model_dump()}
                if newest
                else {"endpoint": endpoint, "point": None}
            )
