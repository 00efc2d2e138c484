"""runtime.phases.releasing_kept: which checkpoints a block releases, and when (pure logic, on
stand-ins for pyspark's Connect frames; the release itself against a real server is asserted in
tests/integration/test_ingest.py, test_ingest_stays_within_its_spark_job_budget)."""

from __future__ import annotations

import gc

import pytest
from cdc_lakehouse.runtime import phases


class CachedRemoteRelation:
    """Stands in for pyspark.sql.connect.plan.CachedRemoteRelation: asks to drop its server-side
    copy when collected, unless its id was cleared."""

    asked: list[str] = []

    def __init__(self, relation_id: str) -> None:
        self._relation_id: str | None = relation_id

    def __del__(self) -> None:
        if self._relation_id is not None:
            CachedRemoteRelation.asked.append(self._relation_id)


class Frame:
    """A Connect frame over a plan (frames derived from a checkpoint share its plan)."""

    def __init__(self, plan: CachedRemoteRelation) -> None:
        self._plan = plan


@pytest.fixture(autouse=True)
def asked():
    CachedRemoteRelation.asked = []
    yield CachedRemoteRelation.asked


def test_a_checkpoint_still_read_through_a_derived_frame_is_released_once_at_the_end(asked):
    with phases.releasing_kept():
        kept = phases._kept(connect=True, df=Frame(CachedRemoteRelation("a")))
        derived = Frame(kept._plan)  # df.filter(...): the same plan underneath
        del kept
        gc.collect()
        assert asked == []  # still read through `derived`
    assert asked == ["a"]
    del derived
    gc.collect()
    assert asked == ["a"], "asked once, not again when collected"


def test_a_checkpoint_python_freed_inside_the_block_is_not_asked_again(asked):
    with phases.releasing_kept():
        phases._kept(connect=True, df=Frame(CachedRemoteRelation("b")))
        gc.collect()
        assert asked == ["b"]  # freed by Python: its own request
    assert asked == ["b"]


def test_nothing_is_released_after_an_error_and_nested_blocks_release_their_own(asked):
    outer_plan = CachedRemoteRelation("outer")
    with pytest.raises(RuntimeError):
        with phases.releasing_kept():
            kept = phases._kept(connect=True, df=Frame(outer_plan))
            with phases.releasing_kept():
                inner = phases._kept(connect=True, df=Frame(CachedRemoteRelation("inner")))
            assert asked == ["inner"] and inner._plan._relation_id is None
            raise RuntimeError("the stage failed")
    assert asked == ["inner"] and kept._plan._relation_id == "outer"  # left to the session's end
    outer_plan._relation_id = None  # not asked when the test's references go


def test_outside_a_block_nothing_is_recorded():
    assert phases._KEPT.get() is None
    phases._kept(connect=True, df=Frame(CachedRemoteRelation("c")))
    assert phases._KEPT.get() is None
