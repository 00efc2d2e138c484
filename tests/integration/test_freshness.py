"""Freshness per shard in the lake (cdc_meta.freshness), against a real PostgreSQL, real captures
and real Spark + Iceberg ingests:

- a quiet shard whose only traffic is heartbeats shows a moving last heartbeat (and lake position)
  and a fixed last source commit, also through ingest runs with no events at all;
- a shard of a second endpoint whose capture stopped goes beyond the SLA, and the freshness check
  of the ingest DAG (run_checks, as the check_alerts task calls it) alerts by e-mail naming that
  shard, its endpoint, how stale it is and the fix; the audit's quality check names it too.
"""

from __future__ import annotations

import textwrap
import time
from datetime import UTC, datetime

import pytest
import yaml
from cdc_lakehouse.ingest.ingest_table import ingest_table
from cdc_lakehouse.lake.freshness import latest_freshness
from cdc_lakehouse.lake.snapshots import current_snapshot
from cdc_lakehouse.watermark import Watermark

from tests.conftest import make_config
from tests.integration.conftest import Source
from tests.integration.test_alerts import smtp  # noqa: F401 - the module's SMTP sink fixture


def _touch(s: Source, schema: str, n: int = 3) -> None:
    s.execute(
        f"UPDATE {schema}.block SET content = md5(random()::text) "
        f"WHERE id IN (SELECT id FROM {schema}.block ORDER BY id LIMIT {n})"
    )


def _fresh(spark, lake, cfg):
    spark.sql(f"REFRESH TABLE {lake.qualified(lake.meta_table('freshness'))}")
    return latest_freshness(spark, lake, cfg.name)


def test_quiet_shard_moves_its_heartbeat_not_its_last_source_commit(source, spark, lake):
    s = source
    cfg = s.block
    busy, quiet = (shard for _, _, shard in cfg.shards())
    s.capture()
    s.bootstrap(cfg)
    _touch(s, "s0")
    _touch(s, "s1")
    s.ingest(cfg, s.capture().manifest.run_id, run="f1")
    f1 = _fresh(spark, lake, cfg)
    assert f1[quiet].last_source_commit_ts is not None and f1[quiet].last_source_commit_lsn is not None
    # The run's heartbeat is written after the updates, so it commits later.
    assert f1[quiet].last_source_commit_ts < f1[quiet].last_heartbeat_ts

    _touch(s, "s0")  # from here on s1 only gets the capture's heartbeats
    s.ingest(cfg, s.capture().manifest.run_id, run="f2")
    f2 = _fresh(spark, lake, cfg)
    m3 = s.capture()  # nothing changed anywhere: the ingest's no-event path (only the watermark moves)
    r3 = s.ingest(cfg, m3.manifest.run_id, run="f3")
    assert r3.metrics.events_read == 0
    f3 = _fresh(spark, lake, cfg)

    for a, b in ((f1, f2), (f2, f3)):
        assert a[quiet].last_heartbeat_ts < b[quiet].last_heartbeat_ts
        assert a[quiet].last_heartbeat_lsn < b[quiet].last_heartbeat_lsn
        assert a[quiet].fresh_to < b[quiet].fresh_to and a[quiet].watermark_lsn < b[quiet].watermark_lsn
        assert (b[quiet].last_source_commit_ts, b[quiet].last_source_commit_lsn) == (
            f1[quiet].last_source_commit_ts,
            f1[quiet].last_source_commit_lsn,
        )
        assert a[quiet].lake_snapshot_id != b[quiet].lake_snapshot_id
    assert f2[busy].last_source_commit_lsn > f1[busy].last_source_commit_lsn
    assert f3[busy].last_source_commit_lsn == f2[busy].last_source_commit_lsn  # no change in run 3
    # The heartbeat is the quiet shard's position; the recorded lake commit is the table's current
    # snapshot, and it carries that position.
    hb = m3.manifest.heartbeats["s1"]
    assert f3[quiet].last_heartbeat_lsn == hb.commit_lsn
    assert f3[quiet].fresh_to == datetime.fromisoformat(hb.commit_ts)
    snap = current_snapshot(spark, lake.qualified(cfg.current_table))
    assert f3[quiet].lake_snapshot_id == snap.snapshot_id
    assert f3[quiet].endpoint == s.endpoint and f3[quiet].source_schema == "s1"
    assert 0 <= f3[quiet].freshness_seconds < 600
    hist = spark.table(lake.qualified(lake.meta_table("freshness"))).filter(f"table_name = '{cfg.name}'")
    assert hist.count() == 6  # one row per shard and run: the history stays


def _hex_neighbour(u: str) -> str:
    return format((int(u, 16) + 1) % 16 ** len(u), f"0{len(u)}x")


@pytest.fixture
def two_endpoints(pg, source_uri, spark, lake, unique):
    """Two source databases (endpoints), one shard each."""
    a = Source(pg, spark, lake, unique, schemas=("s0",), blocks=200)
    b = Source(pg, spark, lake, _hex_neighbour(unique), schemas=("s1",), blocks=200)
    yield a, b
    a.close()
    b.close()


SLA_SECONDS = 40


def test_a_shard_beyond_the_sla_alerts_naming_it(two_endpoints, spark, lake, smtp, tmp_path, monkeypatch):  # noqa: F811
    from cdc_lakehouse.audit.quality import shard_ages
    from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
    from cdc_lakehouse.orchestration.alerts import run_checks

    a, b = two_endpoints
    shards = [
        {"conn_id": "cdc_test_source", "database": a.db, "schemas": ["s0"]},
        {"conn_id": "cdc_test_source", "database": b.db, "schemas": ["s1"]},
    ]
    spec = {"source": {"table": "block", "shards": shards}, "alerts": {"freshness_sla": f"{SLA_SECONDS}s"}}
    cfg = make_config(f"fr_{a.db[-8:]}", [], **spec)
    fresh_shard, stale_shard = (shard for _, _, shard in cfg.shards())
    a.capture()
    b.capture()
    bootstrap_table(spark, lake, cfg, run_id="b1", all_endpoint_tables={a.endpoint: a.tables(), b.endpoint: b.tables()})
    _touch(a, "s0")
    _touch(b, "s1")
    a.capture()
    b.capture()
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="run_1")
    # b's capture stops (its source is down, say); a's goes on. Wait past the SLA, then ingest.
    time.sleep(SLA_SECONDS + 5)
    a.capture()
    ingest_table(spark, lake, cfg, upto_run=None, ingest_run="run_2")
    f = _fresh(spark, lake, cfg)
    assert f[stale_shard].freshness_seconds > SLA_SECONDS > f[fresh_shard].freshness_seconds
    assert f[stale_shard].endpoint == b.endpoint

    _alerting(
        tmp_path, monkeypatch, {"name": cfg.name, "primary_key": ["id"], "lake": {"namespace": "t"}, **spec}, smtp[1]
    )
    assert run_checks("freshness", [cfg.name], "run_1", lake=lake)[cfg.name] == "no alert"
    assert run_checks("freshness", [cfg.name], "run_2", lake=lake)[cfg.name] == "freshness firing"
    (mail,) = smtp[0].take(1)
    assert mail["subject"].startswith(f"[CDC STALE] {cfg.name} shard {stale_shard} is ")
    body = mail["body"]
    assert f"shard {stale_shard}: " in body and f"on endpoint {b.endpoint} (schema s1)" in body
    assert f"shard {fresh_shard}:" not in body  # the fresh shard is not named as stale
    assert f"capture__{b.endpoint} runs and succeeds" in body and f"capture__{a.endpoint}" not in body
    assert f"({SLA_SECONDS} s, alerts.freshness_sla)" in body

    # The audit's freshness check reads the same table: per shard, the stale one beyond its SLA.
    ages = shard_ages(spark, lake, cfg, Watermark.from_dict({}), datetime.now(UTC))
    assert ages[stale_shard] * 60 > SLA_SECONDS > 0 and ages[fresh_shard] * 60 < ages[stale_shard] * 60
    # The demo's summary reads it with pyiceberg: a line per shard.
    from pyiceberg.catalog import load_catalog

    from devstack.demo import _freshness_lines

    cat = load_catalog(lake.catalog_name, **lake.pyiceberg_properties())
    lines = [ln for ln in _freshness_lines(cat, lake) if ln.startswith(f"freshness {cfg.name} ")]
    assert len(lines) == 2, lines
    (stale_line,) = [ln for ln in lines if f" {stale_shard}: " in ln]
    assert int(stale_line.split(": ")[1].split("s behind")[0]) > SLA_SECONDS and "last heartbeat" in stale_line


def _alerting(tmp_path, monkeypatch, table: dict, smtp_port: int) -> None:
    """The table config and an SMTP channel where run_checks (the check_alerts task) reads them."""
    import json

    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / f"{table['name']}.yaml").write_text(yaml.safe_dump(table))
    alerting = tmp_path / "alerting.yaml"
    alerting.write_text(
        textwrap.dedent("""
        channels:
          - {name: oncall, type: smtp, to: [oncall@test.local], smtp_conn_id: smtp_default,
             from_email: cdc@test.local}
    """)
    )
    monkeypatch.setenv("CDC_TABLES_DIR", str(tables))
    monkeypatch.setenv("CDC_ALERTING_FILE", str(alerting))
    monkeypatch.setenv(
        "AIRFLOW_CONN_SMTP_DEFAULT",
        json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": smtp_port,
                "extra": {"disable_tls": True, "disable_ssl": True, "timeout": 10, "retry_limit": 0},
            }
        ),
    )
