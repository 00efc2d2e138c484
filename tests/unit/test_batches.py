"""lake.batches: the batch id is a function of the data a batch applies, nothing else."""

from __future__ import annotations

import pytest
from cdc_lakehouse.lake.batches import BATCH_PROP, BatchId
from cdc_lakehouse.runtime.failpoints import FAIL_ENV, FailpointHit, crash_point


def test_batch_id_is_deterministic_and_names_its_positions():
    start = {"v": 1, "shards": {"s0": {"lsn": 10}, "s1": {"lsn": 12}}}
    end = {"v": 1, "shards": {"s0": {"lsn": 20}, "s1": {"lsn": 12}}}
    a = BatchId.of("ingest:lake.t", start, end)
    # A retry builds its positions afresh (other dict order): the same id.
    again = BatchId.of("ingest:lake.t", {"shards": {"s1": {"lsn": 12}, "s0": {"lsn": 10}}, "v": 1}, dict(end))
    assert a == again and a.props() == {BATCH_PROP: a.value}
    assert BatchId.of("ingest:lake.t", start, {"v": 1, "shards": {"s0": {"lsn": 21}, "s1": {"lsn": 12}}}) != a
    assert BatchId.of("ingest:lake.u", start, end) != a
    assert BatchId.of("ingest:lake.t", end, end) != a


def test_fail_env_raises_at_its_point_only(monkeypatch):
    monkeypatch.setenv(FAIL_ENV, "here")
    crash_point("elsewhere")
    with pytest.raises(FailpointHit, match="here"):
        crash_point("here")


def test_hold_at_holds_the_first_thread_only_until_released():
    import threading

    from cdc_lakehouse.runtime.failpoints import hold_at

    passed = []
    with hold_at("publish") as hold:
        first = threading.Thread(target=lambda: (crash_point("publish"), passed.append("first")))
        first.start()
        assert hold.reached.wait(10)
        crash_point("publish")  # a second writer passes while the first one waits
        passed.append("second")
        assert passed == ["second"]
        hold.release.set()
        first.join(10)
    assert passed == ["second", "first"]
    crash_point("publish")  # outside the block: a no-op


def test_fenced_commit_branches_are_named_with_the_time_they_were_made():
    from datetime import UTC, datetime

    from cdc_lakehouse.lake.commits import branch_made_at

    assert branch_made_at("cdc_w_20260101120000_0a1b2c3d") == datetime(2026, 1, 1, 12, tzinfo=UTC)
    # Branches of anyone else, and names that merely start like ours, are never taken for ours.
    for other in ("main", "audit", "cdc_w_2026_0a1b2c3d", "cdc_w_20260101120000_0a1b2c3d_x"):
        assert branch_made_at(other) is None
