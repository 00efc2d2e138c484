"""The package zip Spark receives (runtime.packaging), built by several threads at once: a group
run's workers each start a session, and each may find the zip stale (issue #56)."""

from __future__ import annotations

import threading
import zipfile
from collections.abc import Callable

from cdc_lakehouse.runtime.packaging import pyfiles_zip


def _at_once(fn: Callable[[], None], threads: int = 4) -> list[Exception]:
    """fn in `threads` threads started together; what they raised."""
    start, errors = threading.Barrier(threads), []

    def run() -> None:
        start.wait()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - returned, asserted by the caller
            errors.append(exc)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return errors


def test_threads_rebuilding_a_stale_zip_at_once_all_get_a_whole_zip(tmp_path):
    zips = []

    def build() -> None:
        path = pyfiles_zip(tmp_path)
        with zipfile.ZipFile(path) as zf:
            assert zf.testzip() is None
            zips.append(len(zf.namelist()))

    errors = _at_once(build)
    assert not errors, errors
    assert len(zips) == 4 and len(set(zips)) == 1, zips
    assert not list(tmp_path.glob("*.tmp"))


def test_sessions_opened_at_once_ship_the_zip_one_at_a_time(monkeypatch, tmp_path):
    """pyspark's addArtifacts calls importlib.invalidate_caches(), which two threads cannot run at
    once (a KeyError on an entry of sys.path_importer_cache the other deleted: a group run's
    table failed so in CI). configure_session ships the zip one session at a time."""
    import importlib
    import time
    from types import SimpleNamespace

    from cdc_lakehouse.runtime import session
    from cdc_lakehouse.settings import LakeSettings

    monkeypatch.setattr(session, "set_session", lambda spark, conf: None)
    monkeypatch.setattr(session, "set_task_conf", lambda spark, conf: None)
    monkeypatch.setattr(session, "lake_conf", lambda lake: {})
    monkeypatch.setattr("cdc_lakehouse.runtime.packaging.pyfiles_zip", lambda: tmp_path / "cdc_lakehouse.zip")
    lock, at_once = threading.Lock(), []
    inside = [0]

    def add_artifacts(path: str, pyfile: bool) -> None:
        with lock:
            inside[0] += 1
            at_once.append(inside[0])
        importlib.invalidate_caches()
        time.sleep(0.05)
        with lock:
            inside[0] -= 1

    errors = _at_once(lambda: session.configure_session(SimpleNamespace(addArtifacts=add_artifacts), LakeSettings()))
    assert not errors, errors
    assert at_once and max(at_once) == 1, at_once


def _outcome(script: str, mode: str) -> str:
    """What a hang script printed ("hung" or "closed"), run in a process of its own with or without
    the shim (mode "shim" / "plain")."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script, mode], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


# What a session's __del__ does when the garbage collector runs it in one of the pool's threads,
# while another thread closes a session: run in a process of its own, so a hang cannot hang the
# suite (the pool's threads are not daemons).
_CLOSE_FROM_THE_POOL = """
import sys, threading, time
from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator as R
if sys.argv[1] == "shim":
    from cdc_lakehouse.runtime.session import release_pool_without_waiting
    release_pool_without_waiting()
pool = R._get_or_create_release_thread_pool()
started = threading.Event()
def collected_in_the_pool():
    started.set()
    time.sleep(0.5)  # the other thread is in shutdown by then, holding the pool's lock
    R.shutdown()
done = pool.submit(collected_in_the_pool)
started.wait()
closer = threading.Thread(target=R.shutdown, daemon=True)
closer.start()
closer.join(10)
done.result(timeout=10) if not closer.is_alive() else None
print("hung" if closer.is_alive() else "closed", flush=True)
import os
os._exit(0)
"""


def test_a_session_closed_while_another_is_collected_in_the_release_pool_does_not_hang():
    """runtime.session.release_pool_without_waiting: pyspark 4.1's Connect client joins its release
    pool's threads under the pool's lock; a thread of the pool that closes a client meanwhile
    waits for that lock. Without the shim both wait (the unshimmed run shows the hang is real)."""
    assert _outcome(_CLOSE_FROM_THE_POOL, "plain") == "hung"
    assert _outcome(_CLOSE_FROM_THE_POOL, "shim") == "closed"


# The collector can also run a session's __del__ in the thread that is submitting a release to the
# pool, between the pool's lock and the new thread (py-spy, a fresh clone's suite, 2026-11-30).
# A watchdog ends the process if it waits for itself.
_SHUT_DOWN_INSIDE_SUBMIT = """
import os, sys, threading
from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator as R
if sys.argv[1] == "shim":
    from cdc_lakehouse.runtime.session import release_pool_without_waiting
    release_pool_without_waiting()
pool = R._get_or_create_release_thread_pool()
def watchdog():
    print("hung", flush=True)
    os._exit(0)
threading.Timer(10, watchdog).start()
with R._lock, pool._shutdown_lock:  # what _release_until holds while ThreadPoolExecutor.submit runs
    R.shutdown()  # a session's __del__ run by the collector there
print("closed", flush=True)
os._exit(0)
"""


def test_a_session_collected_while_its_thread_submits_a_release_does_not_hang():
    """The other way the release pool hung (runtime.session.release_pool_without_waiting): a
    shutdown in the middle of the same thread's submit waits for the pool's own lock, even
    without waiting for its threads. Without the shim it hangs."""
    assert _outcome(_SHUT_DOWN_INSIDE_SUBMIT, "plain") == "hung"
    assert _outcome(_SHUT_DOWN_INSIDE_SUBMIT, "shim") == "closed"


# The third way (CI on 29dd126, 2026-12-01): _release_until holds the iterator's lock while submit
# starts a pool thread, and the collector runs a session's __del__ in that new thread before it
# tells Thread.start that it started. A thread that holds the lock and waits for one that shuts
# the pool down stands for it; a watchdog ends the process if they wait for each other.
_SHUT_DOWN_IN_A_THREAD_BEING_STARTED = """
import os, sys, threading
from pyspark.sql.connect.client.reattach import ExecutePlanResponseReattachableIterator as R
if sys.argv[1] == "shim":
    from cdc_lakehouse.runtime.session import release_pool_without_waiting
    release_pool_without_waiting()
R._get_or_create_release_thread_pool()
def watchdog():
    print("hung", flush=True)
    os._exit(0)
threading.Timer(10, watchdog).start()
with R._lock:  # what _release_until holds while submit waits for its new thread to start
    starting = threading.Thread(target=R.shutdown)  # a session's __del__ run there by the collector
    starting.start()
    starting.join()
print("closed" if R._release_thread_pool_instance is None else "kept", flush=True)
os._exit(0)
"""


def test_a_session_collected_in_a_release_thread_being_started_does_not_hang():
    """The third way the release pool hung (runtime.session.release_pool_without_waiting): the
    shim's shutdown must not wait for the iterator's lock, which the thread that starts a pool
    thread holds. Without the shim it hangs, and so did the shim that took the lock."""
    assert _outcome(_SHUT_DOWN_IN_A_THREAD_BEING_STARTED, "plain") == "hung"
    assert _outcome(_SHUT_DOWN_IN_A_THREAD_BEING_STARTED, "shim") == "closed"
