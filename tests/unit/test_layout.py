"""The package's shape is a contract: the tree follows the data path, the Spark side never imports
the Airflow or dev side, nothing dev-only is shipped to executors, and functions stay short."""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest
from cdc_lakehouse.runtime.packaging import NOT_SHIPPED, PACKAGE_DIR, pyfiles_zip

MODULES = sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)
# Packages whose code runs on the Spark driver or executors (shipped with --py-files).
SPARK_SIDE = ("source", "capture", "landing", "ingest", "lake", "bootstrap", "audit", "derived", "runtime")
MAX_LINES = 60
# A longer function says why in a comment starting with this, in or just above it.
LONG_MARK = "# Long because"


def _rel(p: Path) -> str:
    return str(p.relative_to(PACKAGE_DIR))


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_tree_names_the_data_path():
    packages = {p.name for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").exists()}
    assert {"source", "capture", "landing", "ingest", "lake", "bootstrap", "audit"} <= packages
    assert {"orchestration", "runtime", "dev"} <= packages
    for pkg in packages:
        doc = ast.get_docstring(ast.parse((PACKAGE_DIR / pkg / "__init__.py").read_text()))
        assert doc, f"{pkg}/__init__.py needs a docstring saying what stage it holds"


@pytest.mark.parametrize("path", [p for p in MODULES if _rel(p).split("/")[0] in SPARK_SIDE], ids=_rel)
def test_spark_side_does_not_import_airflow_or_dev(path):
    # Module level only: a driver without Airflow must import every Spark-side module. Functions
    # that run on the Airflow worker (the capture's S3 store, `secrets write`) import the
    # provider lazily, where that path is taken.
    tree = ast.parse(path.read_text())
    top_level = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.If)):
            top_level |= _imports(node)
    bad = sorted(m for m in top_level if m.startswith(("cdc_lakehouse.orchestration", "cdc_lakehouse.dev", "airflow")))
    assert not bad, f"{_rel(path)} imports {bad}: the Spark side must not need Airflow or the dev tools"


def test_dev_tools_are_not_shipped_to_executors(tmp_path):
    with zipfile.ZipFile(pyfiles_zip(tmp_path)) as zf:
        names = zf.namelist()
    assert "cdc_lakehouse/ingest/run.py" in names
    assert not [n for n in names if n.split("/")[1] in NOT_SHIPPED]


def _long_functions() -> list[str]:
    out = []
    for path in MODULES:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - start + 1
            around = lines[max(0, start - 3) : node.end_lineno]
            if length > MAX_LINES and not any(LONG_MARK in line for line in around):
                out.append(f"{_rel(path)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_functions_are_short_or_say_why():
    assert _long_functions() == []
