"""Test-only Spark job: proves the driver received its secrets by reference and that the Spark UI
does not show them. Prints one `CDC_PROBE {json}` line with digests, never a secret."""

from __future__ import annotations

import hashlib
import html
import json
import sys
import urllib.request
from urllib.parse import quote

from cdc_lakehouse.lake.tables import props_sql
from cdc_lakehouse.runtime.secrets import load_job_secrets
from cdc_lakehouse.runtime.session import get_spark, release_spark
from cdc_lakehouse.settings import LakeSettings, SourceEndpoint, source_uri
from cdc_lakehouse.source.session import jdbc_properties

NOTE = "it's a \\ 'quoted' value"


def digest(value: str | None) -> str | None:
    return hashlib.sha256(value.encode()).hexdigest() if value else None


def ui_pages(spark) -> tuple[str, list[str]]:
    """The Spark UI's environment (the SparkConf, as JSON) and every SQL execution's page, which
    lists the settings set in the running session. The same on Spark Connect as on a classic
    session: the driver's status REST API, found from the session's conf."""
    from cdc_lakehouse.runtime.phases import status_api

    api = status_api(spark)
    if api is None:
        return '{"sparkProperties": []}', []
    ui = api.split("/api/v1/", 1)[0]
    executions = json.loads(urllib.request.urlopen(f"{api}/sql?offset=0&length=1000000").read())
    pages = [page for e in executions if (page := execution_page(api, ui, e["id"])) is not None]
    # What a Spark Connect server shows of each request (its plan's text, a JDBC read's options
    # included): the jobs' and stages' descriptions, and the server's Connect tab.
    for path in ("jobs", "stages?details=true"):
        pages.append(urllib.request.urlopen(f"{api}/{path}").read().decode())
    try:
        pages.append(html.unescape(urllib.request.urlopen(f"{ui}/connect/").read().decode()))
    except OSError:
        pass  # a classic session has no Connect tab
    return urllib.request.urlopen(f"{api}/environment").read().decode(), pages


def execution_page(api: str, ui: str, execution_id: int) -> str | None:
    """One SQL execution's page. The server is shared with the suite's other worker: an execution
    listed a moment ago may be dropped from the UI (retainedExecutions) before its page is read,
    which answers 500 (seen once in CI). Retried; None only when the listing no longer has it."""
    import time
    import urllib.error

    for attempt in range(3):
        try:
            return html.unescape(urllib.request.urlopen(f"{ui}/SQL/execution/?id={execution_id}").read().decode())
        except urllib.error.HTTPError:
            time.sleep(1 + attempt)
    listed = json.loads(urllib.request.urlopen(f"{api}/sql?offset=0&length=1000000").read())
    if any(e["id"] == execution_id for e in listed):
        raise RuntimeError(f"the Spark UI page of SQL execution {execution_id} does not answer")
    return None


def shown(value: str, text: str) -> bool:
    return any(f in text for f in (value, quote(value, safe=""), json.dumps(value)[1:-1]))


def main(conn_id: str, suffix: str, properties: str = "") -> int:
    """`properties`: comma-separated catalog property names whose values are secrets to look for."""
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
    # A JDBC read from the source, as the bootstrap and the audit make: its password is an option.
    jdbc = spark.read.jdbc(ep.jdbc_url(), "(SELECT 1 AS one) q", properties=jdbc_properties(ep, 100)).collect()
    environment, sql_pages = ui_pages(spark)
    ui = "\n".join([environment, *sql_pages])
    props = dict(json.loads(environment)["sparkProperties"])
    # The catalog properties as the session has them (none when they never reached the job).
    values = {k: spark.conf.get(f"spark.sql.catalog.{lake.catalog_name}.{k}", None) for k in properties.split(",") if k}
    secrets = {"catalog": lake.catalog_password, "source": ep.password, **values}
    result = {
        "names": names,
        "catalog_password": digest(lake.catalog_password),
        "source_password": digest(ep.password),
        "properties": {k: digest(v) for k, v in values.items()},
        "note_ok": note == NOTE,
        "jdbc_ok": [tuple(r) for r in jdbc] == [(1,)],
        "sql_pages": len(sql_pages),
        "ui_leaks": sorted(k for k, v in secrets.items() if v and shown(v, ui)),
        "ui_password_value": props.get(f"spark.sql.catalog.{lake.catalog_name}.jdbc.password"),
    }
    print("CDC_PROBE " + json.dumps(result), flush=True)
    release_spark(spark)  # stops it; on Spark Connect, ends this client's session only
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
