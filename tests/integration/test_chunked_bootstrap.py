"""Online chunked bootstrap (issue #21) against a live source: chunks between WAL watermarks
under concurrent writes, resume after a kill, no transaction held across chunks, composite
non-integer keys, and a table without a key refused."""

from __future__ import annotations

import threading
import time

import psycopg2
import pytest
from cdc_lakehouse.bootstrap import chunked as chunked_mod
from cdc_lakehouse.bootstrap.bootstrap_table import bootstrap_table
from cdc_lakehouse.bootstrap.chunks import APPLICATION_NAME
from cdc_lakehouse.bootstrap.result import ChunkedBootstrapResult
from cdc_lakehouse.bootstrap.snapshot import BootstrapError
from cdc_lakehouse.columns import IS_CURRENT_COL, OP_COL, SHARD_COL
from cdc_lakehouse.feed.arrow import load_catalog_for
from cdc_lakehouse.history.maintain import maintain_history
from cdc_lakehouse.lake.snapshots import read_watermark
from cdc_lakehouse.lake.tables import source_columns_of, table_exists
from cdc_lakehouse.orchestration.approvals import lake_holds, unfinished_chunked_loads
from cdc_lakehouse.source.markers import CommitsNotVisible, wait_until_visible
from pyspark.sql import functions as F

from tests.conftest import make_config
from tests.helpers import assert_lake_equals_source
from tests.integration.conftest import HeldCommit, Source


def _chunked(s, name: str, chunk_rows: int, per_host: int = 2, **kw):
    shards = {"conn_id": "cdc_test_source", "database": s.db, "schemas": s.schemas}
    return make_config(
        name,
        [],
        source={"table": kw.pop("table", "block"), "shards": [shards]},
        bootstrap={"mode": "chunked", "chunk_rows": chunk_rows, "max_connections_per_host": per_host},
        **kw,
    )


class _Sampler:
    """pg_stat_activity of the bootstrap's chunk connections, every few milliseconds, each sample
    tagged with the number of chunks completed when it was taken (read before and after)."""

    def __init__(self, dsn: str):
        self.dsn, self.chunks_done = dsn, 0
        self.samples: list[tuple[int, int, object, object, str, float]] = []
        self.most_at_once = 0  # chunk connections working at the same moment
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def on_chunk(self, _state) -> bool:
        self.chunks_done += 1
        return False  # never pause

    def _run(self):
        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        with conn.cursor() as cur:
            while not self.stop.is_set():
                before = self.chunks_done
                cur.execute(
                    "SELECT pid, backend_xmin::text, xact_start, state, "
                    "extract(epoch FROM clock_timestamp() - xact_start) FROM pg_stat_activity "
                    "WHERE application_name = %s",
                    (APPLICATION_NAME,),
                )
                rows = cur.fetchall()
                # Working ones: a closed connection's backend can linger idle for a moment.
                self.most_at_once = max(self.most_at_once, sum(1 for r in rows if r[3] != "idle"))
                if self.chunks_done == before:  # otherwise a chunk ended while sampling: untagged
                    self.samples += [(before, pid, xmin, xs, st, age or 0.0) for pid, xmin, xs, st, age in rows]
                time.sleep(0.005)
        conn.close()


def _assert_nothing_held_across_chunks(sampler: _Sampler, r: ChunkedBootstrapResult, cap: int) -> None:
    """(3) No transaction of the bootstrap spans two chunks; idle between chunks means no xmin."""
    assert sampler.samples, "the sampler saw no chunk connection"
    by_xact: dict[tuple, set[int]] = {}
    for chunk, pid, _xmin, xact_start, _state, _age in sampler.samples:
        if xact_start is not None:
            by_xact.setdefault((pid, xact_start), set()).add(chunk)
    spanning = {k: v for k, v in by_xact.items() if len(v) > 1}
    assert not spanning, f"transactions seen during several chunks: {spanning}"
    held_idle = [x for x in sampler.samples if x[4] == "idle" and x[2] is not None]
    assert not held_idle, f"an idle chunk connection held an xmin: {held_idle[:3]}"
    longest = max(x[5] for x in sampler.samples)
    print(
        f"chunks {sampler.chunks_done}, samples {len(sampler.samples)}, longest xact seen {longest:.3f}s, "
        f"chunk connections at once {sampler.most_at_once}"
    )
    assert sampler.chunks_done == sum(r.chunks.values())
    # Both shards' chunks are read in one round, never above bootstrap.max_connections_per_host.
    assert sampler.most_at_once <= cap, sampler.most_at_once
    assert longest < 5.0, longest


def test_chunked_bootstrap_under_concurrent_writes_holds_nothing_between_chunks(source, spark, lake):
    """Two shards in chunks of 300 while a writer updates, deletes, changes keys and inserts at the
    end (the chunk being read); after capture and ingest the lake equals the source. Meanwhile
    pg_stat_activity shows every read transaction of the bootstrap inside one chunk, and its
    connection holding no xmin while idle between chunks."""
    s = source
    # No TOASTed values: a key change whose old key moved before its chunk was read leaves the
    # ingest no row to take the new key's unchanged TOAST value from (docs/bootstrap.md,
    # "Online chunked bootstrap", limits); every other change below is replayed against the chunks.
    s.wl.long_content_share = 0.0
    s.execute(
        *[f"UPDATE {schema}.block SET content = left(content, 60) WHERE length(content) > 60" for schema in s.schemas]
    )
    cfg = _chunked(s, f"cb_{s.db[-8:]}", 300, per_host=1)  # two shards on one server, one connection
    s.capture()  # the slot exists before the first chunk
    stop, errors, steps = threading.Event(), [], []

    def writer():
        try:
            while not stop.is_set():
                steps.append(s.wl.step(120, pk_changes=2))
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    sampler = _Sampler(s.dsn)
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    sampler.thread.start()
    try:
        r = s.bootstrap(cfg, should_stop=sampler.on_chunk)
    finally:
        stop.set()
        sampler.stop.set()
        t.join(timeout=120)
        sampler.thread.join(timeout=30)
    assert not errors, errors
    assert len(steps) >= 2, "the workload should have written while the bootstrap ran"
    assert r.mode == "chunked" and r.done, r
    assert all(n >= 5 for n in r.chunks.values()), r.chunks
    wm = read_watermark(spark, lake.qualified(cfg.current_table))
    assert set(wm.shards) == {shard for _, _, shard in cfg.shards()}

    _assert_nothing_held_across_chunks(sampler, r, cfg.bootstrap.max_connections_per_host)

    m = s.capture()
    assert m.manifest.bootstrap_markers, "the capture should have recorded the chunks' watermarks"
    marks = [x for x in m.manifest.bootstrap_markers if x.get("table") == cfg.name]
    assert {x["mark"] for x in marks} == {"low", "high"}
    s.ingest(cfg, m.manifest.run_id)
    assert_lake_equals_source(spark, lake, cfg, s.dsn)


def test_killed_chunked_bootstrap_resumes_after_the_last_recorded_chunk(source, spark, lake, monkeypatch):
    s = source
    cfg = _chunked(s, f"ck_{s.db[-8:]}", 400)
    s.capture()
    first = cfg.shards()[0][2]

    def die(name):
        if name == "bootstrap_chunk_applied:2":
            raise RuntimeError("killed at " + name)

    monkeypatch.setattr(chunked_mod, "crash_point", die)
    with pytest.raises(RuntimeError, match="killed at bootstrap_chunk_applied:2"):
        s.bootstrap(cfg)
    monkeypatch.undo()
    # What the bootstrap DAG's review sees (#53): every shard resumes, so no approval is asked.
    catalog = load_catalog_for(lake)
    every = frozenset(shard for _, _, shard in cfg.shards())
    assert unfinished_chunked_loads(catalog, lake, cfg.name) == every
    holds = lake_holds(catalog, cfg.current_table)
    assert holds is not None and holds.rows > 0 and set(holds.positions) == every, holds
    # Round 2 (chunk 2 of every shard) was merged but not recorded: the rerun reads it again.
    s.execute(
        f"UPDATE {s.schemas[0]}.block SET version = version + 7 WHERE id IN (SELECT id FROM {s.schemas[0]}.block ORDER BY id LIMIT 50)",
        f"DELETE FROM {s.schemas[0]}.permission WHERE block_id IN (SELECT id FROM {s.schemas[0]}.block ORDER BY id DESC LIMIT 5)",
        f"DELETE FROM {s.schemas[0]}.block WHERE id IN (SELECT id FROM {s.schemas[0]}.block ORDER BY id DESC LIMIT 5)",
    )
    r = s.bootstrap(cfg)
    assert r.resumed == {shard: 1 for _, _, shard in cfg.shards()}, r
    assert r.done, r
    progress = spark.table(lake.qualified(lake.meta_table("bootstrap_progress"))).filter(
        f"table_name = '{cfg.name}' AND shard = '{first}'"
    )
    chunks = sorted(row["chunk"] for row in progress.collect())
    assert chunks == sorted(set(chunks)) and chunks[:3] == [0, 1, 2], chunks
    assert unfinished_chunked_loads(catalog, lake, cfg.name) == frozenset()
    m = s.capture()
    s.ingest(cfg, m.manifest.run_id)
    assert_lake_equals_source(spark, lake, cfg, s.dsn)


def _merge_plans(monkeypatch) -> list[str]:
    """The plan of every chunk round's MERGE (lake.merge.run_merge), as EXPLAIN prints it, in a
    list filled as they run."""
    from cdc_lakehouse.lake.merge import merge_sql

    plans: list[str] = []
    real = chunked_mod.run_merge

    def explained(spark_, cfg, target, source, columns, props, truncated=(), within=None):
        sql = merge_sql(cfg, target, source, columns, list(truncated), within)
        plans.append(spark_.sql("EXPLAIN " + sql).collect()[0][0])
        return real(spark_, cfg, target, source, columns, props, truncated, within)

    monkeypatch.setattr(chunked_mod, "run_merge", explained)
    return plans


def test_composite_text_key_chunks_in_key_order(source, spark, lake, monkeypatch):
    """(text, int) key with values that sort differently by byte and by locale (and an empty
    one); chunks of 7. Every round's MERGE hands its key range to the Iceberg scan of the current
    table, so the scan skips the files of earlier rounds instead of reading the table so far."""
    s = source
    plans = _merge_plans(monkeypatch)
    names = ["Zoë", "zebra", "apple", "Apple", "a b", "a-b", "ß", "É", "e", "10", "9", ""]
    for schema in s.schemas:
        s.execute(
            f"CREATE TABLE {schema}.doc (tenant text NOT NULL, n int NOT NULL, body text, PRIMARY KEY (tenant, n))",
            f"INSERT INTO {schema}.doc SELECT t, g, t || ':' || g FROM unnest(%s::text[]) t, generate_series(1, 5) g"
            % ("ARRAY[" + ",".join("'" + x + "'" for x in names) + "]"),
        )
    cfg = _chunked(s, f"cc_{s.db[-8:]}", 7, table="doc", primary_key=["tenant", "n"])
    tables = {**s.tables(), "doc": (s.schemas, ["tenant", "n"])}
    r = bootstrap_table(spark, lake, cfg, run_id="c1", all_endpoint_tables={s.endpoint: tables})
    assert r.rows == 2 * len(names) * 5, r
    assert all(n == -(-len(names) * 5 // 7) for n in r.chunks.values()), r.chunks
    assert_lake_equals_source(spark, lake, cfg, s.dsn)
    assert len(plans) == max(r.chunks.values()), len(plans)  # one MERGE per round
    for plan in plans:
        scan = next(
            line for line in plan.splitlines() if "IcebergScan" in line and cfg.current_table.split(".")[-1] in line
        )
        assert "tenant >=" in scan and "n >=" in scan and "_cdc_shard =" in scan, scan


def test_table_without_key_is_refused_with_the_reason(source, spark, lake):
    s = source
    for schema in s.schemas:
        s.execute(f"CREATE TABLE {schema}.nokey (id bigint, v text)", f"INSERT INTO {schema}.nokey VALUES (1, 'a')")
    cfg = _chunked(s, f"cn_{s.db[-8:]}", 100, table="nokey")
    tables = {**s.tables(), "nokey": (s.schemas, ["id"])}
    with pytest.raises(BootstrapError) as err:
        bootstrap_table(spark, lake, cfg, run_id="n1", all_endpoint_tables={s.endpoint: tables})
    msg = str(err.value)
    assert cfg.name in msg and "nokey" in msg and "ADD PRIMARY KEY" in msg and "bootstrap.mode: snapshot" in msg
    assert not table_exists(spark, lake.qualified(cfg.current_table)), "nothing may be written"


def test_key_change_before_its_chunks_is_stale_not_held_back(source, spark, lake):
    """A key change a -> b with an unchanged TOASTed value, made between two rounds and before the
    chunks holding a and b were read: the later chunk reads b with its value at an L after the
    change, so the ingest must see the change's event as stale (the MERGE skips it), not hold it
    back in quarantine for a value it lacks."""
    s = source
    schema = s.schemas[0]
    a, b = s.wl.next_id[schema] - 1, s.wl.next_id[schema] - 10  # both in the shard's last chunk
    big = "t" * 5000  # TOASTed: the key change's new tuple carries it as "unchanged"
    s.execute(
        f"DELETE FROM {schema}.permission WHERE block_id IN ({a}, {b})",
        f"DELETE FROM {schema}.block WHERE id = {b}",  # b is free, below the shard's last key
        f"UPDATE {schema}.block SET content = '{big}' WHERE id = {a}",
    )
    cfg = _chunked(s, f"ct_{s.db[-8:]}", 500)
    s.capture()
    r = s.bootstrap(cfg, should_stop=lambda _state: True)  # pauses after the first round
    assert r.paused and not r.done, r
    s.execute(f"UPDATE {schema}.block SET id = {b} WHERE id = {a}")
    r = s.bootstrap(cfg)
    assert r.done, r
    m = s.capture()
    out = s.ingest(cfg, m.manifest.run_id)
    assert out.metrics.quarantined == 0, out
    q = spark.table(lake.qualified(lake.meta_table("quarantine"))).filter(f"table_name = '{cfg.name}'")
    assert q.count() == 0, q.collect()
    assert_lake_equals_source(spark, lake, cfg, s.dsn)
    assert spark.table(lake.qualified(cfg.current_table)).filter(f"id = {b}").first()["content"] == big


def test_a_key_deleted_after_its_chunks_low_marker_stays_deleted(pg, source_uri, spark, lake, unique, monkeypatch):
    """A key the chunk read, deleted at the source after the chunk's L, with the delete captured and
    ingested before the chunk is applied: the delete found no row in the lake, so the LSN guard has
    nothing to compare the chunk's row with. Only the changelog's delete after L keeps the chunk
    from bringing the key back. The history (docs/history-tables.md, "Late rows") runs after that
    ingest too: the chunk's row of a key the stream updated after L arrives late there, and is
    dropped as the current table's MERGE ignores it, so both end with the stream's row."""
    s = Source(pg, spark, lake, unique, blocks=30)
    try:
        schema = s.schemas[0]
        victim, updated = s.wl.first_id[schema] + 3, s.wl.first_id[schema] + 5
        cfg = _chunked(s, f"cd_{s.db[-8:]}", 1000, history={"enabled": True})  # one chunk per shard
        s.capture()
        real, calls = chunked_mod._apply_chunks, []

        def delete_then_apply(*args, **kwargs):
            if not calls:  # between the chunk's read and its apply
                s.execute(
                    f"DELETE FROM {schema}.permission WHERE block_id = {victim}",
                    f"DELETE FROM {schema}.block WHERE id = {victim}",
                    # Every value in the event: the ingest can insert the row the lake lacks.
                    f"UPDATE {schema}.block SET version = version + 1, content = 'after L' WHERE id = {updated}",
                )
                m = s.capture()
                s.ingest(cfg, m.manifest.run_id)
                cl = spark.table(lake.qualified(cfg.changelog_table))
                assert cl.filter((cl.id == victim) & (cl[OP_COL] == "d")).count() == 1
                assert maintain_history(spark, lake, cfg).mode == "full"
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(chunked_mod, "_apply_chunks", delete_then_apply)
        r = s.bootstrap(cfg)
        monkeypatch.undo()
        assert r.done and calls, r
        assert spark.table(lake.qualified(cfg.current_table)).filter(f"id = {victim}").count() == 0
        h = maintain_history(spark, lake, cfg)
        assert (h.mode, h.late) == ("incremental", 1), h  # the updated key's chunk row
        s.ingest(cfg, s.capture().manifest.run_id)
        assert_lake_equals_source(spark, lake, cfg, s.dsn)
        maintain_history(spark, lake, cfg)
        hist, lake_now = spark.table(lake.qualified(cfg.history_table)), spark.table(lake.qualified(cfg.current_table))
        cols = [SHARD_COL, *[c for c, _ in source_columns_of(spark, lake.qualified(cfg.current_table), cfg)]]
        open_versions = hist.filter(F.col(IS_CURRENT_COL)).select(*cols)
        extra, missing = (
            open_versions.exceptAll(lake_now.select(*cols)),
            lake_now.select(*cols).exceptAll(open_versions),
        )
        assert extra.isEmpty() and missing.isEmpty(), (extra.select("id").collect(), missing.select("id").collect())
        assert hist.filter(f"id = {updated}").select("content").collect() == [("after L",)]
    finally:
        s.close()


def test_typed_keys_an_ingest_wrote_before_their_chunk_are_matched_not_doubled(source, spark, lake, monkeypatch):
    """A (timestamptz, date, numeric) key, chunks of 7. After the first round the source updates a
    row of a later chunk, inserts one inside a later chunk's range and deletes one; capture and
    ingest apply them. The later rounds' MERGEs carry their key range as literals of these types
    (micros, days, decimal text), and must still find those rows: the LSN guard keeps the
    stream's version, where a range that missed them would insert a second row per key."""
    s = source
    key = ["at", "day", "amount"]
    for schema in s.schemas:
        s.execute(
            f"CREATE TABLE {schema}.ev (at timestamptz NOT NULL, day date NOT NULL, amount numeric(12,3) NOT NULL, "
            "body text, PRIMARY KEY (at, day, amount))",
            f"INSERT INTO {schema}.ev SELECT timestamptz '2024-11-03 01:00:00-04' + g * interval '17 min 0.000123 s', "
            "date '2024-02-20' + g, g * 1.125 - 20, 'v' || g FROM generate_series(1, 40) g",
        )
    tables = s.tables()
    monkeypatch.setattr(s, "tables", lambda: {**tables, "ev": (s.schemas, key)})
    plans = _merge_plans(monkeypatch)
    cfg = _chunked(s, f"cy_{s.db[-8:]}", 7, table="ev", primary_key=key)
    s.capture()
    r = s.bootstrap(cfg, should_stop=lambda _state: True)  # pauses after the first round
    assert r.paused and not r.done, r
    at = "timestamptz '2024-11-03 01:00:00-04' + {} * interval '17 min 0.000123 s'"
    for schema in s.schemas:
        s.execute(
            f"UPDATE {schema}.ev SET body = 'streamed' WHERE at = {at.format(38)}",
            f"INSERT INTO {schema}.ev VALUES ({at.format(30)} + interval '1 s', date '2024-03-21', 13.375, 'new')",
            f"DELETE FROM {schema}.ev WHERE at = {at.format(33)}",
        )
    s.ingest(cfg, s.capture().manifest.run_id)
    r = s.bootstrap(cfg)
    assert r.done, r
    s.ingest(cfg, s.capture().manifest.run_id)
    assert_lake_equals_source(spark, lake, cfg, s.dsn)
    lake_rows = spark.table(lake.qualified(cfg.current_table))
    assert lake_rows.count() == lake_rows.select("_cdc_shard", *key).distinct().count() == 2 * 40
    assert lake_rows.filter("body = 'streamed'").count() == 2
    for plan in plans:
        scan = next(
            line for line in plan.splitlines() if "IcebergScan" in line and "filters=" in line and "at >=" in line
        )
        assert "day >=" in scan and "amount >=" in scan, scan


def test_a_commit_below_a_chunks_low_marker_not_visible_yet_is_waited_for(pg, source_uri, spark, lake, unique):
    """An update whose commit record lies below a chunk's low marker L but which is not visible
    yet when the chunk is read (its COMMIT waits for a synchronous standby): the chunk's row at L
    would carry the older value, and the update's event, below L, would lose to it whichever of
    the two the lake got first. The reader waits after L until such commits are visible."""
    s = Source(pg, spark, lake, unique, blocks=30)
    try:
        schema = s.schemas[0]
        victim = s.wl.next_id[schema] - 1  # in the shard's last chunk
        cfg = _chunked(s, f"cv_{s.db[-8:]}", 20)
        s.capture()
        r = s.bootstrap(cfg, should_stop=lambda _state: True)  # the slot and P0 exist: nothing waits for them
        assert r.paused and not r.done, r
        with HeldCommit(pg, s.dsn, f"UPDATE {schema}.block SET content = 'held' WHERE id = {victim}"):
            r = s.bootstrap(cfg)
        assert r.done, r
        s.ingest(cfg, s.capture().manifest.run_id)
        assert spark.table(lake.qualified(cfg.current_table)).filter(f"id = {victim}").first()["content"] == "held"
        assert_lake_equals_source(spark, lake, cfg, s.dsn)
    finally:
        s.close()


@pytest.mark.core
def test_a_low_marker_waits_for_running_statements_not_for_idle_transactions(pg):
    """What wait_until_visible waits for, on a real server: a transaction running a statement may
    be committing below the marker and is waited for (here until the limit, with an error naming
    it); one idle in its block runs no COMMIT, so its commit comes after the marker."""
    dsn = pg.dsn("src")
    idle, busy, own = (psycopg2.connect(dsn) for _ in range(3))
    own.autocommit = True
    try:
        with idle.cursor() as cur:
            cur.execute("SELECT pg_current_xact_id()")  # holds an xid, then sits idle in its block

        def run_long() -> None:
            with busy.cursor() as cur:
                cur.execute("SELECT pg_current_xact_id(), pg_sleep(4)")
            busy.rollback()

        t = threading.Thread(target=run_long, daemon=True)
        t.start()
        pids = (idle.get_backend_pid(), busy.get_backend_pid())
        with own.cursor() as cur:
            for _ in range(300):  # until the long statement runs with its xid
                cur.execute("SELECT state, backend_xid FROM pg_stat_activity WHERE pid = %s", (pids[1],))
                state, xid = cur.fetchone()
                if state == "active" and xid is not None:
                    break
                time.sleep(0.01)
            with pytest.raises(CommitsNotVisible) as err:
                wait_until_visible(cur, "t shard s0 chunk 3", 0.3)
            assert f"pid {pids[1]}, state active" in str(err.value) and f"pid {pids[0]}" not in str(err.value)
            assert "t shard s0 chunk 3" in str(err.value) and "pg_read_all_stats" in str(err.value)
            t.join()
            wait_until_visible(cur, "t shard s0 chunk 3", 5)  # only the idle one holds an xid: no error
    finally:
        for c in (idle, busy, own):
            c.close()
