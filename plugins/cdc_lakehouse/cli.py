"""Operator commands.

python -m cdc_lakehouse.cli validate              check every table, derived and export config (exit 1 on errors)
python -m cdc_lakehouse.cli pools                 the Airflow pools, as JSON for `airflow pools import`
python -m cdc_lakehouse.cli quarantine list T     quarantined events of table T
python -m cdc_lakehouse.cli quarantine clear T    delete T's quarantined events after review
python -m cdc_lakehouse.cli quarantine replay T   re-validate T's quarantined events after a fix; apply those that pass
python -m cdc_lakehouse.cli holds list            consumer holds on every lake table (or --table ns.t): what expiry keeps
python -m cdc_lakehouse.cli holds drop --consumer KIND:NAME   drop a retired consumer's holds (feed|derived|export)
python -m cdc_lakehouse.cli secrets write --out FILE [--conn ID ...]   the jobs' secrets, for a Kubernetes secret
"""

from __future__ import annotations

import argparse
import json
import sys

from cdc_lakehouse.config import load_table_configs
from cdc_lakehouse.settings import tables_dir


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cdc_lakehouse.cli")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("validate")
    sub.add_parser("pools")
    q = sub.add_parser("quarantine")
    q.add_argument("action", choices=["list", "clear", "replay"])
    q.add_argument("table")
    q.add_argument("--limit", type=int, default=50)
    h = sub.add_parser("holds")
    h.add_argument("action", choices=["list", "drop"])
    h.add_argument("--table", action="append", help="namespace.table (repeatable); default: every lake table")
    h.add_argument("--consumer", help="drop: <kind>:<name>, e.g. feed:block_counts")
    s = sub.add_parser("secrets")
    s.add_argument("action", choices=["write"])
    s.add_argument("--out", required=True, help="file to create (must not exist)")
    s.add_argument("--conn", action="append", default=None, help="source connection id (default: all configured)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    commands = {
        "validate": validate,
        "pools": print_pools,
        "holds": holds_command,
        "secrets": lambda a: write_secrets(a.out, a.conn),
        "quarantine": quarantine_command,
    }
    return commands[args.cmd](args)


def validate(_args) -> int:
    from cdc_lakehouse.derived.config import load_derived_configs
    from cdc_lakehouse.serving.config import load_export_configs
    from cdc_lakehouse.settings import derived_dir, exports_dir

    cs = load_table_configs(tables_dir())
    ds = load_derived_configs(derived_dir(), cs.tables)
    es = load_export_configs(exports_dir(), cs.tables, ds.derived)
    for e in cs.errors + ds.errors + es.errors:
        print(e, file=sys.stderr)
    print(f"{len(cs.tables)} valid table config(s): {', '.join(sorted(cs.tables))}")
    print(f"{len(ds.derived)} valid derived table config(s): {', '.join(sorted(ds.derived))}")
    print(f"{len(es.exports)} valid export config(s): {', '.join(sorted(es.exports))}")
    return 1 if cs.errors or ds.errors or es.errors else 0


def print_pools(_args) -> int:
    from cdc_lakehouse.orchestration.dag_parts import pools

    print(json.dumps(pools(), indent=2, sort_keys=True))
    return 0


def quarantine_command(args) -> int:
    from cdc_lakehouse.identifiers import check_lake_ident
    from cdc_lakehouse.lake.meta import ensure_meta_tables
    from cdc_lakehouse.runtime.secrets import load_job_secrets
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    table = check_lake_ident(args.table, "table")
    cfg = replay_config(table) if args.action == "replay" else None
    if args.action == "replay" and cfg is None:
        return 1
    load_job_secrets()
    lake = LakeSettings.from_env()
    spark = get_spark("cdc-quarantine", lake, master="local[1]")
    ensure_meta_tables(spark, lake)
    q_table = lake.qualified(lake.meta_table("quarantine"))
    if cfg is not None:
        return replay(spark, lake, cfg)
    if args.action == "list":
        spark.sql(
            f"SELECT shard, reason, commit_lsn, seq, landing_run, quarantined_at FROM {q_table} "
            f"WHERE table_name = '{table}' ORDER BY quarantined_at DESC LIMIT {int(args.limit)}"
        ).show(truncate=False)
    else:
        n = spark.sql(f"SELECT count(*) FROM {q_table} WHERE table_name = '{table}'").collect()[0][0]
        spark.sql(f"DELETE FROM {q_table} WHERE table_name = '{table}'")
        print(f"cleared {n} quarantined event(s) of {table}")
    return 0


def holds_command(args) -> int:
    """holds list | drop: one JSON line per hold (listed, or dropped). lake.holds says what they are."""
    from cdc_lakehouse.lake.holds import consumer_holds, drop_consumer, lake_tables
    from cdc_lakehouse.runtime.secrets import load_job_secrets
    from cdc_lakehouse.runtime.session import get_spark
    from cdc_lakehouse.settings import LakeSettings

    if args.action == "drop" and not args.consumer:
        print("holds drop needs --consumer <kind>:<name> (see holds list)", file=sys.stderr)
        return 1
    load_job_secrets()
    lake = LakeSettings.from_env()
    spark = get_spark("cdc-holds", lake, master="local[1]")
    tables = [lake.qualified(t) for t in args.table or []] or lake_tables(spark, lake.catalog_name)
    if args.action == "list":
        found = [h for t in tables for h in consumer_holds(spark, t)]
    else:
        found = drop_consumer(spark, tables, args.consumer)
    for h in found:
        print(json.dumps({**h.as_dict(), "dropped": args.action == "drop"}, sort_keys=True))
    return 0


def replay(spark, lake, cfg) -> int:
    """quarantine replay T: prints what the replay did (ingest.replay.ReplayResult) as JSON."""
    from datetime import UTC, datetime

    from cdc_lakehouse.ingest.replay import replay_quarantine

    run = "replay-" + datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    print(json.dumps(replay_quarantine(spark, lake, cfg, replay_run=run).to_dict(), indent=2))
    return 0


def replay_config(table: str):
    """The table's config as it is now (a replay validates against it: the fix may be in it)."""
    cs = load_table_configs(tables_dir())
    cfg = cs.tables.get(table)
    if cfg is None:
        errors = [str(e) for e in cs.errors]
        print(
            f"no valid table config named {table!r} in {tables_dir()}; the replay validates against the table's "
            "current config, so fix it first (python -m cdc_lakehouse.cli validate)"
            + "".join(f"\n{e}" for e in errors),
            file=sys.stderr,
        )
    return cfg


def write_secrets(out: str, conns: list[str] | None) -> int:
    """`secrets write`: the secrets every configured job needs (lake connection, AWS keys, every
    source connection of the table configs and every export's store, or the `conns` ones) to
    `out`, mode 0600, for `kubectl create secret generic NAME --from-file=cdc-secrets.json=FILE`
    (runtime.secrets: the Kubernetes transport). Prints names only."""
    import os

    from cdc_lakehouse.orchestration.dag_parts import load_configs
    from cdc_lakehouse.orchestration.tasks import spark_job_env

    cs, _, es = load_configs(None, None)
    stores = sorted({(e.store.kind, e.store.conn_id) for e in es.exports.values()})
    _, secrets = spark_job_env(
        conns or sorted({s.conn_id for t in cs.tables.values() for s in t.source.shards}), [] if conns else stores
    )
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(secrets, f)
    print(f"wrote {len(secrets)} secret(s) to {out} (mode 0600): {', '.join(sorted(secrets))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
