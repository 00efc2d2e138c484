"""orchestration.tasks: the pure logic Airflow tasks run (no Airflow, Spark or server)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cdc_lakehouse.orchestration.tasks import schedule_tick_passed
from lazy_object_proxy import Proxy


def test_a_feed_output_is_maintained_in_the_first_run_after_each_schedule_tick():
    now = datetime(2026, 1, 2, 4, 0, tzinfo=UTC)
    assert schedule_tick_passed("15 3 * * *", now - timedelta(hours=1), now)  # 03:15 passed since 03:00
    assert not schedule_tick_passed("15 3 * * *", now - timedelta(minutes=30), now)  # already ran after it
    assert not schedule_tick_passed("15 3 * * *", None, now)  # first run ever: nothing to maintain yet
    assert schedule_tick_passed("0 * * * *", now - timedelta(minutes=61), now)
    # What Airflow passes as prev_start_date_success: lazy proxies, of None on a DAG's first run.
    assert not schedule_tick_passed("15 3 * * *", Proxy(lambda: None), now)
    assert schedule_tick_passed("15 3 * * *", Proxy(lambda: now - timedelta(hours=1)), now)
