"""source.session: the PostgreSQL session settings every reader of a source uses, in one place.

Text output the capture, the bootstrap and the audit parse: fixed here, never left to the role's
or the server's defaults. client_encoding matters for the SQL sessions; pgoutput sends text in
the database encoding, which preflight requires to be UTF8.

Rendered two ways:
  - libpq (psycopg2): SESSION_OPTIONS, the `options=` connection parameter (`-c name=value ...`);
  - JDBC (Spark's reader, pgjdbc): jdbc_init_statement / jdbc_properties, `SET` statements run as
    the `sessionInitStatement` of every connection. Not the URL's `options=`: pgjdbc sends its own
    TimeZone (the JVM's) as a startup parameter, which wins over `-c TimeZone=...` in options.
    client_encoding is left out: pgjdbc always runs UTF8 and refuses any other.
"""

from __future__ import annotations

from typing import Any

# (setting, value), in the order they are rendered.
SESSION_SETTINGS: tuple[tuple[str, str], ...] = (
    ("DateStyle", "ISO"),
    ("TimeZone", "UTC"),
    ("IntervalStyle", "iso_8601"),
    ("extra_float_digits", "3"),
    ("bytea_output", "hex"),
    ("client_encoding", "UTF8"),
)
_JDBC_FIXED = frozenset({"client_encoding"})  # pgjdbc sets it (UTF8) and rejects a change


def libpq_options(settings: tuple[tuple[str, str], ...] = SESSION_SETTINGS) -> str:
    """The settings as libpq's `options` connection parameter."""
    return " ".join(f"-c {name}={value}" for name, value in settings)


SESSION_OPTIONS = libpq_options()


def _sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def jdbc_init_statement(snapshot: str | None = None) -> str:
    """The settings as SQL for a JDBC connection's `sessionInitStatement`. With an exported
    snapshot, the connection's transaction first imports it (REPEATABLE READ), so every reader of
    a database sees the same data."""
    sets = "; ".join(f"SET {name}={_sql_literal(value)}" for name, value in SESSION_SETTINGS if name not in _JDBC_FIXED)
    if snapshot:
        return (
            "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; "
            f"SET TRANSACTION SNAPSHOT {_sql_literal(snapshot)}; " + sets
        )
    return sets


def jdbc_properties(endpoint: Any, fetch_size: int, snapshot: str | None = None) -> dict[str, str]:
    """Spark JDBC reader properties for a source endpoint (settings.SourceEndpoint): credentials,
    driver, fetch size and the session settings (jdbc_init_statement)."""
    props = {
        "user": endpoint.user,
        "driver": "org.postgresql.Driver",
        "fetchsize": str(fetch_size),
        "sessionInitStatement": jdbc_init_statement(snapshot),
    }
    if endpoint.password:
        props["password"] = endpoint.password
    return props
