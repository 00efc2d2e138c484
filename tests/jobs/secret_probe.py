"""Test-only Spark job: proves the driver received its secrets by reference and that the Spark UI
does not show them. Prints one `CDC_PROBE {json}` line with digests, never a secret."""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
from urllib.parse import quote

from cdc_lakehouse.lake.tables import props_sql
from cdc_lakehouse.runtime.secrets import load_job_secrets
from cdc_lakehouse.runtime.session import get_spark, release_spark
from cdc_lakehouse.settings import LakeSettings, SourceEndpoint, source_uri

NOTE = "it's a \\ 'quoted' value"


def digest(value: str | None) -> str | None:
    return hashlib.sha256(value.encode()).hexdigest() if value else None


def main(conn_id: str, suffix: str) -> int:
    import psycopg2

    names = load_job_secrets()
    lake = LakeSettings.from_env()
    ep = SourceEndpoint.from_uri(source_uri(conn_id))
    conn = psycopg2.connect(ep.dsn())  # the libpq DSN of a password with spaces, quotes, backslashes
    conn.close()
    spark = get_spark("cdc-secret-probe", lake)
    ns = lake.qualified("secret_probe")
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {ns}")  # through the JDBC catalog, with the password
    table = f"{ns}.t_{suffix}"
    spark.sql(f"CREATE TABLE {table} (id int) USING iceberg {props_sql({'cdc.note': NOTE})}")
    note = {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES {table}").collect()}.get("cdc.note")
    sc = spark.sparkContext
    # No UI in the test session that test_job_server.py serves jobs from: nothing to read there.
    ui = (
        urllib.request.urlopen(f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/environment").read().decode()
        if sc.uiWebUrl
        else '{"sparkProperties": []}'
    )
    props = dict(json.loads(ui)["sparkProperties"])
    secrets = {"catalog": lake.catalog_password, "source": ep.password}
    result = {
        "names": names,
        "catalog_password": digest(lake.catalog_password),
        "source_password": digest(ep.password),
        "note_ok": note == NOTE,
        "ui_leaks": sorted(
            k for k, v in secrets.items() if v and (v in ui or quote(v, safe="") in ui or json.dumps(v)[1:-1] in ui)
        ),
        "ui_password_value": props.get(f"spark.sql.catalog.{lake.catalog_name}.jdbc.password"),
    }
    print("CDC_PROBE " + json.dumps(result), flush=True)
    release_spark(spark)  # stops it, except on the job server (test_job_server.py)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
