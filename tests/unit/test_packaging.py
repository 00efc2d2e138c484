"""The package zip Spark receives (runtime.packaging), built by several threads at once: a group
run's workers each start a session, and each may find the zip stale (issue #56)."""

from __future__ import annotations

import threading
import zipfile

from cdc_lakehouse.runtime.packaging import pyfiles_zip


def test_threads_rebuilding_a_stale_zip_at_once_all_get_a_whole_zip(tmp_path):
    start, errors, zips = threading.Barrier(4), [], []

    def build() -> None:
        start.wait()
        try:
            path = pyfiles_zip(tmp_path)
            with zipfile.ZipFile(path) as zf:
                assert zf.testzip() is None
                zips.append(len(zf.namelist()))
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
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
    start, lock, at_once = threading.Barrier(4), threading.Lock(), []
    inside = [0]

    def add_artifacts(path: str, pyfile: bool) -> None:
        with lock:
            inside[0] += 1
            at_once.append(inside[0])
        importlib.invalidate_caches()
        time.sleep(0.05)
        with lock:
            inside[0] -= 1

    def open_session() -> None:
        start.wait()
        try:
            session.configure_session(SimpleNamespace(addArtifacts=add_artifacts), LakeSettings())
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            at_once.append(exc)

    threads = [threading.Thread(target=open_session) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert at_once and max(at_once) == 1, at_once
