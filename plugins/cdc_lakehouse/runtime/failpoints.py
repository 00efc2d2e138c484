"""Failpoints for crash tests: CDC_TEST_CRASH_AT=<name> kills the process at that point,
as a `kill -9` would. Unset in production; a no-op then."""

from __future__ import annotations

import os


def crash_point(name: str) -> None:
    if os.environ.get("CDC_TEST_CRASH_AT") == name:
        os._exit(137)
