"""Failpoints for crash tests: CDC_TEST_CRASH_AT=<name> kills the process at that point,
as a `kill -9` would; CDC_TEST_FAIL_AT=<name> raises FailpointHit there instead, so a test can
stop a run between two commits in its own process (a new Spark JVM per kill costs a minute here)
and rerun it at once. Unset in production; a no-op then."""

from __future__ import annotations

import os

CRASH_ENV = "CDC_TEST_CRASH_AT"
FAIL_ENV = "CDC_TEST_FAIL_AT"


class FailpointHit(RuntimeError):
    """Raised at the failpoint named by CDC_TEST_FAIL_AT."""


def crash_point(name: str) -> None:
    if os.environ.get(CRASH_ENV) == name:
        os._exit(137)
    if os.environ.get(FAIL_ENV) == name:
        raise FailpointHit(f"{FAIL_ENV}: failpoint {name}")
