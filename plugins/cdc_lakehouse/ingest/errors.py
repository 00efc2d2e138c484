"""Why a table's ingest stops. Each is raised with a message that names the table, the cause and
the fix; the other tables of the job go on (runtime.jobs runs them one by one)."""

from __future__ import annotations


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
