"""The demo: a Notion-like source on the local PostgreSQL, replicated through Airflow.

python -m devstack.demo prepare   create and load the source if missing
python -m devstack.demo run       prepare, then bootstrap, workload, ingest intervals (the
                                  first and last followed by the derived trees and serving exports),
                                  audit and maintenance via `airflow dags test`, then a summary
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from cdc_lakehouse.columns import OP_COL, SHARD_COL
from cdc_lakehouse.config import load_table_configs
from cdc_lakehouse.derived.config import TreeConfig, load_derived_configs
from cdc_lakehouse.settings import LakeSettings, derived_dir, tables_dir

from devstack.workload import NotionWorkload

SHARDS = ["shard_00", "shard_01", "shard_02", "shard_03"]


def _say(msg: str) -> None:
    print(f"[demo {datetime.now().astimezone().strftime('%H:%M:%S')}] {msg}", flush=True)


def source_dsn() -> str:
    port = os.environ.get("CDC_LOCAL_PG_PORT", "55432")
    pw = os.environ.get("CDC_LOCAL_PG_PASSWORD", "")
    from cdc_lakehouse.settings import libpq_dsn

    return libpq_dsn(host="127.0.0.1", port=port, dbname="notion", user="postgres", password=pw)


def prepare(blocks_per_shard: int) -> NotionWorkload:
    import psycopg2

    wl = NotionWorkload(source_dsn(), SHARDS, seed=7)
    conn = psycopg2.connect(source_dsn())
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'shard_00' AND tablename = 'block'")
            row = cur.fetchone()
            exists = row is not None and row[0] == 1  # count(*) always returns one row
    finally:
        conn.close()
    if exists:
        wl.sync_ids()
        _say(f"source: Notion-like schema present in database notion ({', '.join(SHARDS)})")
    else:
        t = time.time()
        wl.create()
        wl.load(blocks_per_shard=blocks_per_shard)
        _say(
            f"source: created blocks, spaces and permissions in {len(SHARDS)} shards "
            f"({blocks_per_shard} blocks each) in {time.time() - t:.1f}s"
        )
    return wl


def dags_test(dag_id: str, logical_date: datetime | None = None, conf: str | None = None) -> float:
    """One DAG run through Airflow's `dags test`, failing loudly with its log's tail.

    The CLI's own function, called in this process: Airflow's start, its in-process execution API
    and the imports of the tasks that run in Airflow (capture) are paid once for the demo rather
    than once per DAG run (about 10 s each here, docs/benchmarks-history.md "`make demo`")."""
    from airflow.cli.commands import dag_command

    t = time.time()
    log_dir = os.path.join(os.environ.get("AIRFLOW_HOME", "."), "demo-logs")
    os.makedirs(log_dir, exist_ok=True)
    log_file = os.path.join(log_dir, f"{dag_id}-{int(t)}.log")
    args = argparse.Namespace(
        dag_id=dag_id,
        logical_date=logical_date,
        conf=conf,
        use_executor=False,
        mark_success_pattern=None,
        bundle_name=None,
        dagfile_path=None,
        show_dagrun=False,
        imgcat_dagrun=False,
        save_dagrun=None,
    )
    rc = 0
    with open(log_file, "w") as out, _output_to(out):
        try:
            dag_command.dag_test(args)
        except SystemExit as e:  # "DagRun failed"
            print(e)
            rc = 1
        except Exception:  # noqa: BLE001 - reported with the log's tail below
            traceback.print_exc()
            rc = 1
    text = open(log_file).read()
    if rc or re.search(r"state=failed|DagRunState.FAILED|Task failed|ERROR - Task failed", text):
        tail = "\n".join(text.splitlines()[-40:])
        raise RuntimeError(f"{dag_id} failed (log {log_file}):\n{tail}")
    return time.time() - t


@contextmanager
def _output_to(f) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors: Airflow's logs and spark-submit's output
    too) into `f` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(f.fileno(), 1)
    os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)


def _lake_summary(lake: LakeSettings, wl: NotionWorkload) -> list[str]:
    """Rows per layer and the latest figures, read with pyiceberg through the shared catalog."""
    from pyiceberg.catalog import load_catalog

    cat = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    lines = _layer_lines(cat, wl)
    lines.append("")
    lines += _ingest_lines(cat, lake)
    lines += _freshness_lines(cat, lake)
    lines.append("")
    audit, verdicts = _audit_lines(cat, lake)
    lines += audit
    lines.append("")
    lines += _maintenance_lines(cat, lake)
    for dcfg in _derived().values():
        lines += ["", *_tree_lines(cat, dcfg)]
    for ecfg in _exports().values():
        lines += ["", _export_line(ecfg)]
    overall = "clean" if verdicts and all(v == "clean" for v in verdicts) else "FAIL"
    lines.insert(0, f"AUDIT VERDICT: {overall}")
    return lines


def _layer_lines(cat, wl: NotionWorkload) -> list[str]:
    """Rows per table in the source, the changelog, the current table and the latest view."""
    import pyarrow.compute as pc

    cs = load_table_configs(tables_dir())
    lines = [f"{'table':<11}{'source':>9}{'changelog':>11}{'current':>9}{'latest view':>13}"]
    for name, cfg in sorted(cs.tables.items()):
        src_rows = sum(wl.row_counts(cfg.source.table).values())
        cl = cat.load_table(cfg.changelog_table).scan(selected_fields=(OP_COL,)).to_arrow().num_rows
        cur_t = (
            cat.load_table(cfg.current_table)
            .scan(selected_fields=(SHARD_COL,) + ((cfg.soft_delete_columns.flag,) if cfg.deletes == "soft" else ()))
            .to_arrow()
        )
        if cfg.deletes == "soft":
            cur_t = cur_t.filter(pc.invert(cur_t[cfg.soft_delete_columns.flag]))
        try:
            view = cat.load_table(cfg.latest_view).scan(selected_fields=(SHARD_COL,)).to_arrow().num_rows
        except Exception:  # noqa: BLE001 - before the first maintenance
            view = "-"
        lines.append(f"{name:<11}{src_rows:>9}{cl:>11}{cur_t.num_rows:>9}{view!s:>13}")
    return lines


def _ingest_lines(cat, lake: LakeSettings) -> list[str]:
    """The last ingest run of each table."""
    runs = cat.load_table(lake.meta_table("ingest_runs")).scan().to_arrow().to_pylist()
    latest: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r["table_name"] not in latest or r["committed_at"] > latest[r["table_name"]]["committed_at"]:
            latest[r["table_name"]] = r
    lines = []
    for name, r in sorted(latest.items()):
        wa = r.get("write_amplification")
        lines.append(
            f"ingest {name}: last run {r['events_read']} events, +{r['inserts']} ~{r['updates']} "
            f"-{r['deletes']}, quarantined {r['quarantined']}, write amplification "
            f"{'n/a' if wa is None else f'{wa:.2f}'}, freshness {r.get('freshness_seconds') or 0:.0f}s, "
            f"apply {r.get('apply_seconds') or 0:.1f}s"
        )
    return lines


def _freshness_lines(cat, lake: LakeSettings) -> list[str]:
    """Per table and shard, its newest cdc_meta.freshness row: how far behind, the last heartbeat and
    source commit, and the lake snapshot that made the position visible."""
    from cdc_lakehouse.lake.freshness import latest_per_shard

    rows = cat.load_table(lake.meta_table("freshness")).scan().to_arrow().to_pylist()
    by_table: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_table.setdefault(r["table_name"], []).append(r)
    lines = []
    for name, trs in sorted(by_table.items()):
        for shard, f in sorted(latest_per_shard(trs).items()):
            behind = "n/a" if f.freshness_seconds is None else f"{f.freshness_seconds:.0f}s"
            hb = f.last_heartbeat_ts.strftime("%H:%M:%S") if f.last_heartbeat_ts else "-"
            src = f.last_source_commit_ts.strftime("%H:%M:%S") if f.last_source_commit_ts else "-"
            lines.append(
                f"freshness {name} {shard}: {behind} behind, last heartbeat {hb}, last change {src}, "
                f"lake snapshot {f.lake_snapshot_id}"
            )
    return lines


def _audit_lines(cat, lake: LakeSettings) -> tuple[list[str], list[str]]:
    """The last audit of each table, and its verdicts."""
    audits = cat.load_table(lake.meta_table("audit_results")).scan().to_arrow().to_pylist()
    last_audit: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(audits, key=lambda x: x["audited_at"]):
        last_audit.setdefault(r["table_name"], [])
        if last_audit[r["table_name"]] and last_audit[r["table_name"]][0]["audit_run"] != r["audit_run"]:
            last_audit[r["table_name"]] = []
        last_audit[r["table_name"]].append(r)
    lines, verdicts = [], []
    for name, rows in sorted(last_audit.items()):
        v = "FAIL" if any(r["verdict"] == "fail" for r in rows) else "clean"
        verdicts.append(v)
        lines.append(
            f"audit {name}: {v} — {sum(r['lake_rows'] for r in rows)} lake rows in {len(rows)} shards, "
            f"missing {sum(r['missing'] for r in rows)}, extra {sum(r['extra'] for r in rows)}, different "
            f"{sum(r['different'] for r in rows)}, in flight {sum(r['in_flight'] for r in rows)} ({rows[0]['mode']})"
        )
    return lines, verdicts


def _maintenance_lines(cat, lake: LakeSettings) -> list[str]:
    """Files and snapshots before and after each maintenance target."""
    maint = cat.load_table(lake.meta_table("maintenance_runs")).scan().to_arrow().to_pylist()
    lines = []
    for r in sorted(maint, key=lambda x: (x["table_name"], x["target"], x["phase"] != "before")):
        if r["phase"] == "before":
            before = r
        else:
            lines.append(
                f"maintenance {r['table_name']} {r['target']}: data files {before['data_files']} -> "
                f"{r['data_files']}, delete files {before['delete_files']} -> {r['delete_files']}, "
                f"snapshots {before['snapshots']} -> {r['snapshots']}"
            )
    return lines


def _derived() -> dict[str, TreeConfig]:
    return load_derived_configs(derived_dir(), load_table_configs(tables_dir()).tables).derived


def _exports() -> dict[str, Any]:
    from cdc_lakehouse.serving.config import load_export_configs
    from cdc_lakehouse.settings import exports_dir

    tables = load_table_configs(tables_dir()).tables
    return load_export_configs(exports_dir(), tables, load_derived_configs(derived_dir(), tables).derived).exports


def _export_line(ecfg) -> str:
    """What an online reader sees: the alias's version and its key count."""
    from cdc_lakehouse.orchestration.tasks import store_uri_from_connection
    from cdc_lakehouse.serving.stores import open_store

    st = ecfg.store
    store = open_store(
        st.kind, store_uri_from_connection(st.kind, st.conn_id), buckets=st.buckets, table_prefix=st.table_prefix
    )
    try:
        alias, metas = store.alias(st.namespace), store.resolve(st.namespace)
        if not metas or alias is None:
            return f"export {ecfg.name}: no complete version yet"
        count = store.count(st.namespace, metas[0].version)
        return (
            f"export {ecfg.name}: {st.kind} namespace {st.namespace} version {alias.current} "
            f"(previous {alias.previous}), {count} keys, source snapshot {metas[0].snapshot}"
        )
    finally:
        store.close()


def _tree_lines(cat, dcfg: TreeConfig) -> list[str]:
    """Resolved and unresolved counts of a derived tree, and three of its deepest nodes with grants."""
    from collections import Counter

    import pyarrow.compute as pc

    # Columnar until the three examples: the whole tree as Python objects would be hundreds of MB.
    t = cat.load_table(dcfg.output_table).scan(selected_fields=(SHARD_COL, dcfg.nodes.id, "depth", "path", "grants"))
    rows = t.to_arrow()
    reasons = Counter(
        cat.load_table(dcfg.unresolved_table).scan(selected_fields=("reason",)).to_arrow()["reason"].to_pylist()
    )
    lines = [
        f"derived {dcfg.name}: {rows.num_rows} nodes resolved, max depth {pc.max(rows['depth']).as_py() or 0}; "
        + unresolved_text(reasons)
    ]
    granted = rows.filter(pc.greater(pc.list_value_length(rows["grants"]), 0))
    examples = granted.sort_by([("depth", "descending"), (dcfg.nodes.id, "ascending")]).slice(0, 3)
    return lines + [f"  {_node_line(dcfg, r)}" for r in examples.to_pylist()]


def unresolved_text(reasons: dict[str, int]) -> str:
    """The tree's unresolved nodes by reason (derived.tree; each is retried every run). The demo's
    workload keeps its trees whole, so any count here is worth a look, never noise."""
    if not reasons:
        return "0 unresolved"
    return f"{sum(reasons.values())} unresolved: " + ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))


def _node_line(dcfg: TreeConfig, r: dict[str, Any]) -> str:
    node, path = r[dcfg.nodes.id], r["path"] or []

    def up(g: dict[str, Any]) -> str:  # levels above the node, from the path (root first, parent last)
        on = g["granted_on"]
        return "own" if on == node else f"{len(path) - path.index(on)} up" if on in path else f"on {on}"

    grants = sorted(r["grants"], key=lambda g: (g["granted_on"] != node, str(g["principal"])))
    shown = path if len(path) <= 4 else [*path[:2], "...", *path[-2:]]
    listed = ", ".join(f"{g['principal']}: {g['grant']} ({up(g)})" for g in grants[:3])
    more = f" +{len(grants) - 3} more" if len(grants) > 3 else ""
    return (
        f"{dcfg.nodes.id} {node} ({r[SHARD_COL]}): depth {r['depth']}, "
        f"path {' > '.join(map(str, shown))}, grants {listed}{more}"
    )


SPARK_CONNECTIONS = {
    # The local stack's Spark Connect server (devstack.localstack.local_stack_spark), started by make.
    "connect": lambda: json.dumps(
        {
            "conn_type": "spark_connect",
            "host": "127.0.0.1",
            "port": int(os.environ.get("CDC_LOCAL_SPARK_PORT", "15002")),
        }
    ),
    "submit": lambda: json.dumps({"conn_type": "spark", "host": "local[*]"}),
}


@contextmanager
def spark_jobs_on(mode: str) -> Iterator[None]:
    """`connect` (default): the demo's Spark tasks are clients of the local stack's Spark Connect
    server (started if it is not running); `submit`: a spark-submit per task. Through the Spark
    connection the DAGs' tasks use (spark_default), as a deployment would switch them."""
    from devstack.localstack import local_stack_spark

    if mode == "connect":
        server = local_stack_spark()
        t = time.time()
        if not server.is_running():
            if os.environ.get("CDC_LOCAL_SPARK_START") == "never":  # someone else's server (the suite's)
                raise RuntimeError(f"no Spark Connect server answers at {server.url} (CDC_LOCAL_SPARK_START=never)")
            server.start()
            _say(f"spark connect: started in {time.time() - t:.0f}s at {server.url} (log {server.log})")
    key = "AIRFLOW_CONN_SPARK_DEFAULT"
    before = os.environ.get(key)
    os.environ[key] = SPARK_CONNECTIONS[mode]()
    try:
        yield
    finally:
        os.environ.pop(key, None) if before is None else os.environ.__setitem__(key, before)


def run(args: argparse.Namespace) -> int:
    os.environ["CDC_TASK_RETRIES"] = "0"  # read when the DAGs are parsed: a failure shows at once
    # Unattended: a second `make demo` re-bootstraps tables that hold rows, which would otherwise
    # wait for a person to approve in the UI (orchestration/approvals.py).
    os.environ.setdefault("CDC_APPROVALS", "off")
    # `dags test` of a DAG with a deadline fails in Airflow 3.3.2 (orchestration/alerts/deadlines.py).
    os.environ.setdefault("CDC_DEADLINES", "off")
    with spark_jobs_on(args.spark):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    t0 = time.time()
    wl = prepare(args.blocks)
    lake = LakeSettings.from_env()
    cs = load_table_configs(tables_dir())
    if cs.errors:
        for e in cs.errors:
            print(e, file=sys.stderr)
        return 1
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    hours = [now - timedelta(hours=args.intervals + 1 - i) for i in range(args.intervals)]
    ingest_dags = sorted(
        {
            f"cdc_ingest_group__{c.ingest.group}" if c.ingest.group else f"cdc_ingest__{c.name}"
            for c in cs.tables.values()
        }
    )
    for name in sorted(cs.tables):
        _say(f"bootstrap {name} ... ")
        _say(f"bootstrap {name}: done in {dags_test(f'cdc_bootstrap__{name}'):.0f}s")
    for i, hour in enumerate(hours, 1):
        counts = wl.step(args.changes, pk_changes=1)
        if i == 2:
            wl.add_column("demo_note", "text")
            _say("source: added column block.demo_note in every shard (additive schema change)")
        _say(f"interval {i}/{len(hours)} [{hour:%H:%M}-{hour + timedelta(hours=1):%H:%M}]: workload {dict(counts)}")
        for dag in ingest_dags:
            _say(f"  {dag}: done in {dags_test(dag, hour):.0f}s")
        # The scheduler starts these on the ingests' asset events; `dags test` does not. Run after
        # the first interval (a full build) and the last (incremental), not after each: demo time.
        for name in sorted(_derived()) if i in (1, len(hours)) else []:
            _say(f"  cdc_derived__{name}: done in {dags_test(f'cdc_derived__{name}'):.0f}s")
        for name in sorted(_exports()) if i in (1, len(hours)) else []:  # full, then incremental
            _say(f"  cdc_export__{name}: done in {dags_test(f'cdc_export__{name}'):.0f}s")
    audit_at = hours[-1] + timedelta(minutes=30)
    for name in sorted(cs.tables):
        _say(f"audit {name}: done in {dags_test(f'cdc_audit__{name}', audit_at):.0f}s")
    for name in sorted(cs.tables):
        _say(f"maintenance {name}: done in {dags_test(f'cdc_maintenance__{name}', hours[-1]):.0f}s")
    lines = _lake_summary(lake, wl)
    print("\n" + "=" * 78)
    print(f"CDC lakehouse demo finished in {time.time() - t0:.0f}s")
    print("=" * 78)
    print("\n".join(lines))
    print(f"\nSpark tasks ran on: {'Spark Connect' if args.spark == 'connect' else 'spark-submit per task'}")
    print("\nWhere to look next:")
    print("  make airflow                      Airflow UI at http://localhost:8080 with scheduled runs")
    print(f"  {os.environ.get('AIRFLOW_HOME', '.')}/demo-logs   the task logs of this run")
    print("  lake.cdc_meta.ingest_runs / audit_results / quarantine   per-run figures (Spark SQL or pyiceberg)")
    print(f"  warehouse {lake.warehouse}   landing {lake.landing_uri}")
    return 0 if lines[0].endswith("clean") else 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devstack.demo")
    p.add_argument("cmd", choices=["prepare", "run"])
    p.add_argument("--blocks", type=int, default=25_000, help="blocks per shard in the initial load")
    p.add_argument("--changes", type=int, default=20_000, help="row changes per interval")
    p.add_argument("--intervals", type=int, default=3)
    p.add_argument(
        "--spark",
        choices=["connect", "submit"],
        default="connect",
        help="connect: the Spark tasks run on the local Spark Connect server; submit: a spark-submit per task",
    )
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.blocks)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
