"""orchestration.lineage, the pure parts: names of datasets, the facets' shapes, and what the
derive, export and feed jobs are described by on the demo's configs, over a fake catalog (the
events themselves are received from real Airflow in tests/e2e/test_demo_airflow.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk import BaseHook, Connection
from cdc_lakehouse.jobs.derive import DeriveParams
from cdc_lakehouse.jobs.export import ExportParams
from cdc_lakehouse.jobs.feed import FeedConsumerParams
from cdc_lakehouse.jobs.feed_block_counts import BlockCountsParams
from cdc_lakehouse.orchestration import lineage, tasks
from cdc_lakehouse.settings import LakeSettings
from openlineage.client.serde import Serde
from pyiceberg.exceptions import NoSuchTableError

INCLUDE = Path(__file__).resolve().parents[2] / "include"
LAKE = LakeSettings(landing_uri="file:///data/landing", warehouse="file:///w", catalog_name="lake")


class FakeCatalog:
    """pyiceberg's catalog as lake_table uses it: tables at <warehouse>/<namespace>/<table>; those
    not in `existing` are missing, as a first run's outputs are."""

    def __init__(self, existing: set[str]):
        self.existing = existing

    def load_table(self, name: str):
        if name not in self.existing:
            raise NoSuchTableError(f"Table does not exist: {name}")
        return SimpleNamespace(location=lambda: "s3a://bucket/w/" + name.replace(".", "/"))


def test_lsn_text_is_postgresql_form():
    assert lineage.lsn_text(0x16B3748) == "0/16B3748"
    assert lineage.lsn_text((5 << 32) + 0xA0) == "5/A0"
    assert lineage.lsn_text(None) is None


def test_landing_datasets_follow_openlineage_naming():
    local = LakeSettings(landing_uri="file:///data/landing/", warehouse="file:///w")
    assert lineage.landing(local, "ep1", "block") == lineage.Dataset("file", "/data/landing/ep1/block")
    s3 = LakeSettings(landing_uri="s3://bucket/cdc/landing", warehouse="s3://bucket/w")
    assert lineage.landing(s3, "ep1", "block") == lineage.Dataset("s3://bucket", "cdc/landing/ep1/block")
    s3a = LakeSettings(landing_uri="s3a://bucket", warehouse="s3a://bucket/w")
    assert lineage.landing(s3a, "ep1", "block") == lineage.Dataset("s3://bucket", "ep1/block")


def test_the_audit_verdict_becomes_assertions_per_shard():
    d = lineage.Dataset("file", "/w/notion/block")
    shards = {
        "ep.s1": {"verdict": "fail", "missing": 2},
        "ep.s0": {"verdict": "ok"},
        "ep.s2": {"verdict": "mismatch_pending", "different": 1},  # one sighting: not yet a failure
        "ep.s3": {"verdict": "fail", "repaired": 4},
    }
    with_checks = lineage._with_assertions(d, shards)
    event = Serde.to_dict(with_checks)
    checks = event["inputFacets"]["dataQualityAssertions"]["assertions"]
    assert [(c["name"], c["success"]) for c in checks] == [
        ("audit ep.s0", True),
        ("audit ep.s1", False),
        ("audit ep.s2", True),
        ("audit ep.s3", True),
    ]
    assert checks[1]["actual"] == "missing 2, extra 0, different 0"


def test_run_facets_serialize_with_their_schema():
    facet = lineage.CdcCaptureRunFacet(
        endpoint="ep", captureRun="r1", startLsn="0/10", endLsn="0/20", events=3, reused=False
    )
    out = Serde.to_dict(facet)
    assert out["endLsn"] == "0/20" and out["_schemaURL"].endswith("docs/lineage.md#cdc_capture"), out


def test_a_lake_table_is_named_by_its_location_with_the_catalog_name_as_symlink():
    d = lineage.lake_table(LAKE, "notion.block", FakeCatalog({"notion.block"}))
    assert (d.namespace, d.name) == ("s3://bucket", "w/notion/block")
    [link] = d.facets["symlinks"].identifiers
    assert (link.namespace, link.name, link.type) == ("iceberg://lake", "notion.block", "TABLE")


def test_a_missing_lake_table_is_named_by_the_catalog_identifier():
    d = lineage.lake_table(LAKE, "derived.block_tree", FakeCatalog(set()))
    assert d == lineage.Dataset("iceberg://lake", "derived.block_tree")


def test_redis_store_names_the_server_and_the_key_namespace():
    assert lineage.redis_store("redis.internal", 6379, "0", "block_tree") == lineage.Dataset(
        "redis://redis.internal:6379", "block_tree"
    )
    # Another db of the same server is another dataset.
    assert lineage.redis_store("redis.internal", 6379, "2", "block_tree").name == "2/block_tree"


def test_dynamodb_store_names_the_region_or_the_endpoint_and_the_tables_prefix():
    on_aws = lineage.Dataset("dynamodb://eu-west-1", "prod_block_tree")
    assert lineage.dynamodb_store("eu-west-1", "", "prod_", "block_tree") == on_aws
    assert lineage.dynamodb_store("eu-west-1", "dynamodb.eu-west-1.amazonaws.com", "prod_", "block_tree") == on_aws
    local = lineage.dynamodb_store("us-east-1", "127.0.0.1:8000", "", "block_tree")
    assert local == lineage.Dataset("dynamodb://127.0.0.1:8000", "block_tree")


def test_store_datasets_carry_no_credential(monkeypatch):
    conn = Connection(
        conn_id="cdc_redis", conn_type="redis", host="redis.internal", port=6380, password="s3cret", extra='{"db": 1}'
    )
    monkeypatch.setattr(BaseHook, "get_connection", lambda conn_id: conn)
    store = SimpleNamespace(kind="redis", conn_id="cdc_redis", namespace="block_tree")
    assert lineage.export_store(store) == lineage.Dataset("redis://redis.internal:6380", "1/block_tree")
    # An endpoint URL with user info (a key in it) is named by its host and port only.
    hook = SimpleNamespace(
        conn_region_name="us-east-1",
        conn_config=SimpleNamespace(get_service_endpoint_url=lambda service: "http://AKIA:s3cret@127.0.0.1:8000"),
    )
    monkeypatch.setattr(tasks, "dynamodb_hook", lambda conn_id: hook)
    store = SimpleNamespace(kind="dynamodb", conn_id="cdc_dynamo", namespace="blocks", table_prefix="prod_")
    assert lineage.export_store(store) == lineage.Dataset("dynamodb://127.0.0.1:8000", "prod_blocks")


def test_derive_reads_the_current_tables_of_its_inputs_and_writes_its_two_tables():
    params = DeriveParams(
        derived=("block_tree", "not_configured"),  # a missing config: described as nothing
        config_dir=str(INCLUDE / "tables"),
        derived_dir=str(INCLUDE / "derived"),
    )
    assert lineage._describer("derive", params) is lineage._derive
    catalog = FakeCatalog({"notion.block", "notion.permission", "derived.block_tree"})
    inputs, outputs, facets = lineage._derive(LAKE, catalog, [], params)
    assert [d.name for d in inputs] == ["w/notion/block", "w/notion/permission"]
    assert [(d.namespace, d.name) for d in outputs] == [
        ("s3://bucket", "w/derived/block_tree"),
        ("iceberg://lake", "derived.block_tree__unresolved"),  # not created yet
    ]
    assert facets == {}


def test_export_reads_its_source_and_writes_the_store(tmp_path, monkeypatch):
    (tmp_path / "to_dynamo.yaml").write_text(
        textwrap.dedent(
            """
            name: to_dynamo
            source: {table: block}
            store: {kind: dynamodb, conn_id: cdc_dynamo, namespace: blocks, table_prefix: prod_}
            """
        )
    )
    stores = {"cdc_dynamo": lineage.dynamodb_store("eu-west-1", "", "prod_", "blocks")}
    monkeypatch.setattr(lineage, "export_store", lambda store: stores[store.conn_id])
    dirs = {
        "config_dir": str(INCLUDE / "tables"),
        "derived_dir": str(INCLUDE / "derived"),
        "exports_dir": str(tmp_path),
    }
    params = ExportParams(exports=("to_dynamo", "gone"), **dirs)  # a missing config: described as nothing
    inputs, outputs, _ = lineage._export(LAKE, FakeCatalog({"notion.block"}), [], params)
    assert [d.name for d in inputs] == ["w/notion/block"]
    assert outputs == [lineage.Dataset("dynamodb://eu-west-1", "prod_blocks")]
    rollback = ExportParams(exports=("to_dynamo",), mode="rollback", **dirs)
    assert lineage._export(LAKE, FakeCatalog(set()), [], rollback)[:2] == ([], outputs)  # moves the alias only


@pytest.mark.parametrize(
    "params",
    [
        BlockCountsParams(tables=("block",)),
        FeedConsumerParams(tables=("block",), consumer="c", output="feed.block_counts"),
    ],
)
def test_any_feed_consumer_reads_the_current_table_and_writes_its_output(params):
    from cdc_lakehouse.config import load_table_configs

    describe = lineage._describer("feed_block_counts", params)
    assert describe is lineage._feed
    cfgs = [load_table_configs(INCLUDE / "tables").tables["block"]]
    inputs, outputs, _ = describe(LAKE, FakeCatalog({"notion.block"}), cfgs, params)
    assert [d.name for d in inputs] == ["w/notion/block"]
    assert outputs == [lineage.Dataset("iceberg://lake", "feed.block_counts")]


def test_the_history_job_reads_the_changelog_and_writes_the_history_the_ingest_keeps_too():
    from cdc_lakehouse.config import HistoryConfig, load_table_configs
    from cdc_lakehouse.jobs.history import HistoryParams

    plain = load_table_configs(INCLUDE / "tables").tables["block"]
    kept = plain.model_copy(update={"history": HistoryConfig(enabled=True)})
    params = HistoryParams(tables=("block",), mode="rebuild")
    assert lineage._describer("history", params) is lineage._history
    inputs, outputs, _ = lineage._history(LAKE, FakeCatalog({"notion.block__changelog"}), [kept], params)
    assert [d.name for d in inputs] == ["w/notion/block__changelog"]
    assert [(d.namespace, d.name) for d in outputs] == [("iceberg://lake", "notion.block__history")]  # not created yet
    assert lineage._ingest_outputs(kept)[-1] == "notion.block__history"
    assert "notion.block__history" not in lineage._ingest_outputs(plain)
