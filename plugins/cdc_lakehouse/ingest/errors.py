"""ingest.errors: split out of ingest.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


class IngestError(RuntimeError):
    """Stops this table's ingest; the message names the table, the cause and the fix."""


class NotBootstrapped(IngestError):
    pass


class LandingGap(IngestError):
    pass


class SchemaChangeError(IngestError):
    pass


class SourceIdentityChanged(IngestError):
    """A shard's landing runs come from another server or endpoint than its lake position."""


class CoverageError(IngestError):
    """A landing run did not capture one of the table's shards (not published for the whole run)."""


class ErrorBudgetExceeded(IngestError):
    pass
