"""Is the source ready to replicate: preflight checks (server, role, each shard's table) and the
publication that carries the configured tables, kept in step with the configs."""

from __future__ import annotations

import logging
from typing import Any

from cdc_lakehouse.identifiers import pg_ident, pg_qualified
from cdc_lakehouse.source.catalog import EndpointTables, describe_table
from cdc_lakehouse.source.pgoutput import lsn_to_int, lsn_to_str
from cdc_lakehouse.source.slots import HEARTBEAT_TABLE
from cdc_lakehouse.watermark import ServerIdentity

log = logging.getLogger(__name__)

PUBLICATION = "cdc_lakehouse"


def preflight(conn, ep: EndpointTables, *, need_replication: bool = True) -> list[str]:
    """Problems that stop capture on this endpoint, each with its fix. Empty when fine."""
    where = f"source {ep.conn_id!r} (endpoint {ep.endpoint_id})"
    with conn.cursor() as cur:
        problems, user = _server_problems(cur, where, need_replication)
        for table, (schemas, key) in ep.tables.items():
            for schema in schemas:
                problems += _table_problems(cur, where, user, schema, table, key)
    return problems


def _server_problems(cur, where: str, need_replication: bool) -> tuple[list[str], str]:
    """WAL level, encoding and the role's replication right; returns the problems and the role."""
    problems: list[str] = []
    cur.execute("SHOW wal_level")
    level = cur.fetchone()[0]
    if level != "logical":
        problems.append(
            f"{where}: wal_level is {level!r}; set wal_level = logical in postgresql.conf and restart "
            "the server (Amazon RDS/Aurora: rds.logical_replication = 1 in the parameter group)"
        )
    cur.execute("SELECT pg_encoding_to_char(encoding), datname FROM pg_database WHERE datname = current_database()")
    encoding, dbname = cur.fetchone()
    if encoding != "UTF8":
        problems.append(
            f"{where}: database {dbname!r} uses encoding {encoding}; logical replication sends text in the "
            "database encoding and the capture reads UTF-8, so values could be misread or fail. Fix: replicate "
            "from a UTF8 database (CREATE DATABASE ... ENCODING 'UTF8' and migrate the data into it)"
        )
    cur.execute("SELECT rolsuper, rolreplication, current_user FROM pg_roles WHERE rolname = current_user")
    is_super, can_repl, user = cur.fetchone()
    if need_replication and not (is_super or can_repl):
        problems.append(
            f"{where}: role {user!r} lacks the REPLICATION attribute needed for a replication slot; "
            f"run ALTER ROLE {pg_ident(user)} REPLICATION (RDS: GRANT rds_replication TO {pg_ident(user)})"
        )
    return problems, user


def _table_problems(cur, where: str, user: str, schema: str, table: str, key: list[str]) -> list[str]:
    """One shard's table: exists, not partitioned, identifiable rows, the key, types, privileges."""
    fq = f"{schema}.{table}"
    info = describe_table(cur, schema, table)
    if info is None:
        return [f"{where}: table {fq} does not exist; create it or remove shard {schema!r} from the config"]
    if info.partitioned:
        return [
            f"{where}: table {fq} is partitioned; its changes are published under the leaf partitions' "
            "names, and TRUNCATE, ATTACH and DETACH of a partition produce no change events through the "
            "root, so rows would vanish or appear unseen. Fix: configure each leaf partition as its own "
            "table (source.table), or replicate a non-partitioned table"
        ]
    problems: list[str] = []
    if info.replica_identity == "n" or (info.replica_identity == "d" and not info.primary_key):
        problems.append(
            f"{where}: table {fq} has no primary key and no replica identity, so updates and "
            f"deletes cannot be identified; add a primary key or run ALTER TABLE {pg_qualified(schema, table)} "
            "REPLICA IDENTITY FULL"
        )
    elif info.replica_identity != "f" and not set(key) <= set(info.identity_columns):
        problems.append(
            f"{where}: table {fq}: configured primary_key {key} is not covered by the source's replica "
            f"identity {info.identity_columns}; set primary_key to the source key or use REPLICA IDENTITY FULL"
        )
    missing = [k for k in key if k not in info.column_names]
    if missing:
        problems.append(f"{where}: table {fq}: primary_key column(s) {missing} do not exist")
    bad = [f"{c.name} ({c.pg_type})" for c in info.columns if c.lake_type is None]
    if bad:
        problems.append(
            f"{where}: table {fq}: unsupported column type(s) {', '.join(bad)}; "
            "set column_types in the table config to read them as a supported type (e.g. string)"
        )
    cur.execute("SELECT has_table_privilege(%s, 'SELECT')", (pg_qualified(schema, table),))
    if not cur.fetchone()[0]:
        problems.append(
            f"{where}: role {user!r} cannot SELECT {fq}; GRANT SELECT ON {pg_qualified(schema, table)} TO {pg_ident(user)}"
        )
    return problems


PUBLISH_ACTIONS = ("insert", "update", "delete", "truncate")


def check_publication(
    conn, ep: EndpointTables, *, fix: bool = True, column_lists: dict[tuple[str, str], list[str]] | None = None
) -> list[str]:
    """Create the publication or add missing tables when we may; otherwise report the fix.

    Membership is not enough: a publication that does not publish deletes or truncates, or that
    filters rows or columns of one of our tables, silently drops changes, so those are problems.
    column_lists: (schema, table) -> the columns every table config reading it consumes (see
    column_list_for); tables are created or added with that list, and an existing list is
    accepted when it carries at least those columns."""
    wanted = ep.qualified_tables() + [(s, HEARTBEAT_TABLE) for s in ep.schemas]
    lists = column_lists or {}
    problems: list[str] = []
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pubowner::regrole::text, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate "
            "FROM pg_publication WHERE pubname = %s",
            (PUBLICATION,),
        )
        row = cur.fetchone()
        if row is None:
            if not fix:
                return [f"publication {PUBLICATION} does not exist on endpoint {ep.endpoint_id}"]
            tables = ", ".join(_published(s, t, lists) for s, t in wanted)
            try:
                cur.execute(f"CREATE PUBLICATION {pg_ident(PUBLICATION)} FOR TABLE {tables}")
            except Exception as exc:  # noqa: BLE001 - reported with the fix
                conn.rollback()
                return [
                    f"endpoint {ep.endpoint_id} ({ep.conn_id}): cannot create publication {PUBLICATION}: "
                    f"{str(exc).strip()}; a superuser or the database owner must run: "
                    f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {tables}"
                ]
            return []
        problems += _publish_actions(conn, cur, ep, dict(zip(PUBLISH_ACTIONS, row[2:6])), fix)
        problems += _publication_filters(cur, ep, wanted, lists)
        cur.execute("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (PUBLICATION,))
        present = set(cur.fetchall())
        for s, t in wanted:
            if (s, t) in present:
                continue
            stmt = f"ALTER PUBLICATION {pg_ident(PUBLICATION)} ADD TABLE {_published(s, t, lists)}"
            if fix:
                try:
                    cur.execute(stmt)
                    continue
                except Exception as exc:  # noqa: BLE001
                    conn.rollback()
                    problems.append(
                        f"endpoint {ep.endpoint_id} ({ep.conn_id}): publication {PUBLICATION} is missing "
                        f"{s}.{t} and it cannot be added ({str(exc).strip()}); its owner must run: {stmt}"
                    )
                    continue
            problems.append(f"endpoint {ep.endpoint_id}: publication {PUBLICATION} is missing {s}.{t}; run: {stmt}")
    return problems


def _publish_actions(conn, cur, ep: EndpointTables, actions: dict[str, bool], fix: bool) -> list[str]:
    missing = [a for a, on in actions.items() if not on]
    if not missing:
        return []
    stmt = f"ALTER PUBLICATION {pg_ident(PUBLICATION)} SET (publish = '{', '.join(PUBLISH_ACTIONS)}')"
    if fix:
        try:
            cur.execute(stmt)
            return []
        except Exception:  # noqa: BLE001 - reported with the fix below
            conn.rollback()
    return [
        f"endpoint {ep.endpoint_id} ({ep.conn_id}): publication {PUBLICATION} does not publish "
        f"{', '.join(missing)}, so those changes would never reach the lake; its owner must run: {stmt}"
    ]


def _publication_filters(
    cur, ep: EndpointTables, wanted: list[tuple[str, str]], lists: dict[tuple[str, str], list[str]]
) -> list[str]:
    """Row filters and column lists (PostgreSQL 15+) on our tables: refused, never fixed silently
    (someone chose them), with the statements that remove them. A column list is fine when it
    carries every column the table's configs consume (lists)."""
    cur.execute("SELECT current_setting('server_version_num')::int")
    if cur.fetchone()[0] < 150000:
        return []
    cur.execute(
        """
        SELECT n.nspname, c.relname, pg_get_expr(pr.prqual, pr.prrelid), pr.prattrs IS NOT NULL,
               ARRAY(SELECT a.attname::text FROM pg_attribute a
                     WHERE a.attrelid = pr.prrelid AND a.attnum = ANY(pr.prattrs::int2[]))
        FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
        JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE p.pubname = %s AND (pr.prqual IS NOT NULL OR pr.prattrs IS NOT NULL)
        """,
        (PUBLICATION,),
    )
    want = set(wanted)
    problems = []
    for schema, table, rowfilter, collist, listed in cur.fetchall():
        if (schema, table) not in want:
            continue
        need = lists.get((schema, table))
        if not rowfilter and need is not None and set(need) <= set(listed):
            continue  # a column list of consumed columns: what the configs asked for
        what = f"a row filter (WHERE {rowfilter})" if rowfilter else f"a column list ({', '.join(listed)})"
        if rowfilter and collist:
            what = f"a row filter (WHERE {rowfilter}) and a column list"
        q = pg_qualified(schema, table)
        problems.append(
            f"endpoint {ep.endpoint_id} ({ep.conn_id}): publication {PUBLICATION} has {what} on {schema}.{table}, so "
            f"changes outside it would never reach the lake; publish the whole table: ALTER PUBLICATION "
            f"{pg_ident(PUBLICATION)} DROP TABLE {q}; ALTER PUBLICATION {pg_ident(PUBLICATION)} ADD TABLE {q}"
        )
    return problems


def _published(schema: str, table: str, lists: dict[tuple[str, str], list[str]]) -> str:
    """The table as a publication lists it: with its column list when it has one."""
    cols = lists.get((schema, table))
    q = pg_qualified(schema, table)
    return q if cols is None else f"{q} ({', '.join(pg_ident(c) for c in cols)})"


def column_list_for(
    cfgs: list[Any], columns: list[str], identity: list[str], replica_identity: str
) -> list[str] | None:
    """The publication's column list for one source table (PostgreSQL 15+), or None: publish every
    column. cfgs: every table config reading it on this endpoint (TableConfig); columns: the
    table's columns in order; identity: its replica identity columns.

    Only when every config consumes a subset (columns.include/exclude): the union of what they
    consume, plus the replica identity (PostgreSQL requires it for UPDATE and DELETE). Never with
    REPLICA IDENTITY FULL (the list would have to hold every column), and never when a config
    consumes everything."""
    if replica_identity == "f" or not cfgs or any(c.columns.all for c in cfgs):
        return None
    keep = set(identity)
    for c in cfgs:
        keep |= set(c.consumed(columns)) | set(c.primary_key)
    return [c for c in columns if c in keep]


def consumed_column_lists(conn, ep: EndpointTables, cfgs: list[Any]) -> dict[tuple[str, str], list[str]]:
    """check_publication's column_lists for an endpoint: (schema, table) -> column_list_for over the
    table configs (TableConfig) reading that shard on this endpoint; tables every reader consumes
    whole, or no valid config reads, are left out (published whole).

    Empty before PostgreSQL 15, which has no publication column lists: the whole row is then
    published, and the ingest keeps only the consumed columns (ingest.validate.typed_events reads
    the lake's columns), so the result is the same, at the cost of decoding the other columns."""
    with conn.cursor() as cur:
        cur.execute("SELECT current_setting('server_version_num')::int")
        if cur.fetchone()[0] < 150000:
            conn.commit()
            return {}
        out: dict[tuple[str, str], list[str]] = {}
        for schema, table in ep.qualified_tables():
            readers = [
                c
                for c in cfgs
                if c.source.table == table
                and any(g.endpoint_id == ep.endpoint_id and s == schema for g, s, _ in c.shards())
            ]
            info = describe_table(cur, schema, table) if readers else None
            cols = info and column_list_for(readers, info.column_names, info.identity_columns, info.replica_identity)
            if cols:
                out[(schema, table)] = cols
    conn.commit()
    return out


def published_tables(conn) -> list[str]:
    """'schema.table' of every table the publication sends (partition roots when via root)."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = %s ORDER BY 1",
            (PUBLICATION,),
        )
        out = [r[0] for r in cur.fetchall()]
    conn.commit()
    return out


def source_identity(repl_cursor) -> ServerIdentity:
    """Which server's LSNs these are, from IDENTIFY_SYSTEM on a replication connection, and on a
    timeline after the first, where each earlier timeline of its history ended (TIMELINE_HISTORY).

    Positions compare only within one identity. A shard moved to another cluster or database
    yields a different identity; comparing its LSNs with the old ones would drop or re-apply
    changes, so the ingest refuses and asks for a re-bootstrap of the shard. A promoted standby
    of the same cluster is on a new timeline whose LSNs up to its switch point are the old
    timeline's: a position up to there still compares (identity_mismatch, #52)."""
    repl_cursor.execute("IDENTIFY_SYSTEM")
    system_id, timeline, _pos, database = repl_cursor.fetchone()
    identity = ServerIdentity(system_identifier=str(system_id), timeline=int(timeline), database=database)
    if int(timeline) > 1:
        try:
            repl_cursor.execute(f"TIMELINE_HISTORY {int(timeline)}")
            _name, content = repl_cursor.fetchone()
        except Exception as exc:  # noqa: BLE001 - a provider without the command, a missing history file
            # Without it the identity is what it was before #52: a later timeline never compares.
            log.warning(
                "TIMELINE_HISTORY %d failed (%s): positions of earlier timelines will not compare", timeline, exc
            )
            return identity
        identity["history"] = timeline_history(bytes(content).decode() if not isinstance(content, str) else content)
    return identity


def server_identity(dsn: str) -> ServerIdentity:
    """source_identity of the server at `dsn`, on a replication connection of its own."""
    import psycopg2
    from psycopg2.extras import LogicalReplicationConnection

    conn = psycopg2.connect(dsn, connection_factory=LogicalReplicationConnection)
    try:
        return source_identity(conn.cursor())
    finally:
        conn.close()


def timeline_history(content: str) -> dict[str, int]:
    """A timeline history file ("<parent timeline>\t<X/Y switch point>\t<reason>" per line) as
    {timeline: the LSN where the server left it}; keys are text (the identity is stored as JSON)."""
    out: dict[str, int] = {}
    for line in content.splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and parts[0].strip().isdigit():
            out[str(int(parts[0]))] = lsn_to_int(parts[1].strip())
    return out


def identity_mismatch(
    recorded: ServerIdentity | None, seen: ServerIdentity | None, position: int | None = None
) -> str | None:
    """Why two identities differ, or None when they may be compared (or one is unknown). `seen`
    on a later timeline of the same cluster and database compares with a `position` taken on
    `recorded`'s timeline when its history says that timeline ran at least up to the position
    (a promoted standby that had everything up to there); without a position, or past the
    switch point (the old server had changes the new one never got), it does not."""
    if not recorded or not seen:
        return None
    diffs = [
        f"{k} {recorded.get(k)} -> {seen.get(k)}"
        for k in ("system_identifier", "database", "timeline")
        if recorded.get(k) != seen.get(k)
    ]
    if not diffs and recorded.get("history") and seen.get("history") and recorded["history"] != seen["history"]:
        # One timeline number reached twice (two standbys promoted apart): different WAL.
        return f"timeline {seen.get('timeline')} of two different histories"
    if diffs == [f"timeline {recorded.get('timeline')} -> {seen.get('timeline')}"] and position is not None:
        switch = (seen.get("history") or {}).get(str(recorded.get("timeline")))
        if switch is not None and position <= int(switch):
            return None
        diffs[0] += (
            f" (the new timeline left it at {lsn_to_str(int(switch))}, below the position {lsn_to_str(position)})"
            if switch is not None
            else " (the new server's timeline history does not show it)"
        )
    return ", ".join(diffs) or None
