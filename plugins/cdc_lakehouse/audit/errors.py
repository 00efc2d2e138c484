"""audit.errors: split out of audit.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


class AuditFailed(RuntimeError):
    pass
