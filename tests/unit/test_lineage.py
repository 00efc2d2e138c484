"""orchestration.lineage, the pure parts: names of datasets and the facets' shapes (the events
themselves are received from real Airflow in tests/e2e/test_demo_airflow.py)."""

from __future__ import annotations

from cdc_lakehouse.orchestration import lineage
from cdc_lakehouse.settings import LakeSettings
from openlineage.client.serde import Serde


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
