"""What is secret (cdc_lakehouse.secrecy): by origin, names only as a safety net; one definition
for the settings, the Spark session's builder, the operator's check and redact()."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
from cdc_lakehouse.orchestration.alerts import redact
from cdc_lakehouse.runtime.session import builder_settings, spark_conf
from cdc_lakehouse.secrecy import Secret, find_secrets, secrets_in_value
from cdc_lakehouse.settings import LakeSettings, S3Credentials

S = "S3cr3t-vAlue"  # the part of each input that must not survive

REDACTED = [
    # Hadoop/Spark settings, as a log line, a --conf and a JVM option show them
    f"fs.s3a.secret.key={S}",
    f"--conf spark.hadoop.fs.s3a.secret.key={S} --conf spark.x=1",
    f"-Dspark.hadoop.fs.s3a.secret.key={S}",
    f"spark.hadoop.fs.s3a.session.token = {S}",
    f"spark.sql.catalog.lake.header.X-Api-Key={S}",
    # HTTP authorization, wherever it is quoted
    f"Authorization: Bearer {S}",
    f"Authorization: Basic {S}==",
    f"curl -H 'Authorization: Bearer {S}' https://catalog",
    f'{{"Authorization": "Bearer {S}"}}',
    f"request failed: 401, sent bearer {S}",
    f"X-Api-Key: {S}",
    # libpq DSNs: spaces and escaped quotes inside the quoted password
    f"host='db' port='5432' password='a b {S} c' dbname='src'",
    f"host='db' password='a\\'b c {S}' dbname='src'",
    f"password='{S} d\\\\' user='x'",
    f"connection failed: host=db user=cdc password={S} dbname=src",
    # URIs with user:password@
    f"could not connect to postgresql://cdc:{S}@db:5432/src",
    f"redis://:{S}@127.0.0.1:6379/0 refused",
    f"postgresql://cdc:p@ss{S}@db/src",
    # JSON and Python reprs, escapes inside the value
    f'{{"password": "a \\"q\\" {S}", "host": "db"}}',
    f"{{'password': 'it\\'s {S}'}}",
    f'"{{\\"password\\": \\"x {S}\\"}}"',
    # environment and config files
    f"PGPASSWORD={S} CDC_CATALOG_PASSWORD='{S}'",
    f"aws_secret_access_key = {S}",
    f"https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F{S}&X-Amz-Signature={S}",
    f"password='{S}",  # truncated text: the quote never closes
]


@pytest.mark.parametrize("text", REDACTED)
def test_redact_removes_secrets(text):
    out = redact(text)
    assert S not in out and "***" in out, out


@pytest.mark.parametrize(
    "text",
    [
        "spark.sql.session.timeZone=UTC",
        "fs.s3a.aws.credentials.provider=org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
        'FATAL: password authentication failed for user "cdc"',
        "Basic checks passed; tokens are rotated daily",
        "postgresql://cdc@db:5432/src",
    ],
)
def test_redact_leaves_public_text(text):
    assert redact(text) == text


def test_redact_hides_a_known_secret_value_whatever_its_key():
    value = "Tn-route 'q\" \\ v/9"
    Secret(value, "catalog property header.X-Tenant")  # seen once in this process: known from now on
    for text in (
        f"REST catalog answered 403 for route {value}",
        f"x-tenant={quote(value, safe='')}",
        json.dumps({"header.X-Tenant": value}),
        repr({"h": value}),
        "password='" + value.replace("\\", "\\\\").replace("'", "\\'") + "'",
    ):
        out = redact(text)
        assert value not in out and "Tn-route" not in out and "***" in out, out


def test_airflow_masks_a_known_secret_in_task_logs():
    from airflow.sdk.log import redact as airflow_redact

    Secret("Mark3d-extra-value-77", "catalog property header.X-Tenant")
    assert "Mark3d-extra-value-77" not in str(airflow_redact("sent Mark3d-extra-value-77"))


def test_a_secret_never_prints():
    s = Secret("Hidden-value-1", "the lake catalog's password")
    assert str(s) == "***" and f"{s}" == "***" and "Hidden" not in repr(s)
    with pytest.raises(TypeError):
        json.dumps({"k": s})
    assert s.reveal() == "Hidden-value-1"


def test_inner_secrets_of_a_secret_variable():
    found = secrets_in_value("dynamodb://AKIA1:Sk-123@h:8000/?region=eu&session_token=Tk-456", "CDC_STORE_URI__X")
    assert {s.value for s in found} >= {"Sk-123", "Tk-456"}
    found = secrets_in_value(json.dumps({"header.X-Tenant": "Tv-789"}), "CDC_CATALOG_SECRET_PROPERTIES")
    assert find_secrets(['{"catalog_properties": {"a": "1", "header.X-Tenant": "Tv-789"}}'], found) == [
        "CDC_CATALOG_SECRET_PROPERTIES [header.X-Tenant]"
    ]


def lake_with_a_marked_property() -> LakeSettings:
    return LakeSettings(
        catalog_uri="postgresql://cat@h:5432/lake",
        warehouse="s3://b/w",
        landing_uri="s3://b/l",
        catalog_password="Cat-pw-value",
        catalog_properties={"cache-enabled": "false", "header.X-Api-Key": "Api-value-1"},
        secret_catalog_properties={"header.X-Tenant": "Tenant-value-1"},
        s3_credentials=S3Credentials("AKIAX", "Aws-secret-1"),
    )


def test_settings_decide_by_origin():
    lake = lake_with_a_marked_property()
    public = lake.public_env()["CDC_LAKE_SETTINGS"]
    for value in ("Tenant-value-1", "Api-value-1", "Cat-pw-value", "Aws-secret-1"):
        assert value not in public and value not in repr(lake)
    assert json.loads(public)["catalog_properties"] == {"cache-enabled": "false"}
    assert "header.X-Tenant" in repr(lake)  # its name is public, its value is not
    assert LakeSettings.from_env({**lake.public_env(), **lake.secret_env()}) == lake


def test_the_session_builder_gets_no_secret():
    lake = lake_with_a_marked_property()
    builder, live = builder_settings(spark_conf(lake))
    assert not [k for k, v in builder.items() if any(x in v for x in ("Tenant-value", "Api-value", "pw-value"))]
    assert {
        "spark.sql.catalog.lake.header.X-Tenant",
        "spark.sql.catalog.lake.header.X-Api-Key",
        "spark.sql.catalog.lake.jdbc.password",
        "spark.sql.catalog.lake.s3.secret-access-key",
        "fs.s3a.secret.key",  # S3A reads it from the session (runtime.session.lake_conf)
    } <= set(live)
    # Spark redacts the innocently named key too (its UI's SQL pages list live-set settings).
    assert "spark\\.sql\\.catalog\\.lake\\.header\\.X\\-Tenant" in builder["spark.redaction.regex"]
    assert builder["spark.sql.catalog.lake.cache-enabled"] == "false"


@pytest.mark.parametrize(
    "settings,error",
    [
        ({"catalog_password": "x"}, "CDC_CATALOG_PASSWORD"),
        ({"secret_catalog_properties": {"a": "b"}}, "CDC_CATALOG_SECRET_PROPERTIES"),
        ({"catalog_properties": {"rest.token": "b"}}, "catalog_properties.rest.token"),
    ],
)
def test_public_settings_with_a_secret_are_refused(settings, error):
    env = {"CDC_LAKE_SETTINGS": json.dumps({"warehouse": "w", "landing_uri": "l", **settings})}
    with pytest.raises(ValueError, match=error):
        LakeSettings.from_env(env)


def test_a_password_in_the_catalog_uri_or_a_property_given_twice_is_refused():
    with pytest.raises(ValueError, match="catalog_uri holds a password"):
        LakeSettings(catalog_uri="postgresql://u:pw@h/db", warehouse="w", landing_uri="l")
    with pytest.raises(ValueError, match="both"):
        LakeSettings(
            warehouse="w", landing_uri="l", catalog_properties={"a": "1"}, secret_catalog_properties={"a": "2"}
        )


def test_a_local_spark_connect_server_inherits_no_secret_of_its_starter(monkeypatch, tmp_path):
    """Its Python UDFs inherit its environment; each session brings its own secrets instead. AWS
    keys too (#51: whoever reached the server read its starter's); a profile name stays. The
    token its clients must send is in its environment, not on its command line or in its file."""
    from cdc_lakehouse.runtime.connect_auth import SERVER_TOKEN_ENV
    from cdc_lakehouse.runtime.session import connect_server_argv

    for k in ("CDC_CATALOG_PASSWORD", "AIRFLOW_CONN_SRC", "CDC_SOURCE_URI__S0", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"):
        monkeypatch.setenv(k, S)
    for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        monkeypatch.setenv(k, S)
    monkeypatch.setenv("AWS_PROFILE", "team")  # the SDK's chain finds the profile's keys in ~/.aws
    monkeypatch.setenv("CDC_LAKE_WAREHOUSE", "file:///w")
    argv, env = connect_server_argv(tmp_path, 1, 2, "1g", token="T0ken-of-the-server", ui=False)
    assert S not in json.dumps(env) and S not in " ".join(argv)
    assert env["AWS_PROFILE"] == "team" and env["CDC_LAKE_WAREHOUSE"] == "file:///w"
    props = tmp_path / "spark-connect.properties"
    assert props.stat().st_mode & 0o077 == 0
    assert env[SERVER_TOKEN_ENV] == "T0ken-of-the-server"
    assert "T0ken-of-the-server" not in " ".join(argv) + props.read_text()
    assert "spark.ui.enabled=false" in props.read_text().splitlines()
