"""Secrets never on a command line, in a log or in a file left behind, on every master type.

The operator builds its spark-submit command through the provider's real SparkSubmitHook
(connections from AIRFLOW_CONN_* variables); only the final Popen is replaced by a stand-in
that records the command, the process environment and what the job would read at that
moment. Then: no marker in any argument, --conf value, log event or console line, no file
left in the secrets directory, and the job side gets every secret back."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from urllib.parse import quote, quote_plus

import psycopg2.extensions
import pytest
import structlog
from airflow.providers.apache.spark.hooks import spark_submit as ss
from cdc_lakehouse import cli
from cdc_lakehouse.lake.tables import props_sql, sql_string
from cdc_lakehouse.runtime import secrets as job_secrets
from cdc_lakehouse.runtime.secrets import SecretsTransportError, load_job_secrets
from cdc_lakehouse.secrecy import is_secret_name
from cdc_lakehouse.settings import LakeSettings, SourceEndpoint, libpq_dsn, source_uri

SRC_MARKER = "M4rker-'pw \"x\\y z"
LAKE_MARKER = "L4ke-s3cret 'q\" \\w"
PROP_MARKER = "Pr0p-t0ken-value-123"
AWS_MARKER = "Aws-S3cret-key-456"
# A catalog property named innocently, marked secret in the lake connection's extra: secret by origin.
TENANT_KEY, TENANT_MARKER = "header.X-Tenant", "T3nant-r0ute 'v\" 321"
# Named like a credential but given as a plain catalog property: secret by the name rule.
APIKEY_KEY, APIKEY_MARKER = "header.X-Api-Key", "Ap1-key-value-654"
MARKERS = (SRC_MARKER, LAKE_MARKER, PROP_MARKER, TENANT_MARKER, APIKEY_MARKER)
SRC_CONN = "cdc_secret_src"

MASTERS = {
    "local": {"conn_type": "spark", "host": "local[2]"},
    "standalone-client": {
        "conn_type": "spark",
        "host": "spark://sparkhost",
        "port": 7077,
        "extra": {"deploy-mode": "client"},
    },
    "yarn-client": {"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "client"}},
    "yarn-cluster": {"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "cluster"}},
    "k8s-client": {
        "conn_type": "spark",
        "host": "k8s://https://k8shost",
        "port": 6443,
        "extra": {"deploy-mode": "client", "namespace": "cdc"},
    },
    "k8s-cluster": {
        "conn_type": "spark",
        "host": "k8s://https://k8shost",
        "port": 6443,
        "extra": {"deploy-mode": "cluster", "namespace": "cdc", "cdc_k8s_secret": "cdc-job-secrets"},
    },
}


def forms(secret: str) -> list[str]:
    """The secret as it could appear: raw, URL-encoded, JSON-escaped."""
    return sorted({secret, quote(secret, safe=""), quote_plus(secret), json.dumps(secret)[1:-1]})


def leaks(text: str) -> list[str]:
    return [f for m in MARKERS for f in forms(m) if f in text]


@pytest.fixture
def env(monkeypatch, tmp_path):
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    monkeypatch.setenv("CDC_SECRETS_DIR", str(secrets_dir))
    for k in (
        "CDC_CATALOG_PASSWORD",
        "CDC_SECRETS_FILE",
        "CDC_K8S_SECRET_NAME",
        "CDC_LAKE_SETTINGS",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(
        "AIRFLOW_CONN_CDC_LAKE",
        json.dumps(
            {
                "conn_type": "generic",
                "host": "127.0.0.1",
                "port": 5432,
                "schema": "lake_catalog",
                "login": "postgres",
                "password": LAKE_MARKER,
                "extra": {
                    "catalog_type": "jdbc",
                    "warehouse": f"file://{tmp_path}/wh",
                    "landing_uri": f"file://{tmp_path}/l",
                    "catalog_properties": {"token": PROP_MARKER, APIKEY_KEY: APIKEY_MARKER, "cache-enabled": "false"},
                    "secret_catalog_properties": {TENANT_KEY: TENANT_MARKER},
                },
            }
        ),
    )
    monkeypatch.setenv(
        f"AIRFLOW_CONN_{SRC_CONN.upper()}",
        json.dumps(
            {
                "conn_type": "postgres",
                "host": "srchost",
                "port": 5433,
                "schema": "notion",
                "login": "cdc",
                "password": SRC_MARKER,
            }
        ),
    )
    monkeypatch.setattr(
        ss, "kube_client", object(), raising=False
    )  # the hook insists on the kubernetes provider for k8s://
    return secrets_dir


class Run:
    """What one operator run produced."""

    def __init__(self) -> None:
        self.cmd: list[str] = []
        self.popen_env: dict[str, str] = {}
        self.process_env: dict[str, str] = {}
        self.file_mode: int | None = None
        self.dir_mode: int | None = None
        self.job_env: dict[str, str] = {}
        self.logs: list[str] = []


def run_operator(monkeypatch, master: str, tmp_path: Path, **op_kw) -> Run:
    from cdc_lakehouse.orchestration.operators import CdcSparkSubmitOperator

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_SECRETS_TEST", json.dumps(MASTERS[master]))
    run = Run()

    def fake_submit(self, application: str = "", **kwargs):
        run.cmd = self._build_spark_submit_command(application)
        run.popen_env = dict(self._env or {})
        run.process_env = {k: v for k, v in os.environ.items() if k.startswith("CDC_")}
        conf = dict(
            a.split("=", 1) for a in run.cmd[run.cmd.index("--master") :] if "=" in a and a.startswith("spark.")
        )
        # The driver's environment, as Spark would build it for this master.
        if master == "yarn-cluster":
            drv = {
                k.removeprefix("spark.yarn.appMasterEnv."): v
                for k, v in conf.items()
                if k.startswith("spark.yarn.appMasterEnv.")
            }
            local, alias = run.cmd[run.cmd.index("--files") + 1].split("#")
            container = tmp_path / "container"  # YARN localizes the file under its alias
            container.mkdir()
            (container / alias).write_bytes(Path(local).read_bytes())
            drv["CDC_SECRETS_FILE"] = str(container / drv["CDC_SECRETS_FILE"])
        elif master == "k8s-cluster":
            drv = {
                k.removeprefix("spark.kubernetes.driverEnv."): v
                for k, v in conf.items()
                if k.startswith("spark.kubernetes.driverEnv.")
            }
            return  # the mounted secret is checked in test_k8s_cluster_mounts_a_kubernetes_secret
        elif master == "k8s-client":
            drv = dict(os.environ)  # the driver is the spark-submit process: it inherits this environment
        else:
            drv = {**os.environ, **run.popen_env}
        path = Path(drv["CDC_SECRETS_FILE"])
        if master != "yarn-cluster":
            run.file_mode = stat.S_IMODE(path.stat().st_mode)
            run.dir_mode = stat.S_IMODE(path.parent.stat().st_mode)
        # Without Airflow's own connection variables: the secrets must come from the file.
        job_env = {k: v for k, v in drv.items() if not k.startswith("AIRFLOW_CONN_")}
        load_job_secrets(job_env)
        run.job_env = job_env

    monkeypatch.setattr(ss.SparkSubmitHook, "submit", fake_submit)
    op = CdcSparkSubmitOperator(
        task_id="t",
        job="ingest",
        job_args=["--tables", "block"],
        source_conn_ids=[SRC_CONN],
        conn_id="spark_secrets_test",
        **op_kw,
    )
    with structlog.testing.capture_logs() as events:
        op.execute({})
    run.logs = [repr(e) for e in events]
    return run


def check_no_leak(run: Run, capfd, secrets_dir: Path) -> None:
    assert run.cmd, "no command was built"
    for arg in run.cmd:
        assert not leaks(arg), f"secret in argument {arg!r}"
    for k, v in run.popen_env.items():
        assert not leaks(v), f"secret in the env_vars {k} (a --conf on YARN/Kubernetes)"
    for line in run.logs:
        assert not leaks(line), f"secret in a log event: {line}"
    out, err = capfd.readouterr()
    assert not leaks(out + err), "secret on the console"
    assert list(secrets_dir.iterdir()) == [], "the secrets file outlived the run"
    assert any("Spark-Submit cmd" in line for line in run.logs), "the hook's log was not captured"


def check_job_side(job_env: dict[str, str]) -> None:
    lake = LakeSettings.from_env(job_env)
    assert lake.catalog_password == LAKE_MARKER
    assert lake.catalog_properties == {"cache-enabled": "false"}
    assert lake.secret_catalog_properties == {
        "token": PROP_MARKER,
        APIKEY_KEY: APIKEY_MARKER,
        TENANT_KEY: TENANT_MARKER,
    }
    ep = SourceEndpoint.from_uri(source_uri(SRC_CONN, job_env))
    assert (ep.password, ep.user, ep.host, ep.port, ep.database) == (SRC_MARKER, "cdc", "srchost", 5433, "notion")


OL_MARKER = "0L-api-k3y-789"


def _forget_openlineage_conf() -> None:
    """The provider caches each [openlineage] setting on first read (functools.cache), so a test
    that read them earlier in this process would hide the environment set here."""
    from airflow.providers.openlineage import conf as ol_conf

    for value in vars(ol_conf).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


@pytest.mark.parametrize("master", sorted(MASTERS))
def test_openlineage_transport_injection_carries_no_credential(master, env, monkeypatch, tmp_path, capfd):
    """`[openlineage] spark_inject_transport_info` on, with an HTTP transport that has an API key
    and an Authorization header: the provider's injection ran after the operator's secret check
    and put the key on spark-submit's command line and in the task log (#51). The operator now
    injects it before the check, without the credentials; the transport's address still goes."""
    from airflow.providers.openlineage.plugins.listener import get_openlineage_listener

    transport = {"type": "http", "url": "http://olhost:5000", "auth": {"type": "api_key", "apiKey": OL_MARKER},
                 "custom_headers": {"Authorization": f"Bearer {OL_MARKER}", "X-Team": "data"}}  # fmt: skip
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__TRANSPORT", json.dumps(transport))
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__SPARK_INJECT_TRANSPORT_INFO", "true")
    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__DISABLED", "false")
    adapter = get_openlineage_listener().adapter
    monkeypatch.setattr(adapter, "_client", None)  # a client made by another test has another transport
    _forget_openlineage_conf()
    try:
        # The operator's default for this flag is read when the provider's module is first
        # imported (a default argument), in the full suite long before this test: pass it.
        run = run_operator(monkeypatch, master, tmp_path, openlineage_inject_transport_info=True)
    finally:
        _forget_openlineage_conf()  # the next test reads its own settings, not these
    check_no_leak(run, capfd, env)
    everything = [*run.cmd, *run.popen_env.values(), *run.logs]
    assert not [t for t in everything if OL_MARKER in t], "the OpenLineage API key reached the command or the log"
    assert "spark.openlineage.transport.url=http://olhost:5000" in run.cmd
    assert "spark.openlineage.transport.headers.X-Team=data" in run.cmd
    assert any("not passed to the Spark job" in line and "auth.apiKey" in line for line in run.logs)


@pytest.mark.parametrize("master", ["local", "standalone-client", "yarn-client", "yarn-cluster", "k8s-client"])
def test_secrets_travel_by_reference(master, env, monkeypatch, tmp_path, capfd):
    run = run_operator(monkeypatch, master, tmp_path)
    check_no_leak(run, capfd, env)
    check_job_side(run.job_env)
    if master == "yarn-cluster":
        files = run.cmd[run.cmd.index("--files") + 1]
        assert files.endswith("#cdc-secrets.json")
        assert "spark.yarn.appMasterEnv.CDC_SECRETS_FILE=cdc-secrets.json" in run.cmd
    else:
        assert (run.file_mode, run.dir_mode) == (0o600, 0o700)
        assert "--files" not in run.cmd
    if master == "k8s-client":  # exported to the operator's process for the run only
        assert "CDC_SECRETS_FILE" in run.process_env
        assert "CDC_SECRETS_FILE" not in os.environ
    # Public settings still reach the job; secret-looking catalog properties do not travel with them.
    public = json.loads(run.job_env["CDC_LAKE_SETTINGS"])
    assert public["catalog_properties"] == {"cache-enabled": "false"}


def test_k8s_cluster_mounts_a_kubernetes_secret(env, monkeypatch, tmp_path, capfd):
    run = run_operator(monkeypatch, "k8s-cluster", tmp_path)
    check_no_leak(run, capfd, env)
    assert "spark.kubernetes.driver.secrets.cdc-job-secrets=/etc/cdc-secrets" in run.cmd
    assert "spark.kubernetes.driverEnv.CDC_SECRETS_FILE=/etc/cdc-secrets/cdc-secrets.json" in run.cmd
    # The secret's content, as the documented command writes it; the driver reads it at the mount.
    mount = tmp_path / "mount"
    mount.mkdir()
    out = mount / "cdc-secrets.json"
    assert cli.main(["secrets", "write", "--out", str(out), "--conn", SRC_CONN]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    printed, _ = capfd.readouterr()
    assert not leaks(printed) and "CDC_CATALOG_PASSWORD" in printed
    job_env = {
        "CDC_SECRETS_FILE": str(out),
        "CDC_LAKE_SETTINGS": run.cmd[
            run.cmd.index(next(a for a in run.cmd if a.startswith("spark.kubernetes.driverEnv.CDC_LAKE_SETTINGS=")))
        ].split("=", 1)[1],
    }
    load_job_secrets(job_env)
    check_job_side(job_env)


def test_k8s_cluster_without_a_secret_name_is_refused(env, monkeypatch, tmp_path):
    conn = {**MASTERS["k8s-cluster"], "extra": {"deploy-mode": "cluster"}}
    monkeypatch.setitem(MASTERS, "k8s-cluster", conn)
    with pytest.raises(SecretsTransportError, match="Kubernetes secret"):
        run_operator(monkeypatch, "k8s-cluster", tmp_path)
    assert list(env.iterdir()) == []


def test_standalone_cluster_is_refused_before_any_file(env, monkeypatch, tmp_path, capfd):
    monkeypatch.setitem(
        MASTERS,
        "standalone-cluster",
        {"conn_type": "spark", "host": "spark://sparkhost", "port": 7077, "extra": {"deploy-mode": "cluster"}},
    )
    with pytest.raises(SecretsTransportError, match="deploy mode client"):
        run_operator(monkeypatch, "standalone-cluster", tmp_path)
    assert list(env.iterdir()) == []
    out, err = capfd.readouterr()
    assert not leaks(out + err)


def test_the_file_is_removed_when_the_run_fails(env, monkeypatch, tmp_path):
    def failing(self, application="", **kw):
        self._build_spark_submit_command(application)
        raise RuntimeError("spark-submit failed")

    from cdc_lakehouse.orchestration.operators import CdcSparkSubmitOperator

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_SECRETS_TEST", json.dumps(MASTERS["local"]))
    monkeypatch.setattr(ss.SparkSubmitHook, "submit", failing)
    op = CdcSparkSubmitOperator(
        task_id="t", job="ingest", job_args=[], source_conn_ids=[SRC_CONN], conn_id="spark_secrets_test"
    )
    with pytest.raises(RuntimeError):
        op.execute({})
    assert list(env.iterdir()) == []


@pytest.mark.parametrize("marker", [LAKE_MARKER, PROP_MARKER, TENANT_MARKER, quote(SRC_MARKER, safe="")])
def test_a_secret_in_the_operators_own_arguments_is_refused(marker, env, monkeypatch, tmp_path):
    # The secret catalog properties travel as one JSON variable: each value inside is checked.
    with pytest.raises(ValueError, match="would appear in the spark-submit command"):
        run_operator(monkeypatch, "local", tmp_path, conf={"spark.x": marker})
    assert list(env.iterdir()) == []


@pytest.mark.parametrize(
    "kw",
    [
        {"conf": {"spark.hadoop.fs.s3a.secret.key": "not-a-connection-value"}},
        {"conf": {"spark.sql.catalog.lake.header.X-Api-Key": "not-a-connection-value"}},
        {"env_vars": {"VENDOR_API_TOKEN": "not-a-connection-value"}},
    ],
)
def test_a_setting_named_like_a_credential_is_refused(kw, env, monkeypatch, tmp_path):
    """The name rule as the operator's safety net: a credential given in the task's own
    settings would be on spark-submit's command line, whatever connection it came from."""
    with pytest.raises(ValueError, match="named like credentials"):
        run_operator(monkeypatch, "yarn-cluster", tmp_path, **kw)
    assert list(env.iterdir()) == []


def test_an_error_that_echoes_a_secret_value_is_redacted_in_the_alert(env, monkeypatch, tmp_path):
    """A task resolved the lake connection; then an error quotes the marked property's value
    where no key names it (a REST catalog's 403, say): the alert file and text show neither."""
    from cdc_lakehouse.orchestration.alerts import on_task_failure
    from cdc_lakehouse.orchestration.tasks import lake_settings

    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    lake_settings()
    exc = RuntimeError(f"catalog answered 403 for route {TENANT_MARKER} (sent {quote(TENANT_MARKER, safe='')})")
    on_task_failure({"exception": exc, "run_id": "r", "dag": type("D", (), {"dag_id": "cdc_ingest__block"})()})
    alert = (tmp_path / "cdc_alerts.jsonl").read_text()
    assert "catalog answered 403" in alert and not leaks(alert), alert


def test_aws_keys_are_secrets(monkeypatch):
    from cdc_lakehouse.settings import S3Credentials

    lake = LakeSettings(
        warehouse="s3://b/w",
        landing_uri="s3://b/l",
        catalog_type="rest",
        catalog_uri="http://cat",
        s3_credentials=S3Credentials("AKIA1234", AWS_MARKER, "tok-789"),
        catalog_properties={"s3.secret-access-key": AWS_MARKER, "header.Authorization": "Bearer x1"},
    )
    public = lake.public_env()["CDC_LAKE_SETTINGS"]
    assert AWS_MARKER not in public and "AKIA1234" not in public and "Bearer" not in public
    assert AWS_MARKER not in repr(lake)
    back = LakeSettings.from_env({**lake.public_env(), **lake.secret_env()})
    assert back == lake


def test_load_job_secrets_overrides_stale_values_and_needs_the_file(tmp_path):
    path = job_secrets.write_secrets_file({"CDC_CATALOG_PASSWORD": "new"}, tmp_path)
    env = {"CDC_SECRETS_FILE": str(path), "CDC_CATALOG_PASSWORD": "stale"}
    assert load_job_secrets(env) == ["CDC_CATALOG_PASSWORD"]
    assert env["CDC_CATALOG_PASSWORD"] == "new" and path.exists()
    assert load_job_secrets({}) == []
    with pytest.raises(FileNotFoundError, match="Kubernetes secret"):
        load_job_secrets({"CDC_SECRETS_FILE": str(tmp_path / "missing.json")})


@pytest.mark.parametrize(
    "key,secret",
    [
        ("s3.secret-access-key", True),
        ("s3.access-key-id", True),
        ("s3.session-token", True),
        ("token", True),
        ("credential", True),
        ("header.Authorization", True),
        ("rest.password", True),
        ("header.X-Api-Key", True),
        ("custom.session-id", True),
        ("spark.hadoop.fs.s3a.secret.key", True),
        ("warehouse", False),
        ("spark.sql.session.timeZone", False),  # no session id
        ("fs.s3a.aws.credentials.provider", False),  # a class name, not a credential
        (TENANT_KEY, False),  # secret only because the user marked it (its origin)
        ("s3.endpoint", False),
        ("cache-enabled", False),
        ("client.region", False),
    ],
)
def test_credential_like_catalog_properties(key, secret):
    assert is_secret_name(key) is secret


def test_libpq_dsn_quotes_every_value():
    pw = "a b'c\\d \"e= f"
    dsn = libpq_dsn(host="h", port=5432, dbname="my db", user="o'neil", password=pw)
    assert psycopg2.extensions.parse_dsn(dsn) == {
        "host": "h",
        "port": "5432",
        "dbname": "my db",
        "user": "o'neil",
        "password": pw,
    }
    ep = SourceEndpoint("h", 5432, "db", "u", pw)
    assert psycopg2.extensions.parse_dsn(ep.dsn())["password"] == pw
    lake = LakeSettings(catalog_uri="postgresql://cat@h:5433/lake", warehouse="w", landing_uri="l", catalog_password=pw)
    assert psycopg2.extensions.parse_dsn(lake.catalog_dsn())["password"] == pw
    assert "password" not in psycopg2.extensions.parse_dsn(SourceEndpoint("h", 1, "d", "u").dsn())


def test_table_property_values_are_escaped():
    assert sql_string("it's a \\ test") == "'it\\'s a \\\\ test'"
    assert props_sql({"k": "v'"}) == "TBLPROPERTIES ('k'='v\\'')"


@pytest.mark.parametrize("master", ["local", "yarn-cluster", "k8s-cluster"])
def test_a_failed_run_leaves_no_secret_in_the_alert_file(master, env, monkeypatch, tmp_path):
    from airflow.providers.common.compat.sdk import AirflowException
    from cdc_lakehouse.orchestration.alerts import on_task_failure
    from cdc_lakehouse.orchestration.operators import CdcSparkSubmitOperator

    def failing(self, application="", **kw):  # what the hook raises when spark-submit exits non-zero
        cmd = self._build_spark_submit_command(application)
        raise AirflowException(f"Cannot execute: {self._mask_cmd(cmd)}. Error code is: 1.")

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_SECRETS_TEST", json.dumps(MASTERS[master]))
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    monkeypatch.setattr(ss.SparkSubmitHook, "submit", failing)
    op = CdcSparkSubmitOperator(
        task_id="ingest", job="ingest", job_args=[], source_conn_ids=[SRC_CONN], conn_id="spark_secrets_test"
    )
    with pytest.raises(AirflowException) as err:
        op.execute({})
    assert not leaks(str(err.value))  # the error text every alert channel receives
    on_task_failure({"exception": err.value, "run_id": "r", "dag": type("D", (), {"dag_id": "cdc_ingest__block"})()})
    alert = (tmp_path / "cdc_alerts.jsonl").read_text()
    assert "Cannot execute" in alert and not leaks(alert)
    assert list(env.iterdir()) == []
