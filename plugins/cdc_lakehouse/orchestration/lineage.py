"""OpenLineage: what each CDC task read and wrote, with the facets only this project knows.

Airflow's OpenLineage provider sends the events (START/COMPLETE/FAIL of every task, to the
transport of `[openlineage] transport`; nothing is sent while none is configured). The capture
and Spark operators answer its `get_openlineage_facets_on_complete` from here:

  capture__<endpoint>   source shard tables            -> landing, per source table
  ingest                landing of the table           -> changelog and current table
  bootstrap             source shard tables            -> current table
  audit                 current table, source shards   (the verdict as data-quality assertions)
  maintenance           -                              -> the table it compacts
  derive                current tables the tree reads  -> its output and unresolved tables
  export                the table it exports           -> the store's namespace (Redis, DynamoDB)
  consume (a feed)      the table's current table      -> the consumer's output table

Dataset names follow OpenLineage's naming: a PostgreSQL table is `postgres://host:port` +
`database.schema.table`; the landing is a path in `file` or `s3://bucket`; an Iceberg table is
named by its location (what OpenLineage's Spark integration names it by, so the two graphs join),
with the catalog's name for it as a symlink. OpenLineage names no key-value store: a Redis
export is `redis://host:port` + its key namespace, a DynamoDB one `dynamodb://<region>` (or the
endpoint's host:port off AWS) + its tables' prefix; never a credential.

Run facets (cdc_capture, cdc_ingest, cdc_audit) carry the LSN range per shard, the watermark,
the snapshot ids and the row counts, read from the run's own records (the capture's manifest, the
cdc_meta rows of the run). Best effort: lineage never fails a task (the provider logs and sends
the event without our part).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

import attr
from airflow.providers.common.compat.openlineage.facet import (
    Dataset,
    Identifier,
    InputDataset,
    OutputDataset,
    RunFacet,
    SymlinksDatasetFacet,
)

if TYPE_CHECKING:
    from cdc_lakehouse.config import TableConfig
    from cdc_lakehouse.serving.config import ExportStore
    from cdc_lakehouse.settings import LakeSettings

log = logging.getLogger(__name__)

FACETS_DOC = "https://github.com/cdc-lakehouse/cdc-lakehouse/blob/main/docs/lineage.md"


def lsn_text(lsn: int | None) -> str | None:
    """An LSN as PostgreSQL prints it (0/16B3748)."""
    return None if lsn is None else f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


@attr.define
class _CdcRunFacet(RunFacet):
    """A run facet of this project: its schema is its section of docs/lineage.md."""

    _section: ClassVar[str] = ""

    @classmethod
    def _get_schema(cls) -> str:
        return f"{FACETS_DOC}#{cls._section}"


@attr.define
class CdcCaptureRunFacet(_CdcRunFacet):
    """One capture run of an endpoint: the WAL range it landed, and how much."""

    _section: ClassVar[str] = "cdc_capture"

    endpoint: str
    captureRun: str  # noqa: N815 - OpenLineage facets spell fields in camelCase
    startLsn: str | None  # noqa: N815
    endLsn: str | None  # noqa: N815
    events: int | None
    reused: bool


@attr.define
class CdcIngestRunFacet(_CdcRunFacet):
    """One ingest run, per table: rows applied, quarantined, and where each shard now stands."""

    _section: ClassVar[str] = "cdc_ingest"

    tables: dict[str, dict[str, Any]]


@attr.define
class CdcAuditRunFacet(_CdcRunFacet):
    """One audit run, per table and shard: the verdict and the keys that differed."""

    _section: ClassVar[str] = "cdc_audit"

    tables: dict[str, dict[str, Any]]


# --- datasets -------------------------------------------------------------------------------------


def source_tables(cfg: TableConfig, endpoint: str | None = None) -> list[Dataset]:
    """The table's shards at their sources (those of `endpoint` only, if given):
    postgres://host:port, database.schema.table."""
    from cdc_lakehouse.orchestration.tasks import source_uri_from_connection
    from cdc_lakehouse.settings import SourceEndpoint

    out = []
    for g, schema, _ in cfg.shards():
        if endpoint is None or g.endpoint_id == endpoint:
            ep = SourceEndpoint.from_uri(source_uri_from_connection(g.conn_id), g.database)
            out.append(Dataset(f"postgres://{ep.host}:{ep.port}", f"{ep.database}.{schema}.{cfg.source.table}"))
    return out


def landing(lake: LakeSettings, endpoint: str, table: str) -> Dataset:
    """One source table's landing files of one endpoint (landing.format.run_dir's parent)."""
    ns, path = _location(lake.landing_uri.rstrip("/"))
    name = f"{path}/{endpoint}/{table}"
    return Dataset(ns, name if ns == "file" else name.lstrip("/"))  # a bucket's root: no leading "/"


def _location(uri: str) -> tuple[str, str]:
    """(namespace, name) of a file or object-store location, as OpenLineage names them: `file`
    and the absolute path, or `<scheme>://<bucket>` and the key (s3a and s3n are s3, as
    OpenLineage's Spark integration writes them)."""
    u = urlsplit(uri)
    if not u.netloc:
        return "file", u.path
    scheme = "s3" if u.scheme in ("s3a", "s3n") else u.scheme
    return f"{scheme}://{u.netloc}", u.path.lstrip("/")


def lake_table(lake: LakeSettings, table: str, catalog: Any) -> Dataset:
    """An Iceberg table by its location, with the catalog's name as a symlink; by that name alone
    while the table does not exist."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    symlink = Identifier(namespace=f"iceberg://{lake.catalog_name}", name=table, type="TABLE")
    try:
        location = catalog.load_table(table).location()
    except (NoSuchTableError, NoSuchNamespaceError):
        # A job's first run creates its outputs (and a derived tree's namespace): an event sent
        # before they exist (that run's FAIL, which the provider also asks on_complete for) names
        # them by the catalog's identifier instead of losing every dataset of the event. Once the
        # table exists, its location names it, with this same identifier as its symlink.
        return Dataset(symlink.namespace, table)
    ns, name = _location(location)
    return Dataset(ns, name, facets={"symlinks": SymlinksDatasetFacet(identifiers=[symlink])})


def redis_store(host: str, port: int, db: str, namespace: str) -> Dataset:
    """A serving export's namespace in Redis (its keys are `<namespace>:...`). A db other than the
    default 0 is part of the name: one server's dbs may each hold a namespace of that name."""
    return Dataset(f"redis://{host}:{port}", namespace if db in ("", "0") else f"{db}/{namespace}")


def dynamodb_store(region: str, endpoint: str, table_prefix: str, namespace: str) -> Dataset:
    """A serving export's namespace in DynamoDB: its version tables are `<prefix><namespace>.v<N>`,
    so the name is `<prefix><namespace>`. On AWS the region names the store (an ARN would need the
    account id, which only a credentialed call tells); off AWS (DynamoDB Local, a test server), the
    endpoint's host:port does."""
    on_aws = not endpoint or endpoint.partition(":")[0].endswith(".amazonaws.com")
    return Dataset(f"dynamodb://{region if on_aws else endpoint}", f"{table_prefix}{namespace}")


def export_store(store: ExportStore) -> Dataset:
    """An export's store, from its Airflow connection's public parts: host, port, db, region."""
    from cdc_lakehouse.orchestration.tasks import dynamodb_address, dynamodb_hook, redis_address

    if store.kind == "redis":
        from airflow.sdk import BaseHook

        host, port, db = redis_address(BaseHook.get_connection(store.conn_id))
        return redis_store(host, port, db, store.namespace)
    region, _, endpoint = dynamodb_address(dynamodb_hook(store.conn_id))
    return dynamodb_store(region, endpoint, store.table_prefix, store.namespace)


def _catalog(lake: LakeSettings) -> Any:
    from pyiceberg.catalog import load_catalog

    return load_catalog(lake.catalog_name, **lake.pyiceberg_properties())


# --- per task -------------------------------------------------------------------------------------


def capture_lineage(endpoint: str, xcom: dict[str, Any]) -> Any:
    """capture__<endpoint>: its source tables -> their landing, with the run's WAL range."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    from cdc_lakehouse.orchestration.tasks import configs, lake_settings

    cs, lake = configs(), lake_settings()
    members = cs.endpoints().get(endpoint, [])
    inputs = [d for cfg, _ in members for d in source_tables(cfg, endpoint)]
    outputs = [landing(lake, endpoint, t) for t in sorted({cfg.source.table for cfg, _ in members})]
    facets: dict[str, Any] = {}
    if xcom.get("run_id"):  # a failed run (its FAIL event comes here too) landed nothing to describe
        facets["cdc_capture"] = CdcCaptureRunFacet(
            endpoint=endpoint,
            captureRun=str(xcom["run_id"]),
            startLsn=lsn_text(xcom.get("start_lsn")),
            endLsn=lsn_text(xcom.get("end_lsn")),
            events=xcom.get("events"),
            reused=bool(xcom.get("reused")),
        )
    return OperatorLineage(
        inputs=[_as_input(d) for d in _unique(inputs)],
        outputs=[_as_output(d) for d in outputs],
        run_facets=facets,
    )


def spark_job_lineage(job: str, params: Any) -> Any:
    """The Spark task of `job` (jobs.registry) on its parsed parameters: ingest, bootstrap, audit,
    maintenance (of replicated tables), derive, export, and any change-feed consumer's job; None
    for a job not described (its task events carry no datasets)."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    from cdc_lakehouse.orchestration.tasks import configs, lake_settings

    describe = _describer(job, params)
    if describe is None:
        return None
    cs, lake = configs(), lake_settings()
    catalog = _catalog(lake)
    cfgs = [cs.tables[t] for t in getattr(params, "tables", ()) if t in cs.tables]
    inputs, outputs, facets = describe(lake, catalog, cfgs, params)
    return OperatorLineage(
        inputs=[_as_input(d) for d in _unique(inputs)],
        outputs=[_as_output(d) for d in _unique(outputs)],
        run_facets=facets,
    )


def _describer(job: str, params: Any) -> Any:
    from cdc_lakehouse.jobs.feed import FeedConsumerParams

    # A feed consumer's job is its author's, named as they like (feed_block_counts, ...): known
    # by its parameters, which every consumer's job takes (dag_parts.feed_consumer_dag).
    if isinstance(params, FeedConsumerParams):
        return _feed
    return _JOBS.get(job)


def _ingest(lake, catalog, cfgs, params):
    inputs = [landing(lake, g.endpoint_id, cfg.source.table) for cfg in cfgs for g in cfg.source.shards]
    outputs = [lake_table(lake, t, catalog) for cfg in cfgs for t in _ingest_outputs(cfg)]
    run = params.ingest_run
    tables = {cfg.name: _ingest_figures(lake, cfg, run) for cfg in cfgs} if run else {}
    return inputs, outputs, {"cdc_ingest": CdcIngestRunFacet(tables=tables)}


def _ingest_outputs(cfg: TableConfig) -> list[str]:
    """The changelog and current table, and the history the ingest job keeps after them."""
    return [cfg.changelog_table, cfg.current_table, *([cfg.history_table] if cfg.history.enabled else [])]


def _history(lake, catalog, cfgs, params):
    return (
        [lake_table(lake, cfg.changelog_table, catalog) for cfg in cfgs],
        [lake_table(lake, cfg.history_table, catalog) for cfg in cfgs if cfg.history.enabled],
        {},
    )


def _bootstrap(lake, catalog, cfgs, params):
    inputs = [d for cfg in cfgs for d in source_tables(cfg)]
    outputs = [lake_table(lake, t, catalog) for cfg in cfgs for t in (cfg.current_table,)]
    return inputs, outputs, {}


def _audit(lake, catalog, cfgs, params):
    tables = {cfg.name: _audit_figures(lake, cfg, params.audit_run) for cfg in cfgs} if params.audit_run else {}
    inputs = []
    for cfg in cfgs:
        current = lake_table(lake, cfg.current_table, catalog)
        shards = tables.get(cfg.name, {})
        if shards:
            current = _with_assertions(current, shards)
        inputs += [current, *source_tables(cfg)]
    return inputs, [], {"cdc_audit": CdcAuditRunFacet(tables=tables)}


def _maintenance(lake, catalog, cfgs, params):
    return [], [lake_table(lake, cfg.current_table, catalog) for cfg in cfgs], {}


def _derive(lake, catalog, cfgs, params):
    from cdc_lakehouse.jobs.runner import derived_configs

    cs, ds = derived_configs(params.config_dir, params.derived_dir)  # as the job loads them
    # A missing or invalid config: the job refuses it before Spark starts, so nothing to describe.
    trees = [ds.derived[n] for n in params.derived if n in ds.derived]
    # The current tables each tree is computed from (an incremental run may also consult their
    # changelogs for the keys that changed: the same rows' history, not another input).
    inputs = [lake_table(lake, cs.tables[t].current_table, catalog) for d in trees for t in d.input_names]
    outputs = [lake_table(lake, t, catalog) for d in trees for t in (d.output_table, d.unresolved_table)]
    return inputs, outputs, {}


def _export(lake, catalog, cfgs, params):
    from cdc_lakehouse.jobs.runner import derived_configs
    from cdc_lakehouse.serving.config import load_export_configs, resolve_source
    from cdc_lakehouse.settings import exports_dir

    cs, ds = derived_configs(params.config_dir, params.derived_dir)
    es = load_export_configs(params.exports_dir or exports_dir(), cs.tables, ds.derived)
    exports = [es.exports[n] for n in params.exports if n in es.exports]  # the job refuses the others
    # A rollback only moves the store's alias back: it reads no table.
    sources = [] if params.mode == "rollback" else [resolve_source(e, cs.tables, ds.derived).table for e in exports]
    return [lake_table(lake, t, catalog) for t in sources], [export_store(e.store) for e in exports], {}


def _feed(lake, catalog, cfgs, params):
    return (
        [lake_table(lake, cfg.current_table, catalog) for cfg in cfgs],
        [lake_table(lake, params.output, catalog)],
        {},
    )


_JOBS = {
    "ingest": _ingest,
    "bootstrap": _bootstrap,
    "audit": _audit,
    "maintenance": _maintenance,
    "history": _history,
    "derive": _derive,
    "export": _export,
}


# --- the run's figures, from cdc_meta -------------------------------------------------------------


def _ingest_figures(lake: LakeSettings, cfg: TableConfig, run: str) -> dict[str, Any]:
    from cdc_lakehouse.lake.ingest_metrics import IngestMetrics
    from cdc_lakehouse.lake.meta_rows import ShardFreshness
    from cdc_lakehouse.orchestration.history import meta_rows

    fields = (
        "table_name",
        "ingest_run",
        "events_read",
        "inserts",
        "updates",
        "deletes",
        "quarantined",
        "status",
        "committed_at",
    )
    runs = meta_rows(lake, "ingest_runs", IngestMetrics, "ingest_run", run, fields) or []
    # A retried run records again: its newest row (a scan's order is no time order).
    mine = sorted((r for r in runs if r.table_name == cfg.name), key=lambda r: _when(r.committed_at))
    fresh = meta_rows(
        lake,
        "freshness",
        ShardFreshness,
        "ingest_run",
        run,
        ("table_name", "shard", "watermark_lsn", "lake_snapshot_id", "freshness_seconds", "updated_at"),
    )
    fresh = sorted(fresh or [], key=lambda f: _when(f.updated_at))  # the newest row per shard wins below
    out: dict[str, Any] = {}
    if mine:
        m = mine[-1]
        out = {
            "status": m.status,
            "eventsRead": m.events_read,
            "rowsInserted": m.inserts,
            "rowsUpdated": m.updates,
            "rowsDeleted": m.deletes,
            "rowsQuarantined": m.quarantined,
        }
    out["shards"] = {
        f.shard: {
            "watermarkLsn": lsn_text(f.watermark_lsn),
            "snapshotId": f.lake_snapshot_id,
            "freshnessSeconds": f.freshness_seconds,
        }
        for f in fresh
        if f.table_name == cfg.name
    }
    return out


def _audit_figures(lake: LakeSettings, cfg: TableConfig, run: str) -> dict[str, Any]:
    from cdc_lakehouse.lake.meta_rows import AuditResult
    from cdc_lakehouse.orchestration.history import meta_rows

    fields = (
        "table_name",
        "audit_run",
        "shard",
        "verdict",
        "missing",
        "extra",
        "different",
        "in_flight",
        "persistent",
        "repaired",
        "audited_at",
    )
    rows = sorted(
        meta_rows(lake, "audit_results", AuditResult, "audit_run", run, fields) or [], key=lambda r: _when(r.audited_at)
    )
    return {
        r.shard: {
            "verdict": r.verdict,
            "missing": r.missing,
            "extra": r.extra,
            "different": r.different,
            "inFlight": r.in_flight,
            "persistent": r.persistent,
            "repaired": r.repaired,
        }
        for r in rows
        if r.table_name == cfg.name
    }


def _with_assertions(d: Dataset, shards: dict[str, dict[str, Any]]) -> InputDataset:
    """The audit's verdict per shard as OpenLineage data-quality assertions on the table it read."""
    from openlineage.client.generated.data_quality_assertions_dataset import (
        Assertion,
        DataQualityAssertionsDatasetFacet,
    )

    assertions = [
        Assertion(
            assertion="keys_and_values_equal_source",
            # As the alerts judge a run: a shard fails when its mismatches persisted and were not
            # repaired; a first sighting (mismatch_pending) is not yet a failure.
            success=s.get("verdict") != "fail" or bool(s.get("repaired")),
            name=f"audit {shard}",
            actual=f"missing {s.get('missing') or 0}, extra {s.get('extra') or 0}, different {s.get('different') or 0}",
        )
        for shard, s in sorted(shards.items())
    ]
    return InputDataset(
        d.namespace,
        d.name,
        inputFacets={"dataQualityAssertions": DataQualityAssertionsDatasetFacet(assertions=assertions)},
        facets=d.facets,
    )


def _when(at: Any) -> float:
    return at.timestamp() if at is not None else 0.0


def _unique(ds: list[Dataset]) -> list[Dataset]:
    seen: dict[tuple[str, str], Dataset] = {}
    for d in ds:
        seen.setdefault((d.namespace, d.name), d)
    return list(seen.values())


def _as_input(d: Dataset) -> InputDataset:
    return d if isinstance(d, InputDataset) else InputDataset(d.namespace, d.name, facets=d.facets)


def _as_output(d: Dataset) -> OutputDataset:
    return OutputDataset(d.namespace, d.name, facets=d.facets)
