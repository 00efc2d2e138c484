"""Session fixtures: one throwaway PostgreSQL (wal_level=logical), one SparkSession (UTC), one
lake (Iceberg JDBC catalog in that PostgreSQL, warehouse and landing in a temp dir).

Everything real; nothing mocked. The cluster, the catalog and the lake are private to the
test session and removed at its end.

Under pytest-xdist (`make test` runs two workers, one test file each at a time) every worker has
its own PostgreSQL, lake, Redis and S3 server, all cheap to start, and the workers share the one
Spark Connect server the controller starts before them (pytest_sessionstart below): a second
server would cost a second JVM start and a second cold JIT. Their sessions on it are apart
(their own catalogs, settings and artifacts), as any two clients' are.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Where the controller's shared Spark Connect server is (JSON: workdir, port, ui_port), for the
# workers it spawns after setting it.
SHARED_SPARK_ENV = "CDC_TESTS_SHARED_SPARK"
_SHARED_SPARK = pytest.StashKey[object]()


# The run's seed for tests parametrized by random seeds. Every xdist worker must collect the same
# tests: the controller draws it (pytest_configure) and the workers inherit it. Set it to replay.
SEED_ENV = "CDC_TEST_SEED"


def pytest_configure(config):
    os.environ.setdefault(SEED_ENV, str(random.randrange(10**6)))


def pytest_report_header(config):
    from devstack.localstack import PG_VERSION_ENV, find_bindir

    return [
        f"{SEED_ENV}={os.environ[SEED_ENV]} (set it to replay this run's seeded tests)",
        f"PostgreSQL: {find_bindir()} ({PG_VERSION_ENV}={os.environ.get(PG_VERSION_ENV) or 'unset: the newest Debian one'})",
    ]


def session_seeds(n: int) -> list[int]:
    """n seeds drawn from the run's seed (CDC_TEST_SEED): new ones every run, the same in every worker."""
    rng = random.Random(int(os.environ[SEED_ENV]))
    return [rng.randrange(10**6) for _ in range(n)]


def pytest_sessionstart(session):
    """The xdist controller starts the session's Spark Connect server before its workers exist
    (xdist starts them in its own, last, pytest_sessionstart); they inherit where it is."""
    config = session.config
    workers = config.getoption("numprocesses", None)
    if hasattr(config, "workerinput") or not workers or config.getoption("dist", "no") == "no":
        return
    if config.getoption("collectonly", False):
        return
    from devstack.localstack import LocalSparkConnect

    workdir = Path(tempfile.mkdtemp(prefix="cdc-tests-spark-"))
    server = LocalSparkConnect(workdir / "spark-connect", memory="4g")
    server.start()
    config.stash[_SHARED_SPARK] = server
    os.environ[SHARED_SPARK_ENV] = json.dumps(
        {"workdir": str(server.workdir), "port": server.port, "ui_port": server.ui_port}
    )


def pytest_sessionfinish(session):
    server = session.config.stash.get(_SHARED_SPARK, None)
    if server is not None:
        server.stop()
        shutil.rmtree(server.workdir.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def tmp_root():
    d = Path(tempfile.mkdtemp(prefix="cdc-tests-"))
    os.chmod(d, 0o755)  # the postgres OS user must reach the data dir below it
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def pg(tmp_root):
    from devstack.localstack import PG_VERSION_ENV, LocalPostgres, free_port

    server = LocalPostgres(tmp_root / "pg", free_port(), fast=True)
    server.start()
    # A run meant for another server version must not pass on the default one (`make test`
    # runs the core tests again with CDC_PG_VERSION=18).
    want = os.environ.get(PG_VERSION_ENV)
    got = int(server.execute("SHOW server_version_num")[0][0]) // 10000
    assert not want or got == int(want), f"{PG_VERSION_ENV}={want}, but the test server is PostgreSQL {got}"
    for db in ("lake_catalog", "src"):
        server.ensure_database(db)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def source_uri(pg):
    """The test source as an Airflow connection in the environment (what tasks and jobs read)."""
    uri = pg.uri("src")
    os.environ["AIRFLOW_CONN_CDC_TEST_SOURCE"] = uri
    return uri


@pytest.fixture(scope="session")
def lake(pg, tmp_root):
    from cdc_lakehouse.settings import LakeSettings

    settings = LakeSettings(
        catalog_type="jdbc",
        catalog_uri=f"postgresql://postgres@127.0.0.1:{pg.port}/lake_catalog",
        warehouse=f"file://{tmp_root / 'warehouse'}",
        landing_uri=f"file://{tmp_root / 'landing'}",
    )
    for k, v in {
        "CDC_CATALOG_URI": settings.catalog_uri,
        "CDC_WAREHOUSE": settings.warehouse,
        "CDC_LANDING_URI": settings.landing_uri,
        "CDC_CATALOG_TYPE": "jdbc",
    }.items():
        os.environ[k] = v
    os.environ.pop("CDC_LAKE_SETTINGS", None)
    return settings


@pytest.fixture(scope="session")
def s3_server(tmp_root):
    """A local S3-compatible server (moto, server mode) for the session; started on first use."""
    from devstack.localstack import LocalS3, free_port

    server = LocalS3(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_gateway(tmp_root):
    """A real S3-compatible server (Versity's S3 gateway over a folder) for the session; it checks
    signatures against its one key pair."""
    from devstack.localstack import LocalS3Gateway, free_port

    server = LocalS3Gateway(tmp_root / "s3-gateway", free_port(), "CDCGATEWAYKEY", "gateway-secret/for+test")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_root):
    """A private redis-server for the session (the serving export's local default store)."""
    from devstack.localstack import LocalRedis, free_port

    server = LocalRedis(tmp_root / "redis", free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def spark_server(tmp_root):
    """The session's Spark Connect server: the one JVM every test's Spark work runs in, started
    the way the local stack starts its own (devstack.localstack.LocalSparkConnect)."""
    from cdc_lakehouse.runtime.connect_auth import TOKEN_FILE_ENV

    from devstack.localstack import LocalSparkConnect

    shared = json.loads(os.environ.get(SHARED_SPARK_ENV) or "null")
    if shared:  # an xdist worker: the controller's server, started and stopped by it
        server = LocalSparkConnect(Path(shared["workdir"]), shared["port"], ui_port=shared["ui_port"])
    else:
        server = LocalSparkConnect(tmp_root / "spark-connect", memory="3g")
        server.start()
    # Whatever the tests start that reaches for Spark (a job run in-process, a DAG's task, the
    # CLI) goes to this server, not to the local stack's.
    os.environ["CDC_SPARK_REMOTE"] = server.url
    os.environ[TOKEN_FILE_ENV] = str(server.token_file)  # its clients send its token (runtime.connect_auth)
    os.environ["AIRFLOW_CONN_SPARK_DEFAULT"] = json.dumps(
        {"conn_type": "spark_connect", "host": "127.0.0.1", "port": server.port}
    )
    yield server
    from cdc_lakehouse.runtime.session import release_all

    release_all()  # every session of the suite (and of the jobs it ran in-process) first
    if not shared:
        server.stop()


@pytest.fixture(scope="session")
def spark(lake, spark_server):
    from cdc_lakehouse.lake.meta import ensure_meta_tables

    from tests.helpers import suite_spark_session

    session = suite_spark_session(lake, spark_server.url)
    ensure_meta_tables(session, lake)
    yield session
    session.stop()


@pytest.fixture
def unique():
    """A short unique suffix for schema and table names, so tests never share state."""
    return uuid.uuid4().hex[:8]


def make_config(name: str, schemas: list[str], *, table: str = "block", key=("id",), **overrides):
    from cdc_lakehouse.config import parse_table_config

    data = {
        "name": name,
        "source": {"table": table, "shards": [{"conn_id": "cdc_test_source", "schemas": schemas}]},
        "primary_key": list(key),
        "lake": {"namespace": "t"},
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    cfg, errors = parse_table_config(data, f"{name}.yaml")
    assert not errors, errors
    return cfg
