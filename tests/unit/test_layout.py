"""The package's shape is a contract: the tree follows the data path, imports point down one order
of layers, the Spark side never imports the Airflow side, the shipped package never imports the
development stack (devstack/), the benchmarks or the tests, nothing Airflow-only is shipped to
executors, and functions stay short."""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest
from cdc_lakehouse.runtime.packaging import NOT_SHIPPED, PACKAGE_DIR, pyfiles_zip

MODULES = sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)
# The development stack: beside the package at the repository root, never shipped.
DEVSTACK_DIR = PACKAGE_DIR.parents[1] / "devstack"
DEVSTACK_MODULES = sorted(p for p in DEVSTACK_DIR.rglob("*.py") if "__pycache__" not in p.parts)
# Top-level packages of the repository that the shipped package must never import, at any level.
NOT_IMPORTED = ("devstack", "bench", "tests")
# Packages whose code runs on the Spark driver or executors (shipped with --py-files).
SPARK_SIDE = (
    "source", "capture", "landing", "ingest", "history", "lake", "bootstrap", "audit", "derived", "runtime", "jobs",
    "columns", "watermark",
)  # fmt: skip
MAX_LINES = 60
# A longer function says why in a comment starting with this, in or just above it.
LONG_MARK = "# Long because"


def _rel(p: Path) -> str:
    return str(p.relative_to(PACKAGE_DIR if p.is_relative_to(PACKAGE_DIR) else PACKAGE_DIR.parents[1]))


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
    assert {"orchestration", "runtime"} <= packages
    for pkg in packages:
        doc = ast.get_docstring(ast.parse((PACKAGE_DIR / pkg / "__init__.py").read_text()))
        assert doc, f"{pkg}/__init__.py needs a docstring saying what stage it holds"


# --- one direction of dependency ------------------------------------------------------------------

# The package's layers, bottom first. An entry is a whole subpackage (a folder) or a top-level
# module, never one module of a folder, so folders layer as straight as modules
# (test_layers_are_whole_folders). A module-level import may go to
# its own entry or down to a lower layer: never up, and never sideways to another entry of its own
# layer (entries of one layer are independent). Module level includes class bodies and `if
# TYPE_CHECKING:` blocks. A new package or module gets the lowest layer above everything it imports.
# Imports inside a function up the layers are listed with a reason in UPWARD_IN_FUNCTIONS (none
# since #54: `secrets write` moved to the CLI, a Debezium table's bootstrap to bootstrap/, the
# pyiceberg catalogs a session registers to runtime/).
LAYERS: list[list[str]] = [
    # vocabulary: names, secret values, the _cdc_* columns, the watermark model (they import none of ours)
    ["identifiers", "secrecy", "columns", "watermark"],
    ["settings"],
    ["runtime"],  # session, secrets, packaging, failpoints, phase clocks: under every stage
    ["config"],
    # what the stages share, upstream first
    ["source"],
    ["landing"],
    ["lake"],
    # the stages, each above the ones it reads
    ["capture"],
    ["bootstrap"],
    ["ingest"],
    ["history"],  # versions of every row, from the changelog the ingest appends
    ["audit"],
    ["derived"],
    ["feed"],
    ["serving"],
    ["views"],  # published by maintenance
    ["maintenance"],  # keeps every table fit, derived trees' and feed outputs' included
    # entry points: the Spark jobs' command lines, Airflow, the CLI (the development stack,
    # devstack/, is outside the package and above all of it)
    ["jobs"],
    ["orchestration"],
    ["cli"],
]
PACKAGE = "cdc_lakehouse"
LAYER_OF = {entry: n for n, layer in enumerate(LAYERS) for entry in layer}


def test_layers_are_whole_folders():
    """A dotted entry (lake.columns, as there was) would put one module of a folder below the rest
    of it, and the folders would import each other; the shared vocabulary sits at the top instead."""
    dotted = [e for e in LAYER_OF if "." in e]
    assert not dotted, f"LAYERS entries inside a folder: {dotted}; move the module up to the package's top"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
    return ".".join((PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)))


MODULE_PATHS = {_module_name(p): p for p in MODULES}


def _entry(module: str) -> str:
    """The LAYERS entry a module belongs to: the longest one its name starts with."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER_OF:
            return ".".join(parts[:n])
    raise LookupError(f"{module} is in no entry of LAYERS")


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The package's modules an import statement imports (`from pkg import mod` imports pkg.mod)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the importer's package, one level up per extra dot
            anchor = importer.split(".")[: None if is_package else -1]
            base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULE_PATHS else base for a in node.names]
    return [n for n in dict.fromkeys(names) if n.startswith(PACKAGE + ".")]


def _module_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import of the package's modules that runs when the module is imported:
    outside functions, including class bodies, `try` and `if` blocks. `if TYPE_CHECKING:` counts: a
    type named in a signature is a dependency the reader follows and the type checker imports."""
    importer, is_package = _module_name(path), path.name == "__init__.py"
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.extend((child.lineno, t) for t in _targets(child, importer, is_package))
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _layer(entry: str) -> str:
    return f"layer {LAYER_OF[entry]} ({entry})"


def _imports_not_down() -> list[str]:
    out = []
    for module, path in MODULE_PATHS.items():
        if module == PACKAGE:
            continue
        src = _entry(module)
        for line, target in _module_level_imports(path):
            dst = _entry(target)
            if dst != src and LAYER_OF[dst] >= LAYER_OF[src]:
                out.append(f"{_rel(path)}:{line} {module} [{_layer(src)}] imports {target} [{_layer(dst)}]")
    return out


def test_module_level_imports_point_down_the_layers():
    bad = _imports_not_down()
    assert not bad, "imports up (or across) the layers of LAYERS:\n" + "\n".join(bad)


def _function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import of the package's modules inside a function."""
    importer, is_package = _module_name(path), path.name == "__init__.py"
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    out.extend((inner.lineno, t) for t in _targets(inner, importer, is_package))
    return sorted(set(out))


# Imports inside functions that go up the layers, each with its reason. A list that only shrinks
# (#54's target is none): a new one moves the code it needs down instead, or says here why not.
UPWARD_IN_FUNCTIONS: dict[tuple[str, str], str] = {}


def test_function_level_imports_up_the_layers_are_listed_with_a_reason():
    found = set()
    for module, path in MODULE_PATHS.items():
        if module == PACKAGE:
            continue
        src = _entry(module)
        for _, target in _function_level_imports(path):
            dst = _entry(target)
            if dst != src and LAYER_OF[dst] > LAYER_OF[src]:
                found.add((module.removeprefix(PACKAGE + "."), target.removeprefix(PACKAGE + ".")))
    new = sorted(found - set(UPWARD_IN_FUNCTIONS))
    gone = sorted(set(UPWARD_IN_FUNCTIONS) - found)
    assert not new, "imports inside functions up the layers, not in UPWARD_IN_FUNCTIONS:\n" + "\n".join(map(str, new))
    assert not gone, f"no longer imported: remove from UPWARD_IN_FUNCTIONS: {gone}"


def test_layers_place_every_package_and_module_once():
    entries = [e for layer in LAYERS for e in layer]
    assert len(entries) == len(set(entries)), (
        f"listed twice in LAYERS: {sorted({e for e in entries if entries.count(e) > 1})}"
    )
    unknown = [e for e in entries if f"{PACKAGE}.{e}" not in MODULE_PATHS]
    assert not unknown, f"LAYERS names {unknown}, which are no module or package of {PACKAGE}"
    top = {m.split(".")[1] for m in MODULE_PATHS if m != PACKAGE}
    assert not sorted(top - set(entries)), (
        f"give {sorted(top - set(entries))} a layer in LAYERS (tests/unit/test_layout.py)"
    )
    # A module placed below its package is imported through the package's __init__: that must
    # import nothing of ours, or the module's low place would hide the __init__'s imports.
    for entry in (e for e in entries if "." in e):
        parts = entry.split(".")
        for n in range(1, len(parts)):
            init = MODULE_PATHS[".".join((PACKAGE, *parts[:n]))]
            assert not _module_level_imports(init), f"{_rel(init)} must import nothing of ours: {entry} sits below it"


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (its nodes, the first repeated at the end), or [] when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if found := visit(nxt):
                return found
        path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        if found := visit(node):
            return found
    return []


def test_module_level_imports_have_no_cycle():
    # Within a package too: a cycle works or breaks by the order modules happen to be imported in.
    graph = {m: {t for _, t in _module_level_imports(p) if t != m} for m, p in MODULE_PATHS.items()}
    cycle = _cycle(graph)
    assert not cycle, "module-level import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "path", [p for p in MODULES if _rel(p).split("/")[0].removesuffix(".py") in SPARK_SIDE], ids=_rel
)
def test_spark_side_does_not_import_airflow(path):
    # Module level only: a driver without Airflow must import every Spark-side module. Functions
    # that run on the Airflow worker (the capture's S3 store, `secrets write`) import the
    # provider lazily, where that path is taken.
    tree = ast.parse(path.read_text())
    top_level = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.If)):
            top_level |= _imports(node)
    bad = sorted(m for m in top_level if m.startswith(("cdc_lakehouse.orchestration", "airflow")))
    assert not bad, f"{_rel(path)} imports {bad}: the Spark side must not need Airflow"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_shipped_package_never_imports_devstack_bench_or_tests(path):
    # Every import, inside functions too: the Airflow image and the --py-files zip carry none of
    # them, so a lazy import would fail only in production.
    bad = sorted(m for m in _imports(ast.parse(path.read_text())) if m.split(".")[0] in NOT_IMPORTED)
    assert not bad, f"{_rel(path)} imports {bad}: the shipped package must not need {', '.join(NOT_IMPORTED)}"


def test_airflow_side_and_devstack_are_not_shipped_to_executors(tmp_path):
    with zipfile.ZipFile(pyfiles_zip(tmp_path)) as zf:
        names = zf.namelist()
    assert "cdc_lakehouse/ingest/ingest_table.py" in names
    assert not [n for n in names if n.split("/")[0] != "cdc_lakehouse" or n.split("/")[1] in NOT_SHIPPED]


def _long_functions() -> list[str]:
    out = []
    for path in MODULES + DEVSTACK_MODULES:  # the development stack is read by newcomers too
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


# --- the project's own formats are typed ----------------------------------------------------------

# `dict[str, Any]` in the package: wire formats (Kafka Connect schemas, OpenLineage, Spark's REST
# API, DynamoDB items, Airflow's context) stay dicts; the project's own formats are models (the
# capture's manifest is built as landing.format.Manifest). A ratchet (#54): lower it when a format
# gets its model, never raise it; the target is 120. 232 occurrences on 2026-11-29 (the
# issue counted 225 lines); 223 once the capture's manifest, its heartbeats, schema changes and
# DDL became models; 155 once the watermark's parts (pending backfill, Debezium state, server
# identity), the Debezium file stats and cut point, the slot report, the relation's columns, the
# chunk and round markers, and maintenance's and the bootstrap's results became typed; 154 with
# the ingest's batch state (ingest.records.BatchState); 148 with the audit's quality checks
# (audit.result.QualityCheck); 145 with rows read back named as such (lake.meta_rows.RawRow);
# 135 with the rows written to the cdc_meta tables as their records (lake.meta_rows.MetaRow); 134
# with the capture run's row (CaptureRun); 117 with the Spark REST API's job typed as read
# (runtime.phases.SparkJobData), observed metrics as int | str | datetime | None (Observed), and
# the backfill's constants as text (ingest.backfill.MissingValues). The bootstrap markers a
# manifest keeps stay dicts (see landing.format.Manifest.bootstrap_markers).
DICT_ANY_CEILING = 117


def test_untyped_dicts_do_not_grow():
    count = sum(p.read_text().count("dict[str, Any]") for p in MODULES)
    assert count <= DICT_ANY_CEILING, (
        f"{count} `dict[str, Any]` in {PACKAGE_DIR.name} (ceiling {DICT_ANY_CEILING}): give the new "
        "format a model (landing.format's parts are the example), or say in a comment why it is a wire format"
    )
    print(f"dict[str, Any]: {count} (ceiling {DICT_ANY_CEILING})")


# --- the newcomer's walk ---------------------------------------------------------------------------

# From a DAG file to the statement that does its work, each file naming the next by an import
# (#54). Two harness files are beside every walk and not on it: orchestration/dag_parts.py
# (spark_task: the operator that runs a job) and jobs/runner.py (run_per_table: one Spark session,
# the job's function per table, its result line). At most six files in all.
WALKS: dict[str, list[tuple[str, str]]] = {
    "ingest": [
        ("dags/cdc_ingest.py", "the graph: per table (or group), a Spark task running IngestParams"),
        ("jobs/ingest.py", "the job: ingest_table for each table of the task"),
        ("ingest/ingest_table.py", "apply_pending's phases; the MERGE phase is commit_merge"),
        ("lake/merge.py", "the MERGE's text (merge_sql) and the statement that runs it (run_merge)"),
    ],
    "audit": [
        ("dags/cdc_audit.py", "the graph: per table, a Spark task running AuditParams"),
        ("jobs/audit.py", "the job: audit_table for each table, a failing verdict fails it"),
        ("audit/audit_table.py", "audit_table's steps; both sides are compared in _compare_with_source"),
        ("audit/compare.py", "the source's hashes read under its snapshot, and the join naming mismatches"),
    ],
}
WALK_ENDS = {"ingest": ("MERGE INTO", "sql_with_commit_properties(spark, merge_sql("), "audit": ("spark.read.jdbc(",)}
HARNESS = ("orchestration/dag_parts.py", "jobs/runner.py")


def _walk_path(rel: str) -> Path:
    return PACKAGE_DIR.parents[1] / rel if rel.startswith("dags/") else PACKAGE_DIR / rel


def _module_of(rel: str) -> str:
    return "cdc_lakehouse." + rel.removesuffix(".py").replace("/", ".")


@pytest.mark.parametrize("name", sorted(WALKS))
def test_the_walk_from_a_dag_file_to_its_statement_is_six_files_at_most(name):
    walk = WALKS[name]
    assert len(walk) + len(HARNESS) <= 6, f"the {name} walk is {len(walk) + len(HARNESS)} files, more than 6"
    assert all((PACKAGE_DIR / h).exists() for h in HARNESS), "a harness file moved: update HARNESS"
    for (here, _), (there, _) in zip(walk, walk[1:], strict=False):
        imported = _imports(ast.parse(_walk_path(here).read_text()))
        assert _module_of(there) in imported, f"{here} does not import {_module_of(there)}: the walk is broken"
    last = _walk_path(walk[-1][0]).read_text()
    for mark in WALK_ENDS[name]:
        assert mark in last, f"the {name} walk ends in {walk[-1][0]}, which no longer holds {mark!r}"
