"""OpenLineage: what each CDC task read and wrote, with the facets only this project knows.

Airflow's OpenLineage provider sends the events (START/COMPLETE/FAIL of every task, to the
transport of `[openlineage] transport`; nothing is sent while none is configured). The capture
and Spark operators answer its `get_openlineage_facets_on_complete` from here:

  capture__<endpoint>   source shard tables            -> landing, per source table
  ingest                landing of the table           -> changelog and current table
  bootstrap             source shard tables            -> current table
  audit                 current table, source shards   (the verdict as data-quality assertions)
  maintenance           -                              -> the table it compacts

Dataset names follow OpenLineage's naming: a PostgreSQL table is `postgres://host:port` +
`database.schema.table`; the landing is a path in `file` or `s3://bucket`; an Iceberg table is
named by its location (what OpenLineage's Spark integration names it by, so the two graphs join),
with the catalog's name for it as a symlink.

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
    """An Iceberg table by its location, with the catalog's name as a symlink."""
    ns, name = _location(catalog.load_table(table).location())
    symlink = Identifier(namespace=f"iceberg://{lake.catalog_name}", name=table, type="TABLE")
    return Dataset(ns, name, facets={"symlinks": SymlinksDatasetFacet(identifiers=[symlink])})


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
    """The Spark task of `job` (jobs.registry) on its parsed parameters; None for the jobs whose
    datasets are not described yet (derive, export, feed: their task events carry no datasets)."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    from cdc_lakehouse.orchestration.tasks import configs, lake_settings

    describe = _JOBS.get(job)
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


def _ingest(lake, catalog, cfgs, params):
    inputs = [landing(lake, g.endpoint_id, cfg.source.table) for cfg in cfgs for g in cfg.source.shards]
    outputs = [lake_table(lake, t, catalog) for cfg in cfgs for t in (cfg.changelog_table, cfg.current_table)]
    run = params.ingest_run
    tables = {cfg.name: _ingest_figures(lake, cfg, run) for cfg in cfgs} if run else {}
    return inputs, outputs, {"cdc_ingest": CdcIngestRunFacet(tables=tables)}


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


_JOBS = {"ingest": _ingest, "bootstrap": _bootstrap, "audit": _audit, "maintenance": _maintenance}


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
