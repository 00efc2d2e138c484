"""The production storage path for real: landing and warehouse on a real S3-compatible server
(Versity's S3 gateway, which checks every request's signature; devstack.localstack.LocalS3Gateway).

Capture writes landing files through the Amazon provider's S3Hook; Spark reads them through
Hadoop S3A and keeps the Iceberg tables on S3 through S3FileIO; pyiceberg reads the same
tables; the audit and maintenance (orphan cleanup included) run against S3. Credentials and
the endpoint come from an Airflow AWS connection, resolved the way the tasks resolve them.
(moto's S3 mock serves the cluster test and the settings test: cheap to start in-process.)
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from botocore.exceptions import ClientError
from cdc_lakehouse.audit.audit_table import audit_table
from cdc_lakehouse.lake.meta import ensure_meta_tables
from cdc_lakehouse.landing.stores import S3Landing, open_landing
from cdc_lakehouse.maintenance.maintain_table import maintain_table
from cdc_lakehouse.runtime.session import attach_lake
from cdc_lakehouse.settings import LakeSettings

from devstack.localstack import LocalS3Gateway
from tests.helpers import assert_lake_equals_source
from tests.integration.conftest import S3_BUCKET, S3_KEY_ID, S3_SECRET, Source

BUCKET, KEY_ID, SECRET = S3_BUCKET, S3_KEY_ID, S3_SECRET


def _objects(s3_server, prefix: str) -> list[str]:
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def test_settings_come_from_the_aws_connection(lake_s3, s3_server):
    assert lake_s3.s3_endpoint == s3_server.endpoint and lake_s3.s3_region == s3_server.REGION
    assert lake_s3.s3_path_style and lake_s3.s3_credentials.secret_access_key == SECRET
    # The public half that travels in the job's environment holds no key.
    env = lake_s3.to_env()
    assert SECRET not in env["CDC_LAKE_SETTINGS"] and KEY_ID not in env["CDC_LAKE_SETTINGS"]
    assert LakeSettings.from_env(env) == lake_s3
    assert SECRET not in repr(lake_s3)


def test_capture_ingest_audit_maintenance_on_s3(pg, source_uri, spark, lake_s3_gateway, s3_gateway, unique):
    lake_s3, s3_server = lake_s3_gateway, s3_gateway
    # A real server: a wrong secret is refused.
    with pytest.raises(ClientError, match="SignatureDoesNotMatch|InvalidAccessKeyId|AccessDenied"):
        wrong = LocalS3Gateway(s3_server.workdir, s3_server.port, s3_server.access_key, "not-the-secret")
        wrong.client().list_objects_v2(Bucket=BUCKET)
    attach_lake(spark, lake_s3)
    ensure_meta_tables(spark, lake_s3)
    s = Source(pg, spark, lake_s3, unique, schemas=("s0", "s1"), blocks=400)
    try:
        s.store = open_landing(lake_s3.landing_uri, lake_s3.landing_conn_id)
        assert isinstance(s.store, S3Landing)
        s.capture()
        s.bootstrap(s.block)
        s.change_and_ingest(rounds=2)
        assert_lake_equals_source(spark, lake_s3, s.block, s.dsn)

        # Every byte went to the bucket: landing runs and Iceberg files, nothing on local disk.
        landing = _objects(s3_server, f"landing/{s.endpoint}/")
        assert any(k.endswith(".parquet") for k in landing) and any("_manifests/" in k for k in landing), landing[:5]
        ns, name = s.block.current_table.split(".")
        table_prefix = f"warehouse/{ns}/{name}/"
        assert any(k.endswith(".parquet") for k in _objects(s3_server, table_prefix + "data/"))

        # pyiceberg reads the tables Spark wrote, from the same endpoint.
        from pyiceberg.catalog import load_catalog

        catalog = load_catalog(lake_s3.catalog_name, **lake_s3.pyiceberg_properties())
        py_rows = catalog.load_table(s.block.current_table).scan().to_arrow().num_rows
        assert py_rows == spark.table(lake_s3.qualified(s.block.current_table)).count() > 0

        result = audit_table(spark, lake_s3, s.block, audit_run="s3-audit")
        assert result.verdict == "ok", result

        # An orphan in the table's S3 location (a crashed writer's file) is removed by maintenance.
        orphan = table_prefix + "data/orphan-from-a-crashed-writer.parquet"
        s3_server.client().put_object(Bucket=BUCKET, Key=orphan, Body=b"not referenced by any snapshot")
        s3_server.age_object(BUCKET, orphan, timedelta(hours=s.block.maintenance.orphan_file_age_hours + 1))
        m = maintain_table(spark, lake_s3, s.block, run_id="s3-maint")
        assert m.targets["current"].orphan_files_removed >= 1, m
        assert orphan not in _objects(s3_server, table_prefix), m
        assert_lake_equals_source(spark, lake_s3, s.block, s.dsn)
        assert catalog.load_table(s.block.current_table).scan().to_arrow().num_rows == py_rows
    finally:
        s.close()
