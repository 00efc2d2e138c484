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
