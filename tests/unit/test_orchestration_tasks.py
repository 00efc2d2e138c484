"""orchestration.tasks: the pure logic Airflow tasks run (no Airflow, Spark or server)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

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


def test_a_connection_listing_a_primary_and_its_standbys_reaches_the_one_that_takes_writes(monkeypatch):
    """#52: an Airflow connection whose host is a list (host:port,host:port, as libpq takes it)
    gives every client the list and asks for the server that takes writes, so a failover needs no
    change of configuration; a single host stays as it was."""
    from airflow.models.connection import Connection
    from cdc_lakehouse.orchestration.tasks import source_uri_from_connection
    from cdc_lakehouse.settings import SourceEndpoint, source_uri

    conn = Connection(conn_id="src", conn_type="postgres", host="pg-a:5432,pg-b:5433", login="u", password="p@w,:")
    monkeypatch.setenv("AIRFLOW_CONN_SRC", conn.as_json())
    for uri in (source_uri_from_connection("src"), source_uri("src")):  # the task's form, and a job's
        ep = SourceEndpoint.from_uri(uri, "db")
        assert ep.hosts == (("pg-a", 5432), ("pg-b", 5433)) and ep.password == "p@w,:", (uri, ep)
        assert ep.dsn() == (
            "host='pg-a,pg-b' port='5432,5433' dbname='db' user='u' password='p@w,:' target_session_attrs='read-write'"
        )
        assert ep.jdbc_url() == "jdbc:postgresql://pg-a:5432,pg-b:5433/db?targetServerType=primary"
        assert ep.label == "pg-a:5432,pg-b:5433/db"
    # The port field is the port of each host that names none, in both forms.
    for host, port, hosts in (
        ("pg-a,pg-b", 6000, (("pg-a", 6000), ("pg-b", 6000))),
        ("pg-a:5432,pg-b:5433", 5432, (("pg-a", 5432), ("pg-b", 5433))),
        ("pg-a,[::1]:5433", 6000, (("pg-a", 6000), ("::1", 5433))),
    ):
        monkeypatch.setenv("AIRFLOW_CONN_SRC", Connection(conn_type="postgres", host=host, port=port).as_json())
        for uri in (source_uri_from_connection("src"), source_uri("src")):
            assert SourceEndpoint.from_uri(uri).hosts == hosts, (host, port, uri)
    assert SourceEndpoint.from_uri("postgresql://u@:6543/db").hosts == (("localhost", 6543),)
    assert SourceEndpoint.from_uri("postgresql://u@[::1]:6543/db").jdbc_url() == "jdbc:postgresql://[::1]:6543/db"
    one = SourceEndpoint.from_uri("postgresql://u:p@pg-a:5439/db")
    assert (one.hosts, one.dsn(), one.jdbc_url()) == (
        (("pg-a", 5439),),
        "host='pg-a' port='5439' dbname='db' user='u' password='p'",
        "jdbc:postgresql://pg-a:5439/db",
    )


def test_a_lost_slot_fails_the_capture_task_without_retries(monkeypatch):
    """No retry brings a lost slot back: the capture task fails for good at once, so its alert
    (which names the endpoint and cdc_recover__<endpoint>) is not held back by the retries (#52)."""
    import pytest
    from airflow.sdk.exceptions import AirflowFailException
    from cdc_lakehouse.orchestration import tasks
    from cdc_lakehouse.orchestration.operators import CdcCaptureOperator
    from cdc_lakehouse.source.errors import SlotLostError, SourceError

    op = CdcCaptureOperator(task_id="capture__e1", endpoint_id="e1")
    lost = SlotLostError("replication slot s on c (endpoint e1) was invalidated; trigger cdc_recover__e1")
    monkeypatch.setattr(tasks, "capture_endpoint", lambda *a, **k: (_ for _ in ()).throw(lost))
    with pytest.raises(AirflowFailException, match="cdc_recover__e1"):
        op.execute({"data_interval_end": datetime(2026, 3, 1, tzinfo=UTC)})
    busy = SourceError("server busy")  # anything else is retried as before
    monkeypatch.setattr(tasks, "capture_endpoint", lambda *a, **k: (_ for _ in ()).throw(busy))
    with pytest.raises(SourceError, match="server busy"):
        op.execute({"data_interval_end": datetime(2026, 3, 1, tzinfo=UTC)})


def test_a_runs_partition_key_is_its_own_else_its_intervals_start_in_utc():
    from datetime import timezone

    from cdc_lakehouse.orchestration.tasks import KeyOutletEvents, run_partition_key

    start = datetime(2026, 11, 30, 7, 0, tzinfo=UTC)
    plain = SimpleNamespace(partition_key=None, run_after=start + timedelta(minutes=61))
    # A scheduled ingest: the interval whose changes it applied, even given in another zone.
    east = timezone(timedelta(hours=9))
    assert run_partition_key({"dag_run": plain, "data_interval_start": start.astimezone(east)}) == "2026-11-30T07:00:00"
    # A downstream run passes on the key it was started for.
    keyed = SimpleNamespace(partition_key="2026-11-30T05:00:00", run_after=start)
    assert run_partition_key({"dag_run": keyed, "data_interval_start": start}) == "2026-11-30T05:00:00"
    # A manual run without an interval: its logical date, else when it was due.
    assert run_partition_key({"dag_run": plain, "logical_date": start}) == "2026-11-30T07:00:00"
    assert run_partition_key({"dag_run": plain, "logical_date": None}) == "2026-11-30T08:01:00"

    calls = []

    class Accessor:
        def add_partitions(self, key):
            calls.append(("key", key))

    events = {"a": Accessor(), "b": Accessor()}
    context = {"dag_run": plain, "data_interval_start": start, "task": SimpleNamespace(outlets=["a", "b"])}
    context["outlet_events"] = events
    KeyOutletEvents(then=lambda ctx, result: calls.append(("then", result)))(context, "r")
    assert calls == [("then", "r"), ("key", "2026-11-30T07:00:00"), ("key", "2026-11-30T07:00:00")]
