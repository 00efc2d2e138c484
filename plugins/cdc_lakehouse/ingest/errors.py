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


class DropDecisionNeeded(SchemaChangeError):
    """Source columns were dropped with no keep/drop decision: recorded as pending on the table
    (ingest.schema.DropDecisions), the table waits for a person's choice in the ingest DAG. Not a
    failure of the job (jobs.runner: status `waiting`); nothing of the batch is applied."""

    waits_for_person = True

    def __init__(self, message: str, columns: list[str]) -> None:
        super().__init__(message)
        self.columns = columns
