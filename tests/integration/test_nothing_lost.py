"""Paths where a change could vanish or a value go wrong, each driven against real PostgreSQL,
Spark and Iceberg (issue 22). Every test here failed on the code before its fix."""

from __future__ import annotations

import time

import psycopg2
import pytest
from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
from cdc_lakehouse.capture.capture_run import CaptureResult, capture_run
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.landing.errors import CoverageError, SourceIdentityChanged
from cdc_lakehouse.landing.stores import LocalLanding
from cdc_lakehouse.source.catalog import EndpointTables
from cdc_lakehouse.source.errors import PreflightError, SourceError
from cdc_lakehouse.source.slots import slot_name as source_slot_name
from cdc_lakehouse.source.slots import slot_state
from pyspark.sql import functions as F

from tests.conftest import make_config
from tests.helpers import _update_manifest, assert_lake_equals_source
from tests.integration.conftest import Source

BIG = "(SELECT string_agg(md5(g::text || '{tag}'), '') FROM generate_series(1, 80) g)"  # 2.5 kB, out of line


def capture_with(s: Source, tables: dict) -> CaptureResult:
    """A capture driven by other configs than the fixture's (one broken, one shard removed, ...)."""
    s.runs += 1
    ep = EndpointTables(s.endpoint, "cdc_test_source", tables)
    return capture_run(ep, s.dsn, s.store, f"20260101T{s.runs:02d}0000Z")


def shard_of(s: Source, schema: str) -> str:
    return next(n for _, sch, n in s.block.shards() if sch == schema)


def test_changes_of_a_table_whose_config_is_broken_still_land(source, spark, lake):
    """While permission's YAML is invalid, captures run for block only: permission's changes must
    land anyway (the slot is shared), and reach the lake once the config is back."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    s.wl.step(400)
    s.execute(
        "UPDATE s1.permission SET role = 'editor' WHERE block_id IN (SELECT block_id FROM s1.permission LIMIT 20)"
    )
    m = capture_with(s, {"block": (s.schemas, ["id"])})
    assert "permission" in {t.table for t in m.manifest.tables}
    s.wl.step(200)
    m = s.capture()
    for cfg in (s.block, s.perm):
        assert s.ingest(cfg, m.manifest.run_id).metrics.status == "ok"
        assert_lake_equals_source(spark, lake, cfg, s.dsn)


def test_a_run_that_did_not_cover_a_shard_never_moves_its_position(source, spark, lake):
    """A shard taken out of the config (and so out of the publication) for a while, then put back:
    its changes in between were never read. The ingest must stop, not report ok."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.execute(
        "ALTER PUBLICATION cdc_lakehouse DROP TABLE s1.block",
        f"UPDATE s1.block SET version = version + 7 WHERE id = {s.wl.first_id['s1']}",
        f"UPDATE s0.block SET version = version + 7 WHERE id = {s.wl.first_id['s0']}",
    )
    m = capture_with(s, {"block": (["s0"], ["id"]), "permission": (s.schemas, ["block_id", "user_id"])})
    assert "s1.block" not in m.manifest.published
    cur = lake.qualified(s.block.current_table)
    wm = read_watermark(spark, cur)
    with pytest.raises(CoverageError) as exc:
        s.ingest(s.block, m.manifest.run_id)
    msg = str(exc.value)
    assert shard_of(s, "s1") in msg and "s1.block" in msg and f"cdc_bootstrap__{s.block.name}" in msg
    assert read_watermark(spark, cur) == wm
    # The fix the message names: re-bootstrap the shard (which puts it back in the publication).
    s.bootstrap(s.block, shards=[shard_of(s, "s1")])
    s.wl.step(200)
    m = s.capture()
    s.ingest(s.block, m.manifest.run_id)
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


def test_positions_never_compare_across_servers_or_endpoints(source, source_uri, spark, lake, monkeypatch):
    s = source
    s.capture()
    s.bootstrap(s.block)
    wm = read_watermark(spark, lake.qualified(s.block.current_table))
    ident = wm.shards[shard_of(s, "s0")].source
    assert ident["database"] == s.db and ident["system_identifier"] and ident["timeline"] >= 1
    # A failover to a server on another timeline, behind the same connection and slot name.
    s.wl.step(100)
    m = s.capture()
    _update_manifest(
        lake,
        s.endpoint,
        m.manifest.run_id,
        lambda mf: mf["source_identity"].update(timeline=mf["source_identity"]["timeline"] + 1),
    )
    with pytest.raises(SourceIdentityChanged) as exc:
        s.ingest(s.block, m.manifest.run_id)
    assert "timeline" in str(exc.value) and "re-bootstrap" in str(exc.value)
    _update_manifest(
        lake,
        s.endpoint,
        m.manifest.run_id,
        lambda mf: mf["source_identity"].update(timeline=mf["source_identity"]["timeline"] - 1),
    )
    s.ingest(s.block, m.manifest.run_id)
    # The shards are now read through another connection (another host name, a proxy): another
    # endpoint with its own slot, whose positions say nothing about the old slot's.
    monkeypatch.setenv("AIRFLOW_CONN_CDC_TEST_ALIAS", source_uri)
    group = {"conn_id": "cdc_test_alias", "database": s.db, "schemas": s.schemas}
    moved = make_config(s.block.name, [], source={"table": "block", "shards": [group]})
    ep = EndpointTables(moved.source.shards[0].endpoint_id, "cdc_test_alias", s.tables())
    capture_run(ep, s.dsn, s.store, "20260101T500000Z")
    s.wl.step(100)
    m = capture_run(ep, s.dsn, s.store, "20260101T510000Z")
    with pytest.raises(SourceIdentityChanged) as exc:
        s.ingest(moved, m.manifest.run_id)
    assert "endpoint" in str(exc.value) and "re-bootstrap" in str(exc.value)
    bootstrap_table(spark, lake, moved, run_id="moved", all_endpoint_tables={ep.endpoint_id: s.tables()})
    s.wl.step(100)
    m = capture_run(ep, s.dsn, s.store, "20260101T520000Z")
    s.ingest(moved, m.manifest.run_id)
    assert_lake_equals_source(spark, lake, moved, s.dsn)


def test_toast_fill_never_looks_across_a_delete_or_key_change(source, spark, lake):
    """update 1 with large A; move 1 -> 99; move 2 (large B) -> 1; update another column of 1."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    a, b = s.wl.first_id["s0"], s.wl.first_id["s0"] + 1
    s.execute(f"UPDATE s0.block SET content = {BIG.format(tag='B')} WHERE id = {b}")
    m = s.capture()
    s.ingest(s.block, m.manifest.run_id)
    s.execute(
        f"UPDATE s0.block SET content = {BIG.format(tag='A')} WHERE id = {a}",
        f"UPDATE s0.block SET id = 990099 WHERE id = {a}",
        f"UPDATE s0.block SET id = {a} WHERE id = {b}",
        f"UPDATE s0.block SET version = version + 1 WHERE id = {a}",
    )
    m = s.capture()
    r = s.ingest(s.block, m.manifest.run_id)
    assert r.metrics.quarantined == 0
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    row = (
        spark.table(lake.qualified(s.block.current_table))
        .filter((F.col("id") == a) & (F.col("_cdc_shard") == shard_of(s, "s0")))
        .first()
    )
    assert row["content"].startswith(_md5_prefix("1B"))


def _md5_prefix(text: str) -> str:
    import hashlib

    return hashlib.md5(text.encode()).hexdigest()


@pytest.fixture
def scratch_db(pg, unique):
    """A database of its own: (dsn, autocommit connection); its slots and itself go afterwards."""
    name = f"scr_{unique}"
    pg.execute(f"CREATE DATABASE {name}")
    conn = psycopg2.connect(pg.dsn(name))
    conn.autocommit = True
    yield pg.dsn(name), conn
    conn.close()
    for (slot,) in pg.execute(f"SELECT slot_name FROM pg_replication_slots WHERE database = '{name}'"):
        pg.execute(f"SELECT pg_drop_replication_slot('{slot}')")
    pg.execute(f"DROP DATABASE {name} WITH (FORCE)")


def test_publication_that_drops_changes_is_fixed_or_refused(scratch_db, tmp_path):
    """A pre-existing publication without deletes/truncates is widened; row filters, column lists
    and partitioned tables are refused with the statement that fixes them."""
    dsn, conn = scratch_db
    store = LocalLanding(f"file://{tmp_path}/landing")
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE public.items (id bigint PRIMARY KEY, v text, w text)")
        cur.execute("INSERT INTO public.items SELECT g, 'x', 'y' FROM generate_series(1, 10) g")
        cur.execute("CREATE PUBLICATION cdc_lakehouse FOR TABLE public.items WITH (publish = 'insert, update')")
    ep = EndpointTables("pubep", "cdc_test_source", {"items": (["public"], ["id"])})
    capture_run(ep, dsn, store, "r1")
    with conn.cursor() as cur:
        cur.execute("DELETE FROM public.items WHERE id = 3")
        cur.execute("TRUNCATE public.items")
    m = capture_run(ep, dsn, store, "r2")
    ops = []
    for t in m.manifest.tables:
        import pyarrow.parquet as pq

        for f in t.files:
            ops += pq.read_table(store.root / t.dir / f.name).column("op").to_pylist()
    assert ops == ["d", "t"]
    with conn.cursor() as cur:
        cur.execute("ALTER PUBLICATION cdc_lakehouse SET TABLE public.items WHERE (id > 5), public._cdc_heartbeat")
    with pytest.raises(PreflightError) as exc:
        capture_run(ep, dsn, store, "r3")
    assert "row filter" in str(exc.value) and "DROP TABLE" in str(exc.value) and "public.items" in str(exc.value)
    with conn.cursor() as cur:
        cur.execute("ALTER PUBLICATION cdc_lakehouse SET TABLE public.items (id, v), public._cdc_heartbeat")
    with pytest.raises(PreflightError) as exc:
        capture_run(ep, dsn, store, "r3")
    assert "column list" in str(exc.value)
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE public.events (id bigint, at date, PRIMARY KEY (id, at)) PARTITION BY RANGE (at)")
        cur.execute(
            "CREATE TABLE public.events_2026 PARTITION OF public.events "
            "FOR VALUES FROM ('2026-01-01') TO ('2027-01-01')"
        )
    ep2 = EndpointTables("pubep", "cdc_test_source", {"events": (["public"], ["id", "at"])})
    with pytest.raises(PreflightError) as exc:
        capture_run(ep2, dsn, store, "r4")
    assert "partitioned" in str(exc.value) and "leaf partition" in str(exc.value)


def test_events_that_depend_on_a_quarantined_event_are_held_back(source, spark, lake):
    """A quarantined update carried a new TOAST value; later updates of the key leave it unchanged.
    They must not be merged with the table's older value, in this batch or the next ones."""
    s = source
    s.capture()
    lenient = s.block.model_copy(
        update={
            "ingest": s.block.ingest.model_copy(
                update={"error_budget": s.block.ingest.error_budget.model_copy(update={"max_fraction": 1.0})}
            )
        }
    )
    s.bootstrap(lenient)
    x = s.wl.first_id["s1"]
    key = (F.col("id") == x) & (F.col("_cdc_shard") == shard_of(s, "s1"))
    cur = lake.qualified(lenient.current_table)
    old = spark.table(cur).filter(key).first()
    s.execute(
        f"UPDATE s1.block SET content = {BIG.format(tag='C')}, updated_at = 'infinity' WHERE id = {x}",
        f"UPDATE s1.block SET version = 70, updated_at = now() WHERE id = {x}",
    )
    m = s.capture()
    r = s.ingest(lenient, m.manifest.run_id)
    assert r.metrics.quarantined == 2
    reasons = [
        q["reason"]
        for q in spark.table(lake.qualified(lake.meta_table("quarantine")))
        .filter(F.col("table_name") == lenient.name)
        .collect()
    ]
    assert any("does not fit timestamp" in q for q in reasons)
    assert any("depend on quarantined event" in q for q in reasons)
    row = spark.table(cur).filter(key).first()
    assert (row["content"], row["version"]) == (old["content"], old["version"])  # older, never mixed
    # The next batch still cannot know the value.
    s.execute(f"UPDATE s1.block SET version = 71 WHERE id = {x}")
    m = s.capture()
    s.ingest(lenient, m.manifest.run_id)
    assert spark.table(cur).filter(key).first()["version"] == old["version"]
    # A full value ends the dependency.
    s.execute(f"UPDATE s1.block SET content = 'fresh' WHERE id = {x}")
    m = s.capture()
    s.ingest(lenient, m.manifest.run_id)
    assert_lake_equals_source(spark, lake, lenient, s.dsn)


@pytest.mark.parametrize("point", ["ingest_before_changelog", "ingest_after_changelog"])
def test_a_second_writer_fences_out_a_zombie_run(source, spark, lake, monkeypatch, point):
    """While one run sits between reading the watermark and committing, another deployment
    commits: the same batch (the zombie must not append it twice) or a newer one (the zombie must
    not move the watermark back)."""
    import cdc_lakehouse.ingest.ingest_table as ingest_mod
    from cdc_lakehouse.lake.commits import ConcurrentWriterError

    s = source
    s.capture()
    s.bootstrap(s.block)
    real = ingest_mod.crash_point
    cur = lake.qualified(s.block.current_table)

    def zombie(upto, other):
        fired = []

        def other_writer_commits_here(name):
            if name == point and not fired:
                fired.append(name)
                other()
            real(name)

        monkeypatch.setattr(ingest_mod, "crash_point", other_writer_commits_here)
        try:
            return s.ingest(s.block, upto, run="zombie")
        finally:
            monkeypatch.setattr(ingest_mod, "crash_point", real)

    s.wl.step(300)
    m1 = s.capture()
    zombie(m1.manifest.run_id, lambda: s.ingest(s.block, m1.manifest.run_id, run="same-batch"))
    assert read_watermark(spark, cur).runs[s.endpoint] == m1.manifest.run_id

    s.wl.step(300)
    m2 = s.capture()

    def newer_batch():
        s.wl.step(300)
        m3 = s.capture()
        s.ingest(s.block, m3.manifest.run_id, run="newer")

    with pytest.raises(ConcurrentWriterError) as exc:
        zombie(m2.manifest.run_id, newer_batch)
    assert "another writer" in str(exc.value)
    assert read_watermark(spark, cur).runs[s.endpoint] > m2.manifest.run_id  # never moved back
    cl = spark.table(lake.qualified(s.block.changelog_table)).filter("_cdc_op <> 'r' AND _cdc_op <> 't'")
    assert cl.groupBy("_cdc_shard", "_cdc_commit_lsn", "_cdc_seq").count().filter("count > 1").count() == 0
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


def test_every_schema_decision_keeps_bootstrap_ingest_repair_and_audit_working(source, spark, lake):
    """Columns dropped under `drop` and `keep_null`, one of them added back: the changelog append,
    the re-bootstrap and the audit's repair all keep working."""
    from cdc_lakehouse.audit.audit_table import audit_table

    s = source
    policy = s.block.schema_changes.model_copy(
        update={"dropped_columns": {"score": "drop", "external_id": "keep_null"}}
    )
    cfg = s.block.model_copy(
        update={
            "schema_changes": policy,
            "audit": s.block.audit.model_copy(update={"consecutive_mismatches": 1, "repair": True, "mode": "full"}),
        }
    )
    s.capture()
    s.bootstrap(cfg)
    ids = {sch: s.wl.first_id[sch] for sch in s.schemas}
    touch = [
        f"UPDATE {sch}.block SET version = version + 1 WHERE id BETWEEN {i} AND {i + 30}" for sch, i in ids.items()
    ]
    s.execute(*[f"ALTER TABLE {sch}.block DROP COLUMN score, DROP COLUMN external_id" for sch in s.schemas], *touch)
    for step in range(2):  # the second batch used to fail: the changelog still has `score`
        if step:
            s.execute(*touch)
        m = s.capture()
        assert s.ingest(cfg, m.manifest.run_id, run=f"d{step}").metrics.status == "ok"
    cur = lake.qualified(cfg.current_table)
    assert "score" not in spark.table(cur).columns and "external_id" in spark.table(cur).columns
    assert_lake_equals_source(spark, lake, cfg, s.dsn, skip=("external_id",), check_changelog=False)
    # `score` comes back: the changelog already has it.
    s.execute(
        *[f"ALTER TABLE {sch}.block ADD COLUMN score numeric(12,4)" for sch in s.schemas],
        f"UPDATE s0.block SET score = 1.5 WHERE id BETWEEN {ids['s0']} AND {ids['s0'] + 5}",
    )
    m = s.capture()
    s.ingest(cfg, m.manifest.run_id, run="readd")
    assert spark.table(cur).filter("score = 1.5").count() == 6
    assert_lake_equals_source(spark, lake, cfg, s.dsn, skip=("external_id",), check_changelog=False)
    # A re-bootstrap with the kept column: NULL from the snapshot on.
    s.bootstrap(cfg)
    assert spark.table(cur).filter("external_id IS NOT NULL").count() == 0
    assert_lake_equals_source(spark, lake, cfg, s.dsn, skip=("external_id",))
    # The audit's repair re-reads a key the lake lost.
    spark.sql(f"DELETE FROM {cur} WHERE id = {ids['s1']}")
    r = audit_table(spark, lake, cfg, audit_run="schema-a1")
    assert r.repaired >= 1, r
    assert_lake_equals_source(spark, lake, cfg, s.dsn, skip=("external_id",), check_changelog=False)


def test_landing_runs_go_once_every_table_applied_them_and_are_private(source, spark, lake):
    """maintenance.landing_retention_hours is honoured, per endpoint and across its tables; landing
    files and manifests are not world-readable (they hold row images, deleted rows included)."""
    import stat
    from datetime import UTC, datetime, timedelta

    from cdc_lakehouse.maintenance.landing_retention import prune_landing

    from tests.helpers import landing_root

    s = source
    s.capture()
    s.bootstrap(s.block)
    s.bootstrap(s.perm)
    runs = []
    for _ in range(3):
        s.wl.step(100)
        runs.append(s.capture().manifest.run_id)
    s.ingest(s.block, runs[2])
    s.ingest(s.perm, runs[0])  # permission is behind: runs 1 and 2 are still needed
    root = landing_root(lake) / s.endpoint
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files and all(not (p.stat().st_mode & stat.S_IROTH) for p in files)
    now = datetime.now(UTC)
    assert prune_landing(spark, lake, s.block, [s.block, s.perm], now) == {}
    later = now + timedelta(hours=s.block.maintenance.landing_retention_hours + 1)
    out = prune_landing(spark, lake, s.block, [s.block, s.perm], later)
    removed = out[s.endpoint]
    assert runs[0] in removed and runs[1] not in removed and runs[2] not in removed
    assert not (root / "_manifests" / f"{runs[0]}.json").exists()
    assert not any(root.glob(f"*/run={runs[0]}"))
    # The tables still converge from what is left.
    s.ingest(s.perm, runs[2])
    assert_lake_equals_source(spark, lake, s.perm, s.dsn)


def test_everything_under_the_landing_zone_is_private(pg, source_uri, spark, lake, unique, tmp_path):
    """Capture runs, a run with a malformed event that went to quarantine, and a Debezium table's
    staged events: every file under the landing zone is 0640 and every directory 0750, its root
    included (they hold row images, deleted rows included). The quarantined payloads themselves
    are rows of cdc_meta.quarantine, in the warehouse."""
    import dataclasses
    import stat

    from cdc_lakehouse.bootstrap.debezium import bootstrap_debezium
    from cdc_lakehouse.ingest.ingest_table import ingest_table

    from tests.fixtures.debezium import write_json
    from tests.helpers import append_malformed
    from tests.integration.test_debezium import TOPIC, base, ev

    root = tmp_path / "landing"  # a zone of its own: the whole tree is this test's
    private = dataclasses.replace(lake, landing_uri=f"file://{root}")
    s = Source(pg, spark, private, unique, blocks=20)
    shards = {"conn_id": "cdc_test_source", "database": s.db, "schemas": s.schemas}
    block = make_config(
        f"bp_{unique}", [], source={"table": "block", "shards": [shards]}, ingest={"error_budget": {"max_fraction": 1}}
    )
    try:
        s.capture()
        s.bootstrap(block)
        s.wl.step(100)
        m = s.capture()
        append_malformed(private, s.endpoint, m.manifest.run_id, "block", [{"op": "x"}])
        quarantined = s.ingest(block, m.manifest.run_id).metrics.quarantined
        # The malformed event, and any later row of its key whose unchanged TOAST value depends
        # on it (held back: ingest.quarantine.held_back), when the workload updated that key.
        reasons = [
            r.reason
            for r in spark.table(private.qualified(private.meta_table("quarantine")))
            .filter(f"table_name = '{block.name}'")
            .collect()
        ]
        assert quarantined == len(reasons) and reasons.count("unknown op 'x'") == 1, reasons
        assert all(r == "unknown op 'x'" or "depend on quarantined event" in r for r in reasons), reasons
    finally:
        s.close()
    sink = tmp_path / "sink"
    cfg = make_config(
        f"dbz_priv_{unique}", ["s1"], table="orders",
        landing={"kind": "debezium_s3", "uri": f"file://{sink}", "topic_prefix": "dbz"},
    )  # fmt: skip
    write_json(
        sink, TOPIC, 0, 0, [ev("r", 500, None, after=base(1), snapshot="last"), ev("c", 600, 500, after=base(2))]
    )
    bootstrap_debezium(spark, private, cfg)
    ingest_table(spark, private, cfg, upto_run=None, ingest_run="p1")
    assert any((root / "_debezium" / cfg.name).rglob("*.parquet"))
    tree = [root, *root.rglob("*")]
    wrong = [
        f"{p} {stat.S_IMODE(p.stat().st_mode):o}"
        for p in tree
        if stat.S_IMODE(p.stat().st_mode) != (0o750 if p.is_dir() else 0o640)
    ]
    assert not wrong, wrong


def test_added_column_defaults_reach_the_rows_that_predate_them(source, spark, lake, monkeypatch):
    """ADD COLUMN ... DEFAULT writes no events for existing rows: a constant default lives in the
    catalog, a volatile one rewrites the table. The lake must show the source's values, also when
    the run dies between its MERGE and the backfill."""
    import cdc_lakehouse.ingest.ingest_table as ingest_mod

    s = source
    s.capture()
    s.bootstrap(s.block)
    a, b = s.wl.first_id["s0"], s.wl.first_id["s1"]
    s.execute(
        f"UPDATE s0.block SET version = version + 1 WHERE id = {a}",  # before the ALTER, same batch
        "ALTER TABLE s0.block ADD COLUMN flag text NOT NULL DEFAULT 'fresh'",
        "ALTER TABLE s1.block ADD COLUMN flag text DEFAULT md5(random()::text)",
        f"UPDATE s0.block SET version = version + 1 WHERE id = {a + 1}",
        f"UPDATE s1.block SET flag = 'set' WHERE id = {b}",
    )
    m = s.capture()
    r = s.ingest(s.block, m.manifest.run_id)
    assert r.metrics.backfilled > 2000, r
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    cur = lake.qualified(s.block.current_table)
    assert read_watermark(spark, cur).backfill is None
    # The run dies right after its MERGE: the watermark says a backfill is pending; the next run does it.
    s.execute(
        "ALTER TABLE s0.block ADD COLUMN rank int DEFAULT 7",
        "ALTER TABLE s1.block ADD COLUMN rank int DEFAULT 7",
        f"UPDATE s0.block SET rank = 1 WHERE id = {a}",
        f"UPDATE s1.block SET rank = 2 WHERE id = {b}",
    )
    m = s.capture()
    real = ingest_mod.crash_point

    def die_after_merge(name):
        if name == "ingest_after_merge":
            raise RuntimeError("killed")
        real(name)

    monkeypatch.setattr(ingest_mod, "crash_point", die_after_merge)
    with pytest.raises(RuntimeError, match="killed"):
        s.ingest(s.block, m.manifest.run_id)
    monkeypatch.setattr(ingest_mod, "crash_point", real)
    assert read_watermark(spark, cur).backfill
    s.ingest(s.block, m.manifest.run_id)
    assert read_watermark(spark, cur).backfill is None
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


def test_a_column_added_on_every_shard_reaches_the_rows_of_the_quiet_ones(pg, source_uri, spark, lake, unique):
    """ADD COLUMN ... DEFAULT on both shards, then writes on s0 only: s1 sends no relation message,
    yet once the lake has the columns s1's rows hold the source's values, for a constant and a
    volatile default; also when a re-bootstrap of s0 is what brings a column to the lake, and after
    s1 writes at last (its relation message then announces the columns itself)."""
    s = Source(pg, spark, lake, unique, blocks=20)
    try:
        s.capture()
        s.bootstrap(s.block)
        s.execute(
            *[f"ALTER TABLE {sch}.block ADD COLUMN rank int DEFAULT 7" for sch in s.schemas],
            *[f"ALTER TABLE {sch}.block ADD COLUMN seen timestamptz DEFAULT clock_timestamp()" for sch in s.schemas],
            f"UPDATE s0.block SET version = version + 1 WHERE id = {s.wl.first_id['s0']}",
        )
        s.ingest(s.block, s.capture().manifest.run_id)
        assert_lake_equals_source(spark, lake, s.block, s.dsn)
        cur = lake.qualified(s.block.current_table)
        assert read_watermark(spark, cur).shards[shard_of(s, "s1")].filled == ["rank", "seen"]
        # Filled once: the next batch leaves s1 alone.
        assert s.ingest(s.block, s.capture().manifest.run_id).metrics.backfilled is None
        # A re-bootstrap of s0 brings the next column; s1 is still quiet.
        s.execute(*[f"ALTER TABLE {sch}.block ADD COLUMN tier text DEFAULT 'gold'" for sch in s.schemas])
        s.bootstrap(s.block, shards=[shard_of(s, "s0")])
        s.ingest(s.block, s.capture().manifest.run_id)
        assert_lake_equals_source(spark, lake, s.block, s.dsn)
        s.execute(f"UPDATE s1.block SET version = version + 1 WHERE id = {s.wl.first_id['s1']}")
        s.ingest(s.block, s.capture().manifest.run_id)
        assert_lake_equals_source(spark, lake, s.block, s.dsn)
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["full", "checksum"])
def test_audit_reads_one_snapshot_fails_loudly_and_counts_retries_once(source, spark, lake, monkeypatch, mode):
    """A change committed after the keys in flight were computed is not a mismatch; a slot that
    cannot be peeked stops the audit instead of counting nothing as in flight; a retry of the same
    audit run does not extend a mismatch streak."""
    import cdc_lakehouse.audit.audit_table as audit_mod
    from cdc_lakehouse.audit.audit_table import audit_table
    from cdc_lakehouse.audit.errors import AuditFailed

    s = source
    cfg = s.block.model_copy(
        update={
            "audit": s.block.audit.model_copy(
                update={"consecutive_mismatches": 2, "mode": mode, "buckets": 16, "checksum_min_rows": 0}
            )
        }
    )
    s.capture()
    s.bootstrap(cfg)
    x = s.wl.first_id["s0"]
    real_peek = audit_mod.inflight_from_slot

    def peek_then_a_writer_commits(*a, **kw):
        out = real_peek(*a, **kw)
        s.execute(f"UPDATE s0.block SET version = version + 100 WHERE id = {x}")
        return out

    monkeypatch.setattr(audit_mod, "inflight_from_slot", peek_then_a_writer_commits)
    r = audit_table(spark, lake, cfg, audit_run=f"{mode}-a1")
    assert all(st.get("different", 0) == 0 and st.get("missing", 0) == 0 for st in r.shards.values()), r
    monkeypatch.setattr(audit_mod, "inflight_from_slot", real_peek)

    # The slot is busy for every attempt: no verdict instead of a wrong one.
    monkeypatch.setattr(audit_mod.time, "sleep", lambda _s: None)

    def busy(*a, **kw):
        return real_peek(*a, **{**kw, "attempts": 0})

    monkeypatch.setattr(audit_mod, "inflight_from_slot", busy)
    with pytest.raises(AuditFailed, match="in flight"):
        audit_table(spark, lake, cfg, audit_run=f"{mode}-a2")
    monkeypatch.setattr(audit_mod, "inflight_from_slot", real_peek)

    # A key lost from the lake, seen by one audit run and its retry: one sighting, not two.
    m = s.capture()
    s.ingest(cfg, m.manifest.run_id)
    spark.sql(f"DELETE FROM {lake.qualified(cfg.current_table)} WHERE id = {x + 1}")
    for _ in range(2):  # (the row-count quality check fails each time; the streak is what counts here)
        assert audit_table(spark, lake, cfg, audit_run=f"{mode}-a3").persistent == {}
    assert sum(audit_table(spark, lake, cfg, audit_run=f"{mode}-a4").persistent.values()) == 1


def test_keepalive_advance_of_a_failed_capture_is_no_landing_gap(source, spark, lake, monkeypatch):
    """psycopg2 reports a keepalive's position as flushed before the session's first data
    message: a capture that dies waiting moves the slot past the last manifest without skipping
    anything. That must not read as a lost landing run; a foreign advance still must."""
    from cdc_lakehouse.capture.capture_run import CaptureLimits
    from cdc_lakehouse.landing.errors import LandingGap

    s = source
    s.capture()
    s.bootstrap(s.block)
    s.wl.step(100)
    m = s.capture()
    s.execute(
        "CREATE TABLE s0.unpublished (id int PRIMARY KEY)", "INSERT INTO s0.unpublished SELECT generate_series(1, 500)"
    )
    monkeypatch.setattr(
        "cdc_lakehouse.capture.capture_run.write_heartbeat", lambda conn, schemas, run_id: 4_000_000_000
    )  # never arrives
    ep = EndpointTables(s.endpoint, "cdc_test_source", s.tables())
    with pytest.raises(SourceError, match="nothing left to decode"):
        capture_run(ep, s.dsn, s.store, "20260101T300000Z", limits=CaptureLimits(idle_timeout_s=14))
    monkeypatch.undo()
    with psycopg2.connect(s.dsn) as c:
        assert (
            slot_state(c, source_slot_name(s.endpoint)).confirmed_flush > m.manifest.end_lsn
        )  # the keepalive moved it
    s.wl.step(100)
    m2 = capture_run(ep, s.dsn, s.store, "20260101T310000Z")
    assert m2.manifest.start_lsn == m.manifest.end_lsn and m2.manifest.keepalive_advance["attempts"] == [
        "20260101T300000Z"
    ]
    assert s.ingest(s.block, m2.manifest.run_id).metrics.status == "ok"
    assert_lake_equals_source(spark, lake, s.block, s.dsn)
    # An advance nobody recorded (another consumer, a manual pg_replication_slot_advance) is a gap.
    s.execute(
        "INSERT INTO s0.unpublished SELECT generate_series(501, 600)",
        f"SELECT pg_replication_slot_advance('{source_slot_name(s.endpoint)}', pg_current_wal_lsn())",
    )
    m3 = capture_run(ep, s.dsn, s.store, "20260101T320000Z")
    with pytest.raises(LandingGap):
        s.ingest(s.block, m3.manifest.run_id)


def test_a_shard_quiet_since_a_column_was_added_is_not_a_dropped_column(source, spark, lake):
    """Found by the randomized test: a shard with no write since the ALTER still shows its older
    schema in the manifests, which read as "column dropped" and stopped the table."""
    s = source
    s.capture()
    s.bootstrap(s.block)
    s.execute(*[f"UPDATE {sch}.block SET version = 5 WHERE id = {s.wl.first_id[sch]}" for sch in s.schemas])
    m = s.capture()  # both shards' schemas are now in the manifests
    s.ingest(s.block, m.manifest.run_id)
    s.execute("ALTER TABLE s0.block ADD COLUMN note text", "ALTER TABLE s1.block ADD COLUMN note text")
    for value in ("x", "y"):
        s.execute(f"UPDATE s0.block SET note = '{value}' WHERE id = {s.wl.first_id['s0']}")
        m = s.capture()
        assert s.ingest(s.block, m.manifest.run_id).metrics.status == "ok"
    assert_lake_equals_source(spark, lake, s.block, s.dsn)


def test_a_long_decode_without_output_is_waited_for_not_failed(scratch_db, tmp_path):
    """A large transaction of an unpublished table makes the server decode for a while without
    sending anything: the capture asks whether the walsender is still busy instead of failing."""
    from cdc_lakehouse.capture.capture_run import CaptureLimits

    dsn, conn = scratch_db
    store = LocalLanding(f"file://{tmp_path}/landing")
    ep = EndpointTables("decep", "cdc_test_source", {"items": (["public"], ["id"])})
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE public.items (id bigint PRIMARY KEY, v text)")
        cur.execute("CREATE TABLE public.bulk (id int)")
    capture_run(ep, dsn, store, "r1")
    with conn.cursor() as cur:
        cur.execute("INSERT INTO public.bulk SELECT generate_series(1, 3000000)")
        cur.execute("INSERT INTO public.items VALUES (1, 'after the bulk')")
    t0 = time.monotonic()
    m = capture_run(ep, dsn, store, "r2", limits=CaptureLimits(idle_timeout_s=0.5))
    print(f"capture behind a 3M-row unpublished transaction: {time.monotonic() - t0:.1f}s")
    assert m.manifest.events == 1


def test_a_database_that_is_not_utf8_is_refused_before_a_slot_exists(pg, unique, tmp_path):
    name = f"enc_{unique}"
    pg.execute(f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    try:
        dsn = pg.dsn(name)
        pg.execute("CREATE TABLE public.items (id bigint PRIMARY KEY)", dbname=name)
        ep = EndpointTables("encep", "cdc_test_source", {"items": (["public"], ["id"])})
        with pytest.raises(PreflightError, match="encoding LATIN1"):
            capture_run(ep, dsn, LocalLanding(f"file://{tmp_path}/landing"), "r1")
        assert pg.execute(f"SELECT count(*) FROM pg_replication_slots WHERE database = '{name}'")[0][0] == 0
    finally:
        pg.execute(f"DROP DATABASE {name} WITH (FORCE)")
