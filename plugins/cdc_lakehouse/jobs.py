"""Command lines of the Spark jobs (spark_jobs/*.py are thin wrappers around these).

Each job takes table names (derive: derived table names) and a config directory, builds the one
SparkSession, runs the job's function per table and prints one JSON line of results per table
(the function's typed result, `to_dict()`ed here: the one place it becomes JSON).
Secrets arrive by reference (CDC_SECRETS_FILE, see job_secrets) or through the environment of a
job started by hand (CDC_CATALOG_PASSWORD, CDC_SOURCE_URI__<CONN>), never as arguments.

Above every stage, since it runs them: each job imports its stage inside its function, so a job
loads only the code it runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cdc_lakehouse.config import OutputMaintenanceConfig, TableConfig, load_table_configs
from cdc_lakehouse.runtime.secrets import load_job_secrets
from cdc_lakehouse.settings import LakeSettings, derived_dir, exports_dir, tables_dir

if TYPE_CHECKING:
    from cdc_lakehouse.derived.config import TreeConfig

log = logging.getLogger("cdc_lakehouse.jobs")


class StageResult(Protocol):
    """What a job's function returns per table: a stage's typed result (ingest.run.IngestResult,
    audit.result.AuditResult, ...), printed on the job's result line as to_dict() gives it."""

    def to_dict(self) -> dict[str, Any]: ...


def _json_default(o: Any) -> Any:
    if isinstance(o, (datetime, date)):
        return o.isoformat()
    return str(o)


def _emit(kind: str, payload: dict[str, Any]) -> None:
    print(f"CDC_RESULT {kind} " + json.dumps(payload, default=_json_default, sort_keys=True), flush=True)


def _parser(description: str, target: str = "tables") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(f"--{target}", required=True, help=f"comma-separated {target} names (config 'name')")
    p.add_argument("--config-dir", default=str(tables_dir()), help="directory of the table YAML files")
    p.add_argument("--app-name", default=None)
    return p


def _configs(args: argparse.Namespace) -> tuple[list[TableConfig], dict[str, str]]:
    cs = load_table_configs(args.config_dir)
    names = [t for t in args.tables.split(",") if t]
    missing = [n for n in names if n not in cs.tables]
    if missing:
        errs = [str(e) for e in cs.errors]
        raise SystemExit(
            f"table config(s) {missing} not found or invalid in {args.config_dir}"
            + ("\n" + "\n".join(errs) if errs else "")
        )
    return [cs.tables[n] for n in names], cs.files


def _derived_configs(args: argparse.Namespace) -> tuple[list[TreeConfig], dict[str, str]]:
    from cdc_lakehouse.derived.config import load_derived_configs

    cs = load_table_configs(args.config_dir)
    ds = load_derived_configs(args.derived_dir, cs.tables)
    names = [n for n in args.derived.split(",") if n]
    missing = [n for n in names if n not in ds.derived]
    if missing:
        errs = [str(e) for e in cs.errors + ds.errors]
        raise SystemExit(
            f"derived config(s) {missing} not found or invalid in {args.derived_dir}"
            + ("\n" + "\n".join(errs) if errs else "")
        )
    return [ds.derived[n] for n in names], ds.files


def run_tables(
    kind: str, spark, lake: LakeSettings, cfgs: list[Any], fn: Callable[..., StageResult], *args: Any
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, Exception]]]:
    """fn(spark, lake, cfg, *args) per table (or derived table); one's failure never stops the others.
    Returns each table's result line (as printed) and the failures."""
    results: dict[str, dict[str, Any]] = {}
    failures: list[tuple[str, Exception]] = []
    for cfg in cfgs:
        t = time.time()
        try:
            result = fn(spark, lake, cfg, *args)
            results[cfg.name] = {"table": cfg.name, "status": "ok", "seconds": time.time() - t, **result.to_dict()}
        except Exception as exc:  # noqa: BLE001 - reported per table, the run fails at the end
            failures.append((cfg.name, exc))
            log.error("%s %s failed: %s\n%s", kind, cfg.name, exc, traceback.format_exc())
            results[cfg.name] = {"table": cfg.name, "status": "failed", "error": str(exc), "seconds": time.time() - t}
        _emit(kind, results[cfg.name])
    return results, failures


def run_per_table(
    kind: str,
    args: argparse.Namespace,
    fn: Callable[..., StageResult],
    configs: Callable[[argparse.Namespace], tuple[list[Any], dict[str, str]]] = _configs,
) -> int:
    """fn(spark, lake, cfg, args, config_file) per config `configs` loads from the command line,
    in one Spark session; 1 when any failed. Configs load before Spark starts: a bad one costs no JVM."""
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.session import get_spark, release_spark

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    load_job_secrets()  # before anything reads CDC_CATALOG_PASSWORD, CDC_SOURCE_URI__*, AWS_*
    cfgs, files = configs(args)
    lake = LakeSettings.from_env()
    t0 = time.time()
    names = ",".join(c.name for c in cfgs)
    spark = get_spark(args.app_name or f"cdc-{kind}-{names[:40]}", lake)
    try:  # a failed job still ends its Spark Connect session on the server
        ensure_meta_tables(spark, lake)
        log.info("%s: Spark session ready in %.1fs (package %s)", kind, time.time() - t0, Path(__file__).parent)
        _, failures = run_tables(kind, spark, lake, cfgs, lambda s, lk, c: fn(s, lk, c, args, files.get(c.name)))
    finally:
        release_spark(spark)
    if failures:
        print(f"{kind}: {len(failures)} of {len(cfgs)} table(s) failed:", file=sys.stderr)
        for name, exc in failures:
            print(f"  {name}: {exc}", file=sys.stderr)
        return 1
    return 0


def main_ingest(argv: list[str] | None = None) -> int:
    p = _parser("Incremental ingest: landing -> changelog -> current table")
    p.add_argument("--upto-run", default=None, help="apply capture runs up to this run id (the data interval end)")
    p.add_argument("--ingest-run", default=None)
    p.add_argument("--interval-end", default=None)
    args = p.parse_args(argv)

    def fn(spark, lake, cfg, a, file):
        from cdc_lakehouse.ingest.run import ingest_table

        run = a.ingest_run or datetime.now(UTC).strftime("manual-%Y%m%dT%H%M%S")
        return ingest_table(
            spark,
            lake,
            cfg,
            upto_run=a.upto_run,
            ingest_run=run,
            interval_end=a.interval_end,
            config_file=file,
        )

    return run_per_table("ingest", args, fn)


def main_bootstrap(argv: list[str] | None = None) -> int:
    p = _parser("Snapshot bootstrap of a table (all shards or some)")
    p.add_argument("--shards", default="", help="comma-separated shard names; empty = all")
    p.add_argument("--run-id", default=None)
    p.add_argument(
        "--pause-after-chunks",
        type=int,
        default=0,
        help="chunked mode: stop cleanly after this many chunks (0 = to the end); the next run resumes",
    )
    args = p.parse_args(argv)

    def fn(spark, lake, cfg, a, file):
        from cdc_lakehouse.bootstrap.run import bootstrap_table
        from cdc_lakehouse.config import load_table_configs

        run = a.run_id or datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        cs = load_table_configs(a.config_dir)
        ep_tables = cs.endpoint_tables()
        shards = [s for s in a.shards.split(",") if s] or None
        if cfg.landing.kind == "debezium_s3":  # Debezium's own snapshot ('r' events) loads it
            from cdc_lakehouse.landing.debezium import bootstrap_debezium

            return bootstrap_debezium(spark, lake, cfg)
        done = [0]

        def should_stop(_state) -> bool:  # asked after every chunk; the run stops at the round's end
            done[0] += 1
            return 0 < a.pause_after_chunks <= done[0]

        return bootstrap_table(
            spark,
            lake,
            cfg,
            run_id=run,
            shards=shards,
            all_endpoint_tables=ep_tables,
            should_stop=should_stop,
            # A broken config's columns cannot be narrowed out: then no lists (see capture_endpoint).
            table_configs=None if cs.errors else list(cs.tables.values()),
        )

    return run_per_table("bootstrap", args, fn)


def main_maintenance(argv: list[str] | None = None) -> int:
    """Maintenance of replicated tables (--tables), derived tables (--derived) or one feed
    consumer's Iceberg output (--feed-output with --consumer)."""
    p = argparse.ArgumentParser(description="Daily maintenance: compaction, expiry, orphans, latest-per-key view")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--tables", help="comma-separated table names (config 'name')")
    what.add_argument("--derived", help="comma-separated derived table names (config 'name')")
    what.add_argument("--feed-output", help="namespace.table of a feed consumer's Iceberg output")
    p.add_argument("--consumer", help="--feed-output: the consumer writing it")
    p.add_argument("--settings", default="{}", help="--feed-output: its maintenance settings, JSON")
    p.add_argument("--config-dir", default=str(tables_dir()), help="directory of the table YAML files")
    p.add_argument("--derived-dir", default=str(derived_dir()), help="directory of the derived YAML files")
    p.add_argument("--app-name", default=None)
    p.add_argument("--run-id", default=None)
    args = p.parse_args(argv)
    run = args.run_id or datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    if args.derived:
        return run_per_table("maintenance", args, _maintain_derived(run), _derived_configs)
    if args.feed_output:
        return run_per_table("maintenance", args, _maintain_feed_output(run), _feed_output_configs)

    def fn(spark, lake, cfg, a, file):
        from cdc_lakehouse.maintenance import maintain_table

        consumers = list(load_table_configs(a.config_dir).tables.values())
        return maintain_table(spark, lake, cfg, run_id=run, consumers=consumers)

    return run_per_table("maintenance", args, fn)


def _maintain_derived(run: str) -> Callable[..., StageResult]:
    def fn(spark, lake, dcfg, a, file):
        from cdc_lakehouse.maintenance import maintain_derived

        return maintain_derived(spark, lake, dcfg, run_id=run)

    return fn


@dataclass(frozen=True)
class FeedOutput:
    """A feed consumer's Iceberg output, as the consumer's DAG declares it (dag_factory.feed_consumer_dag)."""

    name: str  # the consumer
    output: str  # namespace.table
    settings: OutputMaintenanceConfig


def _feed_output_configs(args: argparse.Namespace) -> tuple[list[FeedOutput], dict[str, str]]:
    from cdc_lakehouse.feed.models import check_consumer_name

    if not args.consumer:
        raise SystemExit("--feed-output needs --consumer: the consumer whose offsets its commits carry")
    settings = OutputMaintenanceConfig.model_validate_json(args.settings)
    return [FeedOutput(check_consumer_name(args.consumer), args.feed_output, settings)], {}


def _maintain_feed_output(run: str) -> Callable[..., StageResult]:
    def fn(spark, lake, out, a, file):
        from cdc_lakehouse.maintenance import maintain_feed_output

        return maintain_feed_output(spark, lake, out.name, out.output, out.settings, run_id=run)

    return fn


def main_audit(argv: list[str] | None = None) -> int:
    p = _parser("Audit: source keys vs lake keys, Great Expectations checks, optional repair")
    p.add_argument("--audit-run", default=None)
    args = p.parse_args(argv)

    def fn(spark, lake, cfg, a, file):
        from cdc_lakehouse.audit.errors import AuditFailed
        from cdc_lakehouse.audit.run import audit_table

        run = a.audit_run or datetime.now(UTC).strftime("manual-%Y%m%dT%H%M%S")
        result = audit_table(spark, lake, cfg, audit_run=run)
        if result.verdict == "fail":
            raise AuditFailed(result.message)
        return result

    return run_per_table("audit", args, fn)


def main_derive(argv: list[str] | None = None) -> int:
    p = _parser("Derived tables: trees over current lake tables (docs/derived-trees.md)", target="derived")
    p.add_argument("--derived-dir", default=str(derived_dir()), help="directory of the derived YAML files")
    p.add_argument(
        "--mode", choices=["auto", "full"], default="auto", help="auto: incremental when possible; full: recompute"
    )
    args = p.parse_args(argv)

    def fn(spark, lake, dcfg, a, file):
        from cdc_lakehouse.derived.run import derive_tree

        tables = load_table_configs(a.config_dir).tables
        return derive_tree(spark, lake, dcfg, tables, full=a.mode == "full")

    return run_per_table("derive", args, fn, _derived_configs)


def _export_configs(args: argparse.Namespace) -> tuple[list[Any], dict[str, str]]:
    from cdc_lakehouse.derived.config import load_derived_configs
    from cdc_lakehouse.serving.config import load_export_configs

    cs = load_table_configs(args.config_dir)
    ds = load_derived_configs(args.derived_dir, cs.tables)
    es = load_export_configs(args.exports_dir, cs.tables, ds.derived)
    names = [n for n in args.exports.split(",") if n]
    missing = [n for n in names if n not in es.exports]
    if missing:
        errs = [str(e) for e in cs.errors + ds.errors + es.errors]
        raise SystemExit(
            f"export config(s) {missing} not found or invalid in {args.exports_dir}"
            + ("\n" + "\n".join(errs) if errs else "")
        )
    args.tables_by_name, args.derived_by_name = cs.tables, ds.derived
    return [es.exports[n] for n in names], es.files


def main_export(argv: list[str] | None = None) -> int:
    p = _parser("Serving exports: lake tables into key-value stores (docs/serving-export.md)", target="exports")
    p.add_argument("--derived-dir", default=str(derived_dir()), help="directory of the derived YAML files")
    p.add_argument("--exports-dir", default=str(exports_dir()), help="directory of the export YAML files")
    p.add_argument(
        "--mode",
        choices=["auto", "full", "rollback", "resume"],
        default="auto",
        help="auto: incremental when possible; full: a new version; rollback: alias back to the previous "
        "version, held there; resume: release a held alias and catch up incrementally",
    )
    args = p.parse_args(argv)

    def fn(spark, lake, ecfg, a, file):
        from cdc_lakehouse.serving.run import export, rollback_export

        if a.mode == "rollback":
            return rollback_export(ecfg)
        return export(spark, lake, ecfg, a.tables_by_name, a.derived_by_name, mode=a.mode)

    return run_per_table("export", args, fn, _export_configs)
