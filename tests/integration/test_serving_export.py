"""Serving export against real Redis and a real DynamoDB-compatible server (moto's server mode),
from Iceberg tables written by Spark and by the real capture and ingest.

After every step the store's current version equals the source table key for key and value for
value (decoded with the schema stored next to the data).
"""

from __future__ import annotations

import os
import random
import threading

import pytest
from cdc_lakehouse.serving.config import ExportConfig
from cdc_lakehouse.serving.encoding import decoder, encoder
from cdc_lakehouse.serving.export import export, rollback
from cdc_lakehouse.serving.reader import Reader
from cdc_lakehouse.serving.stores import open_store, store_uri_env

from tests.integration.conftest import Source

COLUMNS = "id BIGINT, gen INT, name STRING, amount DECIMAL(12,2), at TIMESTAMP, tags ARRAY<STRING>, raw BINARY"


@pytest.fixture(params=["redis", "dynamodb"])
def target(request, redis_server, s3_server, unique):
    """(kind, conn_id, options): the store behind a connection whose URI is in the job's environment."""
    kind = request.param
    conn_id = f"serving_{kind}_{unique}"
    if kind == "redis":
        uri, options = redis_server.uri, {"buckets": 8}
    else:
        uri = f"dynamodb://local:local@127.0.0.1:{s3_server.port}/?region=us-east-1&scheme=http"
        options = {"table_prefix": f"t{unique}_"}
    os.environ[store_uri_env(conn_id)] = uri
    yield kind, conn_id, options
    os.environ.pop(store_uri_env(conn_id), None)


def make_export(target, name: str, source: dict, **kw) -> ExportConfig:
    kind, conn_id, options = target
    store = {"kind": kind, "conn_id": conn_id, "namespace": name, **options}
    return ExportConfig.model_validate({"name": name, "source": source, "store": store, **kw})


def open_for(ecfg: ExportConfig):
    s = ecfg.store
    return open_store(s.kind, os.environ[store_uri_env(s.conn_id)], buckets=s.buckets, table_prefix=s.table_prefix)


def run(spark, lake, ecfg, source=None, **kw):
    tables = {} if source is None else {source.block.name: source.block, source.perm.name: source.perm}
    return export(spark, lake, ecfg, tables, {}, **kw)


def assert_store_equals(spark, ecfg: ExportConfig, table: str, where: str = "true") -> int:
    """The namespace's current version holds exactly the source's keys, each with its row's value."""
    store = open_for(ecfg)
    try:
        meta = store.resolve(ecfg.store.namespace)[0]
        key = meta.key_columns
        values = [f["name"] for f in __import__("json").loads(meta.value_schema)["fields"]]
        rows = spark.sql(f"SELECT * FROM {table} WHERE {where}").collect()
        encode, decode = encoder(meta.value_schema), decoder(meta.value_schema)
        version, got = Reader(store, ecfg.store.namespace).get_many([[r[k] for k in key] for r in rows])
        assert version == meta.version
        for row, value in zip(rows, got):
            want = decode(encode({c: row.asDict(recursive=True)[c] for c in values}))
            assert value == want, (row, value)
        assert store.count(ecfg.store.namespace, meta.version) == len(rows)
        return len(rows)
    finally:
        store.close()


@pytest.fixture
def lake_table(spark, unique):
    t = f"lake.srv.t_{unique}"
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.srv")
    spark.sql(f"CREATE TABLE {t} ({COLUMNS}) USING iceberg")
    spark.sql(
        f"INSERT INTO {t} SELECT id, 0, concat('n', id), CAST(id * 1.5 AS DECIMAL(12,2)), "
        "timestamp'2026-01-01 00:00:00' + make_interval(0, 0, 0, 0, 0, 0, id), "
        "CASE WHEN id % 7 = 0 THEN NULL ELSE array(concat('t', id % 3), NULL) END, "
        "CASE WHEN id % 5 = 0 THEN NULL ELSE encode(concat('b', id), 'utf-8') END FROM range(1, 301)"
    )
    yield t
    spark.sql(f"DROP TABLE IF EXISTS {t} PURGE")


def change(spark, t: str, rng: random.Random) -> None:
    """Inserts, updates (values and NULLs) and deletes, spread over the key range."""
    ids = rng.sample(range(1, 400), 60)
    spark.sql(f"DELETE FROM {t} WHERE id IN ({','.join(map(str, ids[:15]))})")
    spark.sql(
        f"UPDATE {t} SET gen = gen + 1, name = NULL, tags = array() WHERE id IN ({','.join(map(str, ids[15:45]))})"
    )
    top = spark.sql(f"SELECT max(id) FROM {t}").first()[0]
    new = range(top + 1, top + 1 + len(ids[45:]))  # never an existing key: keys stay unique
    spark.sql(
        f"INSERT INTO {t} SELECT id, 0, 'new', 1.00, NULL, NULL, NULL FROM VALUES {','.join(f'({i})' for i in new)} AS v(id)"
    )


def test_full_then_incremental_inserts_updates_deletes(spark, lake, lake_table, target, unique):
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    ecfg = make_export(target, f"full_{unique}", {"lake_table": lake_table[len("lake.") :]}, key=["id"])
    first = run(spark, lake, ecfg)
    assert first.mode == "full" and first.keys == 300 and first.validated_sample == 100, first
    assert assert_store_equals(spark, ecfg, lake_table) == 300
    for _ in range(2):
        change(spark, lake_table, rng)
        m = run(spark, lake, ecfg)
        assert m.mode == "incremental" and m.version == first.version, m
        assert m.keys_from == "snapshot_diff", m  # a plain Iceberg table has no changelog
        assert m.deletes >= 1 and m.upserts >= 1, m
        assert m.upserts + m.deletes <= 60, m  # only the changed keys are written
        assert_store_equals(spark, ecfg, lake_table)
    assert run(spark, lake, ecfg).mode == "noop"


def test_killed_mid_write_moves_nothing_and_the_next_run_converges(spark, lake, lake_table, target, unique):
    rng = random.Random(7)
    ecfg = make_export(target, f"kill_{unique}", {"lake_table": lake_table[len("lake.") :]}, key=["id"])
    store = open_for(ecfg)
    ns = ecfg.store.namespace
    os.environ["CDC_TEST_CRASH_AT"] = "export_write:40"
    try:
        with pytest.raises(Exception, match="export_write failpoint"):
            run(spark, lake, ecfg)
    finally:
        os.environ.pop("CDC_TEST_CRASH_AT")
    assert store.alias(ns) is None  # a failed first version is never visible
    v1 = run(spark, lake, ecfg).version
    assert store.alias(ns).current == v1 and len(store.versions(ns)) == 1  # the failed version was dropped
    assert_store_equals(spark, ecfg, lake_table)
    # An incremental run killed mid-write: some keys hold the new values, the position has not moved.
    spark.sql(f"UPDATE {lake_table} SET gen = 5, name = 'killed' WHERE id <= 100")
    change(spark, lake_table, rng)
    os.environ["CDC_TEST_CRASH_AT"] = "export_write:10"
    try:
        with pytest.raises(Exception, match="export_write failpoint"):
            run(spark, lake, ecfg)
    finally:
        os.environ.pop("CDC_TEST_CRASH_AT")
    meta = store.meta(ns, v1)
    assert meta.pending and meta.snapshot != meta.pending[-1]
    # The source goes back to the exported values for those keys: only the pending snapshot
    # shows which keys the killed run may have overwritten.
    spark.sql(f"UPDATE {lake_table} SET gen = 0, name = concat('n', id) WHERE id <= 100")
    m = run(spark, lake, ecfg)
    assert m.mode == "incremental", m
    assert_store_equals(spark, ecfg, lake_table)
    assert store.meta(ns, v1).pending == []
    store.close()


def test_rollback_retention_and_a_reader_that_never_sees_a_mix(spark, lake, lake_table, target, unique):
    ecfg = make_export(
        target, f"roll_{unique}", {"lake_table": lake_table[len("lake.") :]}, key=["id"], keep_versions=2
    )
    store = open_for(ecfg)
    ns = ecfg.store.namespace
    v1 = run(spark, lake, ecfg).version
    keys = [[i] for i in range(1, 301)]
    seen: list[tuple[int, set]] = []
    stop = threading.Event()

    def read():
        reader = Reader(open_for(ecfg), ns)
        while not stop.is_set():
            version, got = reader.get_many(keys)
            seen.append((version, {g["gen"] for g in got if g is not None}))

    t = threading.Thread(target=read)
    t.start()
    try:
        for gen in (1, 2):
            spark.sql(f"UPDATE {lake_table} SET gen = {gen}")
            run(spark, lake, ecfg, mode="full")
    finally:
        stop.set()
        t.join()
    # Every read saw one version, whole: a single gen per batch, never a mix of old and new.
    assert all(len(gens) == 1 for _, gens in seen), [s for s in seen if len(s[1]) != 1][:3]
    assert v1 in {v for v, _ in seen} and len({v for v, _ in seen}) >= 2, {v for v, _ in seen}  # it saw a switch
    v3 = store.alias(ns).current
    assert store.versions(ns) == [v3 - 1, v3]  # keep_versions=2: v1 dropped
    assert Reader(store, ns).get(5)["gen"] == 2
    back = rollback(store, ns)
    assert back.current == v3 - 1 and back.held and Reader(store, ns).get(5)["gen"] == 1
    # Held: a scheduled run after a source change leaves the rolled-back version alone ...
    spark.sql(f"UPDATE {lake_table} SET gen = 3 WHERE id = 5")
    assert run(spark, lake, ecfg).mode == "held" and Reader(store, ns).get(5)["gen"] == 1
    # ... until `resume`: the version readers use catches up incrementally, and the hold is gone.
    assert run(spark, lake, ecfg, mode="resume").mode == "incremental"
    assert Reader(store, ns).get(5)["gen"] == 3 and not store.alias(ns).held
    assert_store_equals(spark, ecfg, lake_table)
    spark.sql(f"UPDATE {lake_table} SET gen = 2 WHERE id = 5")
    run(spark, lake, ecfg)
    rollback(store, ns)  # and forward again
    assert Reader(store, ns).get_many([[6]]) == (v3, [Reader(store, ns).get(6)])
    # A reader whose current version lost its metadata reads the previous one.
    store.cas_doc(store.meta_key(ns, v3), store.get_doc(store.meta_key(ns, v3)), None)
    assert Reader(store, ns).get_many([[6]])[0] == v3 - 1
    store.close()


def test_export_of_a_cdc_table_follows_capture_and_ingest(pg, source_uri, spark, lake, redis_server, unique):
    """Current rows of a CDC table (soft deletes: a soft-deleted row leaves the store)."""
    s = Source(pg, spark, lake, unique, blocks=100)
    try:
        s.capture()
        s.bootstrap(s.perm)
        conn = f"serving_cdc_{unique}"
        os.environ[store_uri_env(conn)] = redis_server.uri
        ecfg = make_export(("redis", conn, {"buckets": 4}), f"perm_{unique}", {"table": s.perm.name})
        assert ecfg.store.kind == "redis"
        m = run(spark, lake, ecfg, s)
        assert m.mode == "full" and ecfg.store.namespace
        live = f"lake.{s.perm.current_table}"
        n = assert_store_equals(spark, ecfg, live, where="NOT is_deleted")
        s.execute("DELETE FROM s0.permission WHERE block_id % 3 = 0")
        s.execute("UPDATE s1.permission SET role = 'editor' WHERE block_id % 4 = 0")
        s.execute("UPDATE s1.permission SET user_id = user_id + 100000 WHERE block_id % 5 = 1")  # key changes
        captured = s.capture().manifest.run_id
        assert s.ingest(s.perm, captured, run=f"i{s.runs}").metrics.status == "ok"
        m = run(spark, lake, ecfg, s)
        assert m.mode == "incremental" and m.deletes >= 1 and m.keys_from == "changelog", m
        assert assert_store_equals(spark, ecfg, live, where="NOT is_deleted") < n
    finally:
        s.close()


def test_an_empty_source_then_rows_then_a_new_layout_each_give_a_whole_version(spark, lake, target, unique):
    """A first export of a table with no snapshot holds no keys; the first rows then need a full
    run (nothing to diff against), as does a changed bucket count (readers would look elsewhere)."""
    t = f"lake.srv.e_{unique}"
    spark.sql("CREATE NAMESPACE IF NOT EXISTS lake.srv")
    spark.sql(f"CREATE TABLE {t} ({COLUMNS}) USING iceberg")
    try:
        ecfg = make_export(target, f"empty_{unique}", {"lake_table": t[len("lake.") :]}, key=["id"])
        assert run(spark, lake, ecfg).keys == 0
        assert run(spark, lake, ecfg).mode == "noop"
        spark.sql(f"INSERT INTO {t} SELECT id, 0, 'x', NULL, NULL, NULL, NULL FROM range(1, 51)")
        assert run(spark, lake, ecfg).mode == "full"
        assert assert_store_equals(spark, ecfg, t) == 50
        if ecfg.store.kind == "redis":
            wider = ecfg.model_copy(update={"store": ecfg.store.model_copy(update={"buckets": 16})})
            m = run(spark, lake, wider)
            assert m.mode == "full" and m.keys == 50, m
            assert assert_store_equals(spark, wider, t) == 50
            rollback(open_for(wider), wider.store.namespace)  # the old version keeps its own layout
            assert assert_store_equals(spark, ecfg, t) == 50
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {t} PURGE")
