"""orchestration.approvals: when a bootstrap run waits for a person, and what it shows (#53).
The wait itself, an approval and a rejection run against a real Airflow in
tests/e2e/test_scheduler.py."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.orchestration.approvals import (
    LakeHolds,
    RebootstrapPlan,
    approvals_enabled,
    shards_asked,
)

CFG = TableConfig.model_validate(
    {
        "name": "t",
        "source": {
            "table": "t",
            "shards": [{"conn_id": "a", "schemas": ["s0", "s1"]}, {"conn_id": "b", "schemas": ["s2"]}],
        },
        "primary_key": ["id"],
    }
)
HOLDS = LakeHolds(
    rows=1234,
    snapshot_id=42,
    committed_at=datetime(2026, 11, 30, 3, 0, tzinfo=UTC),
    positions={"s0": (1 << 32) + 0x10, "s1": 0x20},
    fresh_to={"s0": "2026-11-30T02:59:00+00:00"},
)


def _plan(**kw) -> RebootstrapPlan:
    base = {"table": "t", "lake_table": "ns.t", "shards": ("s0", "s1"), "columns": (), "lake": HOLDS}
    return RebootstrapPlan(**{**base, **kw})


def test_a_table_holding_rows_at_a_complete_position_needs_an_approval():
    assert _plan().needs_approval and _plan().reason_not_needed == ""
    assert _plan(columns=("note",)).needs_approval  # a column backfill rewrites every row
    # A run that resumes some shards and loads another anew still asks.
    assert _plan(resuming=frozenset({"s0"})).needs_approval


@pytest.mark.parametrize(
    ("plan", "why"),
    [
        (_plan(lake=None), "first load"),
        (_plan(lake=LakeHolds(0, 1, HOLDS.committed_at, {"s0": 5})), "no rows"),
        (_plan(resuming=frozenset({"s0", "s1", "s2"})), "resumes the unfinished chunked load of s0, s1"),
        (_plan(approvals_on=False), "approvals are off"),
    ],
)
def test_what_goes_ahead_without_a_person_and_says_why(plan, why):
    assert not plan.needs_approval and why in plan.reason_not_needed


def test_the_approval_shows_the_shards_their_positions_and_the_rows_it_replaces():
    plan = _plan(source_rows={"s0": 1000, "s1": None})
    assert plan.subject() == "re-bootstrap of t: 2 shard(s)"
    body = plan.body()
    assert "1,234 rows" in body and "snapshot 42" in body and "2026-11-30 03:00:00" in body
    assert "| s0 | 1/10 | 2026-11-30T02:59:00+00:00 | 1,000 |" in body
    assert "| s1 | 0/20 | - | unknown |" in body
    assert "Reject to leave the table as it is" in body
    backfill = _plan(columns=("note", "qty"))
    assert backfill.subject().startswith("backfill of column(s) note, qty of t")
    assert "other columns and rows stay as they are" in backfill.body()


def test_the_shards_of_a_run_come_from_its_params():
    assert shards_asked(CFG, {}) == ("s0", "s1", "s2")
    assert shards_asked(CFG, {"shards": ["s2", "s0"]}) == ("s0", "s2")  # in the table's order
    assert shards_asked(CFG, {"endpoint": CFG.source.shards[1].endpoint_id}) == ("s2",)


def test_one_environment_switch_turns_every_approval_off():
    assert approvals_enabled({}) and approvals_enabled({"CDC_APPROVALS": "on"})
    for off in ("off", "OFF", "false", "0", "no"):
        assert not approvals_enabled({"CDC_APPROVALS": off})
    assert (
        TableConfig.model_validate({**CFG.model_dump(), "approvals": {"rebootstrap": False}}).approvals.rebootstrap
        is False
    )


def test_a_quarantine_replay_asks_when_there_is_something_to_replay_and_shows_why():
    from cdc_lakehouse.orchestration.approvals import QuarantineHolds, ReplayPlan

    holds = QuarantineHolds(1200, 3, (("column score: value '1.5' does not fit decimal(8,4) | x", 1100), ("op", 100)))
    plan = ReplayPlan(table="t", lake_table="ns.t", quarantine=holds)
    assert plan.needs_approval and plan.subject() == "quarantine replay of t: 1,200 event(s)"
    body = plan.body()
    assert "**1,200 quarantined event(s)**" in body and "3 held-back row(s)" in body
    assert "| column score: value '1.5' does not fit decimal(8,4) / x | 1,100 |" in body  # a `|` kept out of the table
    assert not ReplayPlan(table="t", lake_table="ns.t", quarantine=QuarantineHolds(0, 3)).needs_approval
    off = ReplayPlan(table="t", lake_table="ns.t", quarantine=holds, approvals_on=False)
    assert not off.needs_approval and "approvals are off" in off.reason_not_needed


def test_an_audit_repair_asks_only_for_what_the_audit_left_above_the_limit():
    from cdc_lakehouse.orchestration.approvals import RepairPlan

    plan = RepairPlan(
        table="t", audit_run="r", limit=3, repair_on=True, shards=(("s0", 4, '[{"id": 1}]'), ("s1", 0, ""))
    )
    assert plan.has_work and plan.needs_approval and plan.pending == 4
    assert '| s0 | 4 | [{"id": 1}] |' in plan.body() and "| s1 |" not in plan.body()
    for quiet in (
        RepairPlan(table="t", audit_run="r", limit=None, repair_on=True, shards=(("s0", 4, ""),)),  # approvals off
        RepairPlan(table="t", audit_run="r", limit=3, repair_on=True, shards=(("s0", 4, ""),), repaired=4),
        RepairPlan(table="t", audit_run="r", limit=5, repair_on=True, shards=(("s0", 4, ""),)),
        RepairPlan(table="t", audit_run="r", limit=3, repair_on=False, shards=(("s0", 4, ""),)),
    ):
        assert not quiet.has_work, quiet
    # CDC_APPROVALS=off lifts the limit: the audit repairs at once, whatever the number.
    assert CFG.approvals.repair_limit({}) == 1000 and CFG.approvals.repair_limit({"CDC_APPROVALS": "off"}) is None
