"""The audit's own failure: no trustworthy verdict could be reached, or the verdict is a fail."""

from __future__ import annotations


class AuditFailed(RuntimeError):
    pass
