"""What can go wrong at the source, as exceptions whose text names the endpoint, the table and the fix."""

from __future__ import annotations


class SourceError(RuntimeError):
    """A problem with the source that a person has to fix; the message says what to do."""


class PreflightError(SourceError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("source preflight failed:\n  - " + "\n  - ".join(problems))


class SlotConflictError(SourceError):
    pass


class SlotLostError(SourceError):
    pass
