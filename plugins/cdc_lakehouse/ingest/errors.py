"""Why a table's ingest stops, beyond the landing's own reasons (landing.errors). Each is raised with
a message that names the table, the cause and the fix; the other tables of the job go on (the job
runner runs them one by one)."""

from __future__ import annotations


class IngestError(RuntimeError):
    """Stops this table's ingest; the message names the table, the cause and the fix."""


class SchemaChangeError(IngestError):
    pass


class ErrorBudgetExceeded(IngestError):
    pass
