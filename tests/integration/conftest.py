"""Fixtures of the integration tests: a Notion-like source database per test."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import psycopg2
import pytest
from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
from cdc_lakehouse.bootstrap.result import BootstrapResult
from cdc_lakehouse.capture.capture_run import CaptureResult, capture_run
from cdc_lakehouse.ingest.ingest_table import IngestResult, ingest_table
from cdc_lakehouse.landing.stores import LocalLanding
from cdc_lakehouse.source.catalog import EndpointTables

from devstack.workload import NotionWorkload
from tests.conftest import make_config


class Source:
    """A Notion-like source in its own database, and the table configs that read it."""

    def __init__(self, pg, spark, lake, unique, schemas=("s0", "s1"), blocks=1500):
        self.pg, self.spark, self.lake = pg, spark, lake
        self.db = f"ing_{unique}"
        pg.execute(f"CREATE DATABASE {self.db}")
        self.dsn = pg.dsn(self.db)
        self.schemas = list(schemas)
        self.wl = NotionWorkload(self.dsn, self.schemas, seed=int(unique, 16) % 1000)
        self.wl.create()
        self.wl.load(blocks_per_shard=blocks)
        shards = {"conn_id": "cdc_test_source", "database": self.db, "schemas": self.schemas}
        self.block = make_config(f"b_{unique}", [], source={"table": "block", "shards": [shards]})
        self.perm = make_config(
            f"p_{unique}",
            [],
            source={"table": "permission", "shards": [shards]},
            primary_key=["block_id", "user_id"],
            deletes="soft",
        )
        self.store = LocalLanding(lake.landing_uri)
        self.endpoint = self.block.source.shards[0].endpoint_id
        self.runs = 0

    def tables(self):
        return {"block": (self.schemas, ["id"]), "permission": (self.schemas, ["block_id", "user_id"])}

    def capture(self, run_id=None) -> CaptureResult:
        self.runs += 1
        run_id = run_id or f"20260101T{self.runs:02d}0000Z"
        ep = EndpointTables(self.endpoint, "cdc_test_source", self.tables())
        return capture_run(ep, self.dsn, self.store, run_id)

    def bootstrap(self, cfg, **kw) -> BootstrapResult:
        return bootstrap_table(
            self.spark, self.lake, cfg, run_id=f"b{self.runs}", all_endpoint_tables={self.endpoint: self.tables()}, **kw
        )

    def ingest(self, cfg, upto, run="t") -> IngestResult:
        return ingest_table(self.spark, self.lake, cfg, upto_run=upto, ingest_run=run)

    def change_and_ingest(self, rounds: int) -> None:
        """Rounds of workload (key changes among them) plus a few deletes, each captured and ingested."""
        for _ in range(rounds):
            self.wl.step(300, pk_changes=2)
            self.execute("DELETE FROM s1.block WHERE id IN (SELECT id FROM s1.block ORDER BY id LIMIT 3)")
            r = self.ingest(self.block, self.capture().manifest.run_id)
            assert r.metrics.events_read > 0 and r.metrics.status == "ok", r

    def execute(self, *sql):
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            for s in sql:
                cur.execute(s)
        conn.close()

    def close(self):
        for (slot,) in self.pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{self.db}'"):
            self.pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
        self.pg.execute(f"DROP DATABASE {self.db} WITH (FORCE)")


class HeldCommit:
    """A transaction whose commit record is in the WAL but which is not visible yet: its COMMIT
    waits for a synchronous standby that does not exist. synchronous_standby_names names one for
    the whole (test) server, but only this session sets synchronous_commit on: the test cluster's
    default is off, so no other session waits. release() lets it finish and restores the server.
    Inside `with`, it is also released as soon as a chunk reader starts waiting for it
    (source.markers.wait_until_visible logs that at DEBUG): a reader that does not wait reads
    while it is held."""

    STANDBY = "cdc_no_such_standby"

    def __init__(self, pg, dsn: str, *statements: str):
        self.pg, self.dsn, self.statements = pg, dsn, statements
        self.thread = threading.Thread(target=self._commit, daemon=True)
        self.error: BaseException | None = None
        self.released = False
        self.pid = self.xid = None

    def _commit(self) -> None:
        try:
            conn = psycopg2.connect(self.dsn)
            self.pid = conn.get_backend_pid()
            with conn.cursor() as cur:  # one transaction: psycopg2 opens it, commit() ends it
                cur.execute("SET synchronous_commit = on")
                for sql in self.statements:
                    cur.execute(sql)
            conn.commit()  # waits here for the standby
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by release()
            self.error = exc

    def __enter__(self) -> HeldCommit:
        self.logger = logging.getLogger("cdc_lakehouse.source.markers")
        self.level, self.handler = self.logger.level, _ReleaseOnWait(self)
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.DEBUG)
        try:
            self._hold()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _hold(self) -> None:
        self.pg.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{self.STANDBY}'")
        self.pg.execute("SELECT pg_reload_conf()")
        self._until_commits_wait()
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = self.pg.execute(
                f"SELECT wait_event, backend_xid::text FROM pg_stat_activity WHERE pid = {self.pid or 0}"
            )
            if rows and rows[0][0] == "SyncRep":
                self.xid = rows[0][1]
                return
            assert self.thread.is_alive(), f"the commit was not held (error: {self.error})"
            time.sleep(0.05)
        raise AssertionError("the commit was not held for the standby within 30s")

    def _until_commits_wait(self) -> None:
        """The checkpointer applies the reload (WalSndCtl->sync_standbys_defined) when it gets to
        it: probe with a one-message commit until one waits for the standby, then cancel that wait
        (the probe then ends committed, as PostgreSQL does on a cancelled wait)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            conn = psycopg2.connect(self.dsn)
            pid = conn.get_backend_pid()

            def commit(conn=conn) -> None:
                with conn.cursor() as cur:
                    # A commit waits for a standby only if its transaction wrote WAL before it.
                    cur.execute(
                        "SET synchronous_commit = on; SELECT pg_logical_emit_message(true, 'cdc_test_probe', '')"
                    )
                conn.commit()

            probe = threading.Thread(target=commit, daemon=True)
            probe.start()
            probe.join(0.5)
            waits = probe.is_alive()
            if waits:
                self.pg.execute(f"SELECT pg_cancel_backend({pid})")
                probe.join(10)
            conn.close()
            if waits:
                return
        raise AssertionError("synchronous_standby_names did not take effect within 30s")

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pg.execute("ALTER SYSTEM RESET synchronous_standby_names")
            self.pg.execute("SELECT pg_reload_conf()")
        if self.thread.ident is None:
            return  # never started: _hold failed first, and its error is the one to see
        self.thread.join(30)
        assert not self.thread.is_alive() and self.error is None, self.error

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.release()


class _ReleaseOnWait(logging.Handler):
    def __init__(self, held: HeldCommit):
        super().__init__(logging.DEBUG)
        self.held = held

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()  # the wait names the xids it waits for
        if "waits for transaction" in message and self.held.xid is not None and f"'{self.held.xid}'" in message:
            self.held.release()


@pytest.fixture
def source(pg, source_uri, spark, lake, unique):
    s = Source(pg, spark, lake, unique)
    yield s
    s.close()


S3_BUCKET, S3_AWS_CONN = "cdc-lake-test", "cdc_test_s3"
S3_KEY_ID, S3_SECRET = "AKIDCDCTEST", "s3-secret/for+test"


@pytest.fixture(scope="session")
def lake_s3(s3_server, pg):
    """A second lake, catalog `lake_s3`, whose warehouse and landing are on the local S3 mock;
    endpoint, region and keys come from an Airflow AWS connection, as in the tasks."""
    return s3_lake(s3_server, pg, "lake_s3", S3_AWS_CONN, S3_KEY_ID, S3_SECRET)


@pytest.fixture(scope="session")
def lake_s3_gateway(s3_gateway, pg):
    """The same on the real S3-compatible server (catalog `lake_s3gw`), with its own keys."""
    return s3_lake(s3_gateway, pg, "lake_s3gw", "cdc_test_s3_gateway", s3_gateway.access_key, s3_gateway.secret_key)


def s3_lake(server, pg, catalog: str, conn_id: str, key_id: str, secret: str):
    from cdc_lakehouse.orchestration.tasks import with_aws_connection
    from cdc_lakehouse.settings import LakeSettings

    server.create_bucket(S3_BUCKET)
    os.environ[f"AIRFLOW_CONN_{conn_id.upper()}"] = json.dumps(
        {
            "conn_type": "aws",
            "login": key_id,
            "password": secret,
            "extra": {"endpoint_url": server.endpoint, "region_name": server.REGION, "s3_path_style": True},
        }
    )
    configured = LakeSettings(
        catalog_type="jdbc",
        catalog_name=catalog,
        catalog_uri=f"postgresql://postgres@127.0.0.1:{pg.port}/lake_catalog",
        warehouse=f"s3://{S3_BUCKET}/warehouse",
        landing_uri=f"s3://{S3_BUCKET}/landing",
        landing_conn_id=conn_id,
    )
    return with_aws_connection(configured)


# The REST catalog's OAuth2 client: the secret reaches Spark and pyiceberg as a secret catalog
# property, as a team's would from the lake connection.
REST_CLIENT_ID, REST_CLIENT_SECRET = "cdc-tests", "rest-client-secret/for+test"


@pytest.fixture(scope="session")
def rest_catalog(pg, tmp_root):
    """Apache Iceberg's REST catalog server, its tables kept in the session's PostgreSQL."""
    from devstack.localstack import LocalRestCatalog

    pg.ensure_database("rest_catalog")
    server = LocalRestCatalog(
        tmp_root / "rest-catalog",
        backend_uri=f"jdbc:postgresql://127.0.0.1:{pg.port}/rest_catalog",
        warehouse=f"file://{tmp_root / 'rest-warehouse'}",
    )
    server.start()
    yield server
    server.stop()


DBZ_PASSWORD_MARKER = "dbz-password/for+test"


@pytest.fixture(scope="session")
def kafka_connect(tmp_root):
    """A Kafka broker and a Kafka Connect worker with Debezium's PostgreSQL connector (Maven jars,
    devstack/debezium-connect.pom.xml). The connectors' database password comes from the worker's
    environment; the session's PostgreSQL trusts loopback, so the value is a marker the test
    looks for in the worker's files."""
    from devstack.localstack import LocalKafkaConnect

    server = LocalKafkaConnect(tmp_root / "kafka-connect", secret_env={"CDC_DBZ_PG_PASSWORD": DBZ_PASSWORD_MARKER})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def trino(rest_catalog, tmp_root):
    """Trino (476, from Maven Central) with one Iceberg catalog, `rest`, on the REST catalog
    server: OAuth2 client credentials exchanged at the server's token endpoint, the secret in
    the server's environment (Trino's ${ENV:...}), never in its catalog file."""
    from devstack.localstack import LocalTrino

    rest = {
        "connector.name": "iceberg",
        "iceberg.catalog.type": "rest",
        "iceberg.rest-catalog.uri": rest_catalog.url,
        "iceberg.rest-catalog.security": "OAUTH2",
        "iceberg.rest-catalog.oauth2.server-uri": f"{rest_catalog.url}/v1/oauth/tokens",
        "iceberg.rest-catalog.oauth2.credential": "${ENV:CDC_TRINO_REST_CREDENTIAL}",
        # The warehouse is file:// on this machine: Trino's own local file system reads it.
        "fs.native-local.enabled": "true",
        "local.location": "/",
    }
    server = LocalTrino(
        tmp_root / "trino",
        {"rest": rest},
        secret_env={"CDC_TRINO_REST_CREDENTIAL": f"{REST_CLIENT_ID}:{REST_CLIENT_SECRET}"},
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def lake_rest(rest_catalog, tmp_root):
    """A third lake, catalog `lake_rest`, on the REST catalog, read from an Airflow connection
    shaped as docs/production.md shows: its client authenticates with OAuth2 client
    credentials, a secret catalog property."""
    from airflow.models.connection import Connection
    from cdc_lakehouse.settings import LakeSettings

    extra = {
        "catalog_type": "rest",
        "catalog_name": "lake_rest",
        "catalog_uri": rest_catalog.url,
        "warehouse": rest_catalog.warehouse,
        "landing_uri": f"file://{tmp_root / 'rest-landing'}",
        "catalog_properties": {"rest.auth.type": "oauth2", "oauth2-server-uri": f"{rest_catalog.url}/v1/oauth/tokens"},
        "secret_catalog_properties": {"credential": f"{REST_CLIENT_ID}:{REST_CLIENT_SECRET}"},
    }
    conn = Connection(conn_id="cdc_lake_rest", conn_type="generic", extra=json.dumps(extra))
    return LakeSettings.from_airflow_connection(conn)
