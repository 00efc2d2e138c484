"""Why the landing files cannot be applied to a table. Raised while planning a table's pending
runs (landing.reader, landing.debezium) and by the ingest's checks of that plan; each stops this
table's ingest with a message that names the table, the cause and the fix (the job runner goes
on with the other tables)."""

from __future__ import annotations


class LandingError(RuntimeError):
    """Stops this table's ingest; the message names the table, the cause and the fix."""


class NotBootstrapped(LandingError):
    """The table (or a shard of it) has no lake position yet: a bootstrap must load it first."""


class LandingGap(LandingError):
    """Landing runs the table needs are missing or unreadable (missing_landing_files: fail)."""


class SourceIdentityChanged(LandingError):
    """A shard's landing runs come from another server or endpoint than its lake position."""


class CoverageError(LandingError):
    """A landing run did not capture one of the table's shards (not published for the whole run)."""
