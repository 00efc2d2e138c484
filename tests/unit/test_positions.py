"""Pure rules about positions: which landing runs a shard may use, and where a capture starts."""

from __future__ import annotations

import pytest
from cdc_lakehouse.capture.positions import ATTEMPTS_DIR, start_position
from cdc_lakehouse.ingest.backfill import columns_to_backfill, quiet_shard_fills
from cdc_lakehouse.ingest.schema import known_columns
from cdc_lakehouse.landing.errors import CoverageError, SourceIdentityChanged
from cdc_lakehouse.landing.format import Manifest, SchemaChange
from cdc_lakehouse.landing.reader import EndpointSchemaChange, Plan, check_coverage, same_source_manifests
from cdc_lakehouse.source.publication import identity_mismatch, timeline_history
from cdc_lakehouse.source.slots import SlotState
from cdc_lakehouse.watermark import ShardPosition, Watermark

from tests.conftest import make_config

IDENT = {"system_identifier": "1", "timeline": 1, "database": "db"}


def cfg():
    return make_config(
        "t", [], source={"table": "t", "shards": [{"conn_id": "c", "database": "db", "schemas": ["s0"]}]}
    )


def wm(lsn=100, ts="2026-01-01T00:00:00+00:00", **extra) -> dict[str, ShardPosition]:
    """The shard positions of a watermark."""
    return watermark(lsn, ts, **extra).shards


def watermark(lsn=100, ts="2026-01-01T00:00:00+00:00", **extra) -> Watermark:
    return Watermark.from_dict(
        {"shards": {"db.s0": {"lsn": lsn, "ts": ts, "endpoint": "c__db", "source": IDENT, **extra}}}
    )


def manifest(
    run, end, *, ident=IDENT, finished="2026-01-02T00:00:00+00:00", published=("s0.t",), start=None, at_start=None
) -> Manifest:
    return Manifest(
        run_id=run,
        end_lsn=end,
        start_lsn=start,
        source_identity=ident,
        finished_at=finished,
        published=list(published),
        published_at_start=list(published if at_start is None else at_start),
        publication="p",
    )


SHARDS = [("s0", "db.s0")]


def announced(**change) -> EndpointSchemaChange:
    """A schema change as a run of the shard's endpoint announced it."""
    return EndpointSchemaChange("c__db", SchemaChange(**change))


def test_identity_mismatch_names_what_changed():
    assert identity_mismatch(IDENT, dict(IDENT)) is None
    assert identity_mismatch(IDENT, None) is None  # unknown: older manifests
    assert identity_mismatch(IDENT, {**IDENT, "timeline": 2}) == "timeline 1 -> 2"


def test_runs_of_another_server_stop_the_shard_but_older_history_is_skipped():
    runs = [
        manifest("r1", 90, ident={**IDENT, "database": "old"}, finished="2025-12-31T00:00:00+00:00"),
        manifest("r2", 120),
    ]
    assert [m.run_id for m in same_source_manifests(cfg(), "c__db", SHARDS, wm(), runs)] == ["r2"]
    with pytest.raises(SourceIdentityChanged, match="timeline 1 -> 2"):
        same_source_manifests(cfg(), "c__db", SHARDS, wm(), [manifest("r3", 130, ident={**IDENT, "timeline": 2})])
    with pytest.raises(SourceIdentityChanged, match="endpoint other"):
        same_source_manifests(cfg(), "c__db", SHARDS, wm(endpoint="other"), [])


def test_a_promoted_standby_compares_up_to_where_its_history_left_the_old_timeline():
    """#52: a promoted standby of the same cluster (timeline 2, whose history says timeline 1
    ended at LSN 150) continues a shard whose lake position (100) lies on the shared part of
    the WAL; a position past the switch point (the old primary had changes the standby never
    got), another cluster, or a timeline the history does not list still stop the shard."""
    promoted = {**IDENT, "timeline": 2, "history": timeline_history("1\t0/96\tno recovery target specified\n")}
    assert promoted["history"] == {"1": 150}
    assert identity_mismatch(IDENT, promoted, 100) is None
    assert identity_mismatch(IDENT, promoted, 150) is None
    assert "left it at 0/96, below the position 0/97" in (identity_mismatch(IDENT, promoted, 151) or "")
    assert identity_mismatch(IDENT, promoted) == "timeline 1 -> 2"  # no position: not compared
    assert identity_mismatch(IDENT, {**promoted, "system_identifier": "2"}, 100) is not None
    assert "history does not show it" in (identity_mismatch({**IDENT, "timeline": 3}, promoted, 100) or "")
    # Timeline 2 reached twice, by two standbys promoted apart: different WAL.
    other = {**promoted, "history": {"1": 140}}
    assert identity_mismatch(promoted, other, 100) == "timeline 2 of two different histories"
    runs = [manifest("r2", 120), manifest("r3", 200, ident=promoted)]
    assert [m.run_id for m in same_source_manifests(cfg(), "c__db", SHARDS, wm(100), runs)] == ["r2", "r3"]
    with pytest.raises(SourceIdentityChanged, match="timeline 1 -> 2"):
        same_source_manifests(cfg(), "c__db", SHARDS, wm(160), runs)
    # A run of the old primary past the switch point, not ingested yet, then the promoted
    # server's: the batch would hold changes the new server never had beside its own. Refused.
    lossy = [manifest("r2", 160), manifest("r3", 200, ident=promoted)]
    with pytest.raises(SourceIdentityChanged, match="below the position 0/A0"):
        same_source_manifests(cfg(), "c__db", SHARDS, wm(100), lossy)
    # Once the position is on the new timeline, the old timeline's runs below the switch point
    # still compare (their events are below the position: applied), whatever the clocks say.
    after = wm(180, source=promoted, ts="2020-01-01T00:00:00+00:00")
    assert [m.run_id for m in same_source_manifests(cfg(), "c__db", SHARDS, after, runs)] == ["r2", "r3"]


def test_a_run_counts_for_a_shard_only_if_it_was_published_for_the_whole_run():
    check_coverage(cfg(), "c__db", SHARDS, wm(), manifest("r1", 120))
    check_coverage(cfg(), "c__db", SHARDS, wm(), manifest("r0", 90, published=()))  # below the shard: irrelevant
    with pytest.raises(CoverageError, match="db.s0"):
        check_coverage(cfg(), "c__db", SHARDS, wm(), manifest("r1", 120, published=()))
    late = manifest("r1", 120, start=95, at_start=())
    check_coverage(cfg(), "c__db", SHARDS, wm(lsn=100), late)  # added mid-run, bootstrapped after the add
    with pytest.raises(CoverageError):
        check_coverage(cfg(), "c__db", SHARDS, wm(lsn=90), late)


def test_columns_seen_for_the_first_time_since_the_bootstrap_are_backfilled():
    plan = Plan(
        [],
        [],
        watermark(columns=["id", "v"]),
        schema_changes=[
            announced(table="s0.t", at_commit_lsn=150, first_seen=True, columns=["id", "v", "w"], added=[]),
            announced(table="s0.t", at_commit_lsn=160, columns=["id", "v", "w"], added=[]),
        ],
    )
    out = columns_to_backfill(cfg(), plan, watermark(columns=["id", "v"]))
    assert [(c.at_commit_lsn, c.added) for c in out] == [(150, ["w"])]
    assert plan.new_watermark.shards["db.s0"].columns == ["id", "v", "w"]


def test_a_quiet_shard_is_filled_once_at_its_new_position_and_only_when_it_moved():
    lake_cols = [("id", "bigint"), ("v", "int"), ("w", "int")]
    old = watermark(lsn=100, columns=["id", "v"])
    moved = watermark(lsn=180, columns=["id", "v"])
    out = quiet_shard_fills(cfg(), old, moved, lake_cols)
    assert [(c.table, c.endpoint, c.at_commit_lsn, c.added) for c in out] == [("s0.t", "c__db", 180, ["w"])]
    # Unmoved: a bootstrap's rows may sit at (100, -1), where the fill's changelog rows would go.
    assert quiet_shard_fills(cfg(), old, old, lake_cols) == []
    # Filled before: not again.
    assert quiet_shard_fills(cfg(), old, watermark(lsn=180, columns=["id", "v"], filled=["w"]), lake_cols) == []
    # A column dropped with keep_null stays NULL by choice.
    kept = make_config(
        "t",
        [],
        source={"table": "t", "shards": [{"conn_id": "c", "database": "db", "schemas": ["s0"]}]},
        schema_changes={"dropped_columns": {"w": "keep_null"}},
    )
    assert quiet_shard_fills(kept, old, moved, lake_cols) == []


def test_a_schema_carried_over_from_earlier_runs_shows_no_drop():
    """Known columns count for the drop check only for a shard that announced a schema in the batch:
    after a re-bootstrap its watermark knows newer columns than the manifests' carried-over schema."""
    wm_ = watermark(columns=["id", "v", "w"])
    quiet = Plan([], [], wm_, schema_changes=[])
    assert known_columns(cfg(), wm_, quiet) == {"s0": set()}
    change = announced(table="s0.t", at_commit_lsn=150, columns=["id", "v"], added=[])
    written = Plan([], [], wm_, schema_changes=[change])
    assert known_columns(cfg(), wm_, written) == {"s0": {"id", "v", "w"}}
    assert known_columns(cfg(), wm_, None) == {"s0": {"id", "v", "w"}}


class Store:
    def __init__(self, attempts):
        self.files = {f"ep/{ATTEMPTS_DIR}/{a['run_id']}.json": a for a in attempts}

    def list_names(self, rel):
        return sorted(k.rsplit("/", 1)[1] for k in self.files if k.startswith(rel + "/"))

    def read_json(self, rel):
        return self.files[rel]


def slot(confirmed):
    return SlotState("s", True, confirmed_flush=confirmed)


def test_a_keepalive_advance_of_failed_attempts_is_explained_anything_else_is_a_gap():
    prev = [Manifest(run_id="r0", end_lsn=100)]
    assert start_position(Store([]), "ep", prev, slot(100)) == (100, None)
    tried = [{"run_id": "a1", "from_lsn": 100, "started_at": "1"}, {"run_id": "a2", "from_lsn": 130, "started_at": "2"}]
    start, why = start_position(Store(tried), "ep", prev, slot(150))
    assert start == 100 and why["attempts"] == ["a1", "a2"]
    assert start_position(Store([]), "ep", prev, slot(150)) == (150, None)  # nobody we know moved it
    assert start_position(Store([{**tried[0], "from_lsn": 120}]), "ep", prev, slot(150)) == (150, None)


def test_a_quiet_shard_missing_a_column_added_elsewhere_is_no_drop():
    from cdc_lakehouse.ingest.schema import schema_actions

    c = cfg()
    lake = [("id", "bigint"), ("note", "string")]
    old = [{"name": "id", "type": "bigint", "lake_type": "bigint"}]
    # s0 had no write since `note` was added at another shard: its latest schema is the old one.
    ddl, errors = schema_actions(c, lake, [old], {"s0": old}, known={"s0": {"id"}})
    assert (ddl, errors) == ([], [])
    # s0 had `note` and lost it: a drop, which stops the table until a decision is configured.
    ddl, errors = schema_actions(c, lake, [old], {"s0": old}, known={"s0": {"id", "note"}})
    assert ddl == [] and "'note' was dropped" in errors[0]


def test_the_landing_buffer_is_bounded_in_bytes_not_only_rows(tmp_path):
    """A few events with huge TOAST values must not wait for batch_rows before reaching disk."""
    from cdc_lakehouse.landing.writer import ImageColumns, TableWriter

    consts = {"connector": "postgresql", "endpoint": "e", "host": "h", "db": "d", "ts_ms": 0, "run_id": "r"}
    w = TableWriter(tmp_path, consts, batch_rows=20_000, batch_bytes=3_000_000)
    big = "x" * 1_000_000
    image = ImageColumns((("id", "bigint"), ("body", "string")), "[]")
    for i in range(7):
        w.add("c", None, [str(i), big], None, "s0", image, 1, i, 1, i, 0, size=len(big))
    files = w.close()
    assert w.flushes == 3 and sum(f.rows for f in files) == 7  # 3 + 3 + the last 1
