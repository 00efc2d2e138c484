"""The DAGs that the YAML-driven DAG files of dags/ define for given config directories: each file
run as a module, as Airflow's DagBag runs it, without a DagBag (light enough for unit tests)."""

from __future__ import annotations

import os
import runpy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DAGS = ROOT / "dags"
# One file per DAG kind, generated from include/*/ YAML. Left out: the feed consumers' files (each
# names its own table) and cdc_config_check.py (it raises on a broken config).
GENERATED = (
    "cdc_ingest",
    "cdc_bootstrap",
    "cdc_replay",
    "cdc_maintenance",
    "cdc_audit",
    "cdc_derived",
    "cdc_export",
    "cdc_history",
)


@contextmanager
def _env(**values: str | None) -> Iterator[None]:
    """os.environ with `values` set (None: left as it is), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dags_of(tables: str | Path, derived: str | Path | None = None, exports: str | Path | None = None) -> dict[str, Any]:
    """dag_id -> DAG of every generated DAG file, reading the table configs in `tables` and the
    derived and export configs in `derived` and `exports` (default: where settings.derived_dir and
    settings.exports_dir say, by default the `derived/` and `exports/` directories beside `tables`)."""
    from airflow.sdk import DAG

    dags: dict[str, Any] = {}
    with _env(
        CDC_TABLES_DIR=str(tables),
        CDC_DERIVED_DIR=str(derived) if derived else None,
        CDC_EXPORTS_DIR=str(exports) if exports else None,
    ):
        for name in GENERATED:
            module = runpy.run_path(str(DAGS / f"{name}.py"), run_name=f"dag_file_{name}")
            dags.update((v.dag_id, v) for v in module.values() if isinstance(v, DAG))
    return dags


def tables_keeping_a_history(into: Path, table: str = "block") -> Path:
    """The repository's table configs copied into `into`, `table` with `history: {enabled: true}`
    (the demo's keep none, so they make no cdc_history DAG)."""
    for f in (ROOT / "include" / "tables").glob("*.yaml"):
        (into / f.name).write_text(f.read_text())
    with (into / f"{table}.yaml").open("a") as f:
        f.write("\nhistory:\n  enabled: true\n")
    return into
