"""Failpoints for crash and concurrency tests: CDC_TEST_CRASH_AT=<name> kills the process at that
point, as a `kill -9` would; CDC_TEST_FAIL_AT=<name> raises FailpointHit there instead, so a test
can stop a run between two commits in its own process (a new Spark JVM per kill costs a minute
here) and rerun it at once; `hold_at(name)` holds the first thread that reaches the point until
the test releases it (two real writers overlapping inside a write). Unset in production; a no-op
then."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

CRASH_ENV = "CDC_TEST_CRASH_AT"
FAIL_ENV = "CDC_TEST_FAIL_AT"


class FailpointHit(RuntimeError):
    """Raised at the failpoint named by CDC_TEST_FAIL_AT."""


@dataclass
class Hold:
    """A barrier at one failpoint: `reached` is set when a thread arrives there, which then waits
    for `release` (at most `timeout` seconds, so a failed test cannot hang the suite)."""

    name: str
    timeout: float
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


# Failpoint name -> its hold. One-shot: the first thread to arrive takes it out, so a second
# writer passes the same point while the first one waits.
_HOLDS: dict[str, Hold] = {}


@contextmanager
def hold_at(name: str, timeout: float = 300.0) -> Iterator[Hold]:
    """Hold the first thread that reaches failpoint `name` until `hold.release` is set (or the
    block ends: a test that fails never leaves a thread waiting)."""
    hold = Hold(name, timeout)
    _HOLDS[name] = hold
    try:
        yield hold
    finally:
        _HOLDS.pop(name, None)
        hold.release.set()


def crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os._exit(137)
    if os.environ.get(FAIL_ENV) == name:
        raise FailpointHit(f"{FAIL_ENV}: failpoint {name}")
    hold = _HOLDS.pop(name, None) if _HOLDS else None
    if hold is not None:
        hold.reached.set()
        if not hold.release.wait(hold.timeout):
            raise FailpointHit(f"failpoint {name}: held for {hold.timeout:.0f} s and never released")
