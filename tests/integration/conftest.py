"""Fixtures of the integration tests: a Notion-like source database per test."""

from __future__ import annotations

import psycopg2
import pytest
from cdc_lakehouse import source as src
from cdc_lakehouse.bootstrap import bootstrap_table
from cdc_lakehouse.capture import capture_run
from cdc_lakehouse.ingest import ingest_table
from cdc_lakehouse.landing import LocalLanding
from cdc_lakehouse.workload import NotionWorkload

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
        self.perm = make_config(f"p_{unique}", [], source={"table": "permission", "shards": [shards]},
                                primary_key=["block_id", "user_id"], deletes="soft")
        self.store = LocalLanding(lake.landing_uri)
        self.endpoint = self.block.source.shards[0].endpoint_id
        self.runs = 0

    def tables(self):
        return {"block": (self.schemas, ["id"]), "permission": (self.schemas, ["block_id", "user_id"])}

    def capture(self, run_id=None):
        self.runs += 1
        run_id = run_id or f"20260101T{self.runs:02d}0000Z"
        ep = src.EndpointTables(self.endpoint, "cdc_test_source", self.tables())
        return capture_run(ep, self.dsn, self.store, run_id)

    def bootstrap(self, cfg, **kw):
        return bootstrap_table(self.spark, self.lake, cfg, run_id=f"b{self.runs}",
                               all_endpoint_tables={self.endpoint: self.tables()}, **kw)

    def ingest(self, cfg, upto, run="t"):
        return ingest_table(self.spark, self.lake, cfg, upto_run=upto, ingest_run=run)

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


@pytest.fixture
def source(pg, source_uri, spark, lake, unique):
    s = Source(pg, spark, lake, unique)
    yield s
    s.close()
