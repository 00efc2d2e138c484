"""A CDC job on a Spark standalone cluster, submitted by the project's operator, on the S3 lake.

The production shape for real: the Airflow task resolves the lake, AWS and source connections,
spark-submit sends the job to a standalone master (client deploy mode; executors in the
worker's JVM, code shipped with --py-files), the job reads landing Parquet from S3 and merges
into Iceberg tables on S3. The spark-submit command and the task log hold no secret.
"""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
import yaml
from cdc_lakehouse.lake.meta import ensure_meta_tables
from cdc_lakehouse.landing.stores import open_landing
from cdc_lakehouse.runtime.session import attach_lake

from devstack.localstack import LocalSparkCluster
from tests.helpers import assert_lake_equals_source, lake_connection_json
from tests.integration.conftest import S3_KEY_ID, S3_SECRET, Source

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalSparkCluster(tmp_path_factory.mktemp("spark-cluster"), cores=1, memory="1536m")
    c.start()
    yield c
    c.stop()


def _table_yaml(directory, s: Source) -> str:
    cfg = s.block
    shard = cfg.source.shards[0]
    data = {
        "name": cfg.name,
        "primary_key": ["id"],
        "lake": {"namespace": "t"},
        "source": {
            "table": "block",
            "shards": [{"conn_id": shard.conn_id, "database": shard.database, "schemas": list(shard.schemas)}],
        },
    }
    (directory / f"{cfg.name}.yaml").write_text(yaml.safe_dump(data))
    return str(directory)


def test_ingest_job_on_a_standalone_cluster_with_the_s3_lake(
    pg, source_uri, spark, lake_s3, cluster, unique, tmp_path, monkeypatch, caplog
):
    from cdc_lakehouse.orchestration.operators import CdcSparkSubmitOperator

    attach_lake(spark, lake_s3)
    ensure_meta_tables(spark, lake_s3)
    s = Source(pg, spark, lake_s3, unique, schemas=("s0",), blocks=300)
    try:
        s.store = open_landing(lake_s3.landing_uri, lake_s3.landing_conn_id)
        s.capture()
        s.bootstrap(s.block)
        s.wl.step(200, pk_changes=1)
        run = s.capture().manifest.run_id

        # The connections a deployment has: the lake (S3 warehouse and landing, keys in the AWS
        # connection), the cluster, the source.
        monkeypatch.setenv("AIRFLOW_CONN_CDC_LAKE", lake_connection_json(pg, lake_s3))
        host, port = cluster.master_url.rsplit(":", 1)
        monkeypatch.setenv(
            "AIRFLOW_CONN_SPARK_TEST_CLUSTER",
            json.dumps({"conn_type": "spark", "host": host, "port": int(port), "extra": {"deploy-mode": "client"}}),
        )
        monkeypatch.setenv("CDC_SPARK_DRIVER_MEMORY", "1g")
        op = CdcSparkSubmitOperator(
            task_id="ingest",
            job="ingest",
            conn_id="spark_test_cluster",
            source_conn_ids=["cdc_test_source"],
            job_args=[
                "--tables",
                s.block.name,
                "--config-dir",
                _table_yaml(tmp_path, s),
                "--upto-run",
                run,
                "--ingest-run",
                "on-cluster",
            ],
            executor_memory="1g",
            executor_cores=1,
            total_executor_cores=1,
        )
        with caplog.at_level(logging.INFO):
            op.execute({})

        assert_lake_equals_source(spark, lake_s3, s.block, s.dsn)
        # It ran on the cluster, not in a local JVM.
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.ui_port}/json/", timeout=10) as resp:
            apps = json.load(resp)["completedapps"]
        assert any(a["name"].startswith("cdc-ingest") for a in apps), apps
        # No key on the command line or in the task log.
        argv = op._get_hook()._build_spark_submit_command(op.application)
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for secret in (S3_SECRET, S3_KEY_ID):
            assert not any(secret in a for a in argv), argv
            assert secret not in logged
    finally:
        s.close()
