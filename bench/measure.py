"""What every benchmark records besides time: the peak memory of a process tree, and the machine."""

from __future__ import annotations

import os
import platform
import threading
import time


class PeakRSS:
    """Peak resident memory of a process and its children (e.g. the Spark JVM) while active:
    this process by default, or another one by pid."""

    def __init__(self, pid: int | None = None, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
            except psutil.Error:
                pass
            time.sleep(self.interval)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def machine() -> dict:
    import psutil

    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def provenance(spark_version: str) -> dict:
    """Where a result comes from: the command, the commit, when, the machine and Spark."""
    import subprocess
    import sys
    from datetime import UTC, datetime
    from pathlib import Path

    code = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout.strip()
    return {
        "command": " ".join(sys.argv),
        "code": code,
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "spark": spark_version,
    }
