"""Airflow's real web UI in headless Chromium: the demo's DAGs are listed, nothing failed to
import, a DAG's docs (its doc_md) render, and the asset graph leads from a source table's ingest
to its serving export (a screenshot kept in .local/test-artifacts).

Debian's chromium runs headless with background networking disabled (the machine has no
outside network); playwright only drives it, no browser download.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from devstack.localstack import free_port

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = ROOT / ".local" / "test-artifacts"
ARTIFACTS.mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory):
    """A fresh AIRFLOW_HOME on SQLite with this repository's DAGs, migrated and parsed."""
    home = tmp_path_factory.mktemp("airflow-ui")
    port = free_port()
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
        "CDC_TABLES_DIR": str(ROOT / "include" / "tables"),
        "PYTHONPATH": str(ROOT / "plugins"),
    }
    airflow = str(Path(sys.executable).with_name("airflow"))
    for cmd in (["db", "migrate"], ["dags", "reserialize"]):
        r = subprocess.run([airflow, *cmd], env=env, capture_output=True, text=True, timeout=600, check=False)
        assert r.returncode == 0, f"airflow {' '.join(cmd)}: {r.stderr[-3000:]}"
    return env, home, port, airflow


def test_cli_lists_the_dags_and_no_import_errors(airflow_env):
    import json

    env, _, _, airflow = airflow_env
    r = subprocess.run(
        [airflow, "dags", "list", "-o", "json"], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    listing = next(line for line in r.stdout.splitlines() if line.startswith("[{"))
    ids = {d["dag_id"] for d in json.loads(listing)}
    assert {
        "cdc_ingest__block",
        "cdc_bootstrap__block",
        "cdc_audit__block",
        "cdc_maintenance__block",
        "cdc_ingest_group__notion_small",
        "cdc_bootstrap__space",
    } <= ids, ids
    assert any(i.startswith("cdc_recover__") for i in ids), ids  # one per source endpoint
    r = subprocess.run(
        [airflow, "dags", "list-import-errors", "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cdc_config_check" not in r.stdout and "Error" not in r.stdout, r.stdout


@pytest.fixture(scope="module")
def airflow_ui(airflow_env):
    env, home, port, airflow = airflow_env
    log = open(home / "api-server.log", "w")
    proc = subprocess.Popen(
        [airflow, "api-server", "--port", str(port), "--host", "127.0.0.1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail("the api-server did not start:\n" + (home / "api-server.log").read_text()[-3000:])
        time.sleep(1)
    yield url
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def page(airflow_ui):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--disable-background-networking", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
        )
        pg = browser.new_page()
        pg.set_default_timeout(60_000)
        yield pg
        browser.close()


def test_dag_list_shows_the_demo_dags_without_import_errors(airflow_ui, page):
    page.goto(f"{airflow_ui}/dags")
    for dag_id in (
        "cdc_ingest__block",
        "cdc_bootstrap__block",
        "cdc_audit__space",
        "cdc_maintenance__permission",
        "cdc_ingest_group__notion_small",
    ):
        page.get_by_text(dag_id, exact=True).first.wait_for()
    # The UI's own source for its import-error banner.
    errors = page.request.get(f"{airflow_ui}/api/v2/importErrors").json()
    assert errors["total_entries"] == 0, errors


def test_a_dag_docs_render(airflow_ui, page):
    page.goto(f"{airflow_ui}/dags/cdc_ingest__block")
    try:
        # The book icon in the Dag's header (the sidebar's "Docs" is Airflow's own documentation menu).
        page.get_by_role("button", name=re.compile(r"dag doc", re.I)).first.click()
        # doc_md is rendered as markdown: its headings become heading elements.
        page.get_by_role("heading", name="What it does").first.wait_for()
        page.get_by_role("heading", name="How to operate it").first.wait_for()
    except Exception as exc:
        page.screenshot(path=str(ARTIFACTS / "docs-failure.png"))
        labels = page.eval_on_selector_all("button", "bs => bs.map(b => b.getAttribute('aria-label') || b.innerText)")
        raise AssertionError(
            f"docs did not render: {exc}\nbuttons: {labels}\npage text:\n{page.inner_text('body')[:2000]}"
        ) from exc


def test_the_asset_graph_leads_from_a_source_table_to_its_serving_export(airflow_ui, page):
    """#53, as a person sees it: the lake table of the derived block tree in Airflow's asset view,
    whose graph runs from the block table's ingest through lake.notion.block and
    cdc_derived__block_tree to it, and on to cdc_export__block_tree_serving. A screenshot is kept
    in .local/test-artifacts/asset-graph.png."""
    assets = page.request.get(f"{airflow_ui}/api/v2/assets?name_pattern=block_tree&limit=50").json()["assets"]
    tree = next(a for a in assets if a["name"].startswith("lake.") and a["name"].endswith("block_tree"))
    page.set_viewport_size({"width": 1600, "height": 1000})
    page.goto(f"{airflow_ui}/assets/{tree['id']}")
    try:
        for name in (
            "cdc_ingest__block",  # the source table's ingest ...
            "lake.notion.block",  # ... writes its lake table, which the derived tree reads
            "cdc_derived__block_tree",
            tree["name"],
            "cdc_export__block_tree_serving",
        ):
            page.get_by_text(name).first.wait_for()
    finally:
        page.screenshot(path=str(ARTIFACTS / "asset-graph.png"), full_page=True)
