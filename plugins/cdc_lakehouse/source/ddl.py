"""Schema changes as events: an event trigger that writes each table DDL into the WAL.

PostgreSQL's logical decoding carries no DDL: a change of columns shows only in the relation
message of the table's next row change, so a rename looks like a drop plus an add. Where the
capture's role may create one (a superuser, or on PostgreSQL 15 nothing less), a
`ddl_command_end` event trigger compares the table's columns (by attribute number, which a
rename keeps) with the copy it kept after the previous DDL, and writes the difference as a
transactional logical message with prefix DDL_PREFIX: in the DDL's own transaction, so the
capture reads it in commit order with the data (capture.stream, manifest `ddl`).

The trigger function is SECURITY DEFINER (any role's DDL can write its copy and the message),
qualifies every name with pg_temp last on its path, looks only at the tables the capture tracks
(`track()`), and never fails the user's DDL: an error inside it becomes a WARNING, and that change
is inferred from relation messages as without the trigger. Any role may emit a message with the
prefix, so the trigger logs each message's position in `ddl_log`, which only it writes, and the
capture keeps only the messages found there (`logged_ddl`). Without the privilege, nothing is installed and
preflight says what is missed (`ddl_capture_problem`).
"""

from __future__ import annotations

import logging
from typing import Any

from cdc_lakehouse.identifiers import pg_qualified
from cdc_lakehouse.source.catalog import EndpointTables

log = logging.getLogger(__name__)

DDL_PREFIX = "cdc_lakehouse_ddl"
DDL_SCHEMA = "_cdc_lakehouse"
TRIGGER = "cdc_lakehouse_ddl"
VERSION = "cdc_lakehouse ddl trigger v2"  # in the function's body: a newer release replaces an older one

# Every name qualified and pg_temp last: a SECURITY DEFINER function must not resolve a name in
# a schema another role controls (PostgreSQL docs, "Writing SECURITY DEFINER Functions Safely").
_PATH = "SET search_path = pg_catalog, pg_temp"
_FUNCTION = f"""
CREATE OR REPLACE FUNCTION {DDL_SCHEMA}.columns_of(rel pg_catalog.oid) RETURNS pg_catalog.jsonb
LANGUAGE sql STABLE {_PATH} AS $f$
  SELECT COALESCE(pg_catalog.jsonb_object_agg(a.attnum::pg_catalog.text, pg_catalog.jsonb_build_object(
           'name', a.attname, 'type', pg_catalog.format_type(a.atttypid, a.atttypmod),
           'default', pg_catalog.pg_get_expr(d.adbin, d.adrelid))), '{{}}'::pg_catalog.jsonb)
  FROM pg_catalog.pg_attribute a
  LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
  WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped
$f$;
REVOKE ALL ON FUNCTION {DDL_SCHEMA}.columns_of(pg_catalog.oid) FROM PUBLIC;
-- Start tracking a table (the capture calls it for the tables it reads, whatever its role).
CREATE OR REPLACE FUNCTION {DDL_SCHEMA}.track(rel pg_catalog.regclass) RETURNS void
LANGUAGE sql SECURITY DEFINER {_PATH} AS $f$
  INSERT INTO {DDL_SCHEMA}.ddl_columns (relid, columns)
  SELECT c.oid, {DDL_SCHEMA}.columns_of(c.oid) FROM pg_catalog.pg_class c
  WHERE c.oid = rel AND c.relpersistence <> 't'
  ON CONFLICT (relid) DO NOTHING
$f$;
REVOKE ALL ON FUNCTION {DDL_SCHEMA}.track(pg_catalog.regclass) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION {DDL_SCHEMA}.track(pg_catalog.regclass) TO PUBLIC;
CREATE OR REPLACE FUNCTION {DDL_SCHEMA}.on_ddl() RETURNS event_trigger LANGUAGE plpgsql
SECURITY DEFINER {_PATH} AS $f$
DECLARE
  -- {VERSION}
  rel pg_catalog.oid;
  was pg_catalog.jsonb;
  now_ pg_catalog.jsonb;
  at pg_catalog.pg_lsn;
BEGIN
  FOR rel IN SELECT DISTINCT e.objid FROM pg_catalog.pg_event_trigger_ddl_commands() e
             WHERE e.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
               AND e.object_type IN ('table', 'table column') LOOP
    BEGIN
      -- Only the tables the capture tracks (track()); others, temporary ones included, cost nothing.
      SELECT t.columns INTO was FROM {DDL_SCHEMA}.ddl_columns t WHERE t.relid = rel;
      CONTINUE WHEN was IS NULL;
      now_ := {DDL_SCHEMA}.columns_of(rel);
      -- A new table whose oid a dropped one had: its copy is stale; it only gets a new one.
      IF was <> now_ AND tg_tag NOT IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO') THEN
        at := pg_catalog.pg_logical_emit_message(true, '{DDL_PREFIX}', pg_catalog.jsonb_build_object(
          'table', (SELECT n.nspname OPERATOR(pg_catalog.||) '.' OPERATOR(pg_catalog.||) c.relname
                    FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
                    WHERE c.oid = rel),
          'tag', tg_tag, 'before', was, 'after', now_)::pg_catalog.text);
        -- What the capture checks a message against: anyone may emit a message with this
        -- prefix, only this function writes here.
        INSERT INTO {DDL_SCHEMA}.ddl_log (lsn, relid) VALUES (at, rel);
        DELETE FROM {DDL_SCHEMA}.ddl_log WHERE logged_at < pg_catalog.now() - interval '90 days';
      END IF;
      UPDATE {DDL_SCHEMA}.ddl_columns SET columns = now_ WHERE relid = rel;
    EXCEPTION WHEN OTHERS THEN
      RAISE WARNING 'cdc_lakehouse: schema change of relation % not captured as an event: %', rel, SQLERRM;
    END;
  END LOOP;
END
$f$;
REVOKE ALL ON FUNCTION {DDL_SCHEMA}.on_ddl() FROM PUBLIC;
"""
_TABLES = f"""
CREATE TABLE IF NOT EXISTS {DDL_SCHEMA}.ddl_columns (relid oid PRIMARY KEY, columns jsonb NOT NULL);
CREATE TABLE IF NOT EXISTS {DDL_SCHEMA}.ddl_log (
  lsn pg_lsn PRIMARY KEY, relid oid NOT NULL, logged_at timestamptz NOT NULL DEFAULT now());
REVOKE ALL ON {DDL_SCHEMA}.ddl_columns, {DDL_SCHEMA}.ddl_log FROM PUBLIC;
GRANT USAGE ON SCHEMA {DDL_SCHEMA} TO PUBLIC;
GRANT SELECT ON {DDL_SCHEMA}.ddl_log TO PUBLIC;
"""


def ddl_capture_installed(cur) -> bool:
    cur.execute("SELECT 1 FROM pg_event_trigger WHERE evtname = %s AND evtenabled <> 'D'", (TRIGGER,))
    return cur.fetchone() is not None


def ensure_ddl_capture(conn, tables: list[tuple[str, str]]) -> str | None:
    """Install the trigger (once per database, again for a newer release) and start tracking
    `tables` ((schema, table) pairs). Returns what is missed when the role may not install it
    (None when installed); the caller commits."""
    with conn.cursor() as cur:
        if not _installed_current(cur):
            cur.execute("SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user")
            row = cur.fetchone()
            if not (row and row[0]):
                return ddl_capture_problem()
            cur.execute(
                "SELECT r.rolsuper FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid = n.nspowner "
                "WHERE n.nspname = %s",
                (DDL_SCHEMA,),
            )
            owner = cur.fetchone()
            if owner is not None and not owner[0]:
                return (
                    f"schema changes are not captured as events: schema {DDL_SCHEMA} exists and is owned by a role "
                    "that is not a superuser, so its functions cannot be trusted; drop it (DROP SCHEMA "
                    f"{DDL_SCHEMA} CASCADE) and run the capture again as a superuser"
                )
            cur.execute(f"CREATE SCHEMA IF NOT EXISTS {DDL_SCHEMA}")
            cur.execute(_TABLES)
            cur.execute(_FUNCTION)
            cur.execute(f"DROP EVENT TRIGGER IF EXISTS {TRIGGER}")
            cur.execute(f"CREATE EVENT TRIGGER {TRIGGER} ON ddl_command_end EXECUTE FUNCTION {DDL_SCHEMA}.on_ddl()")
            log.info("schema changes of this database are captured as events (event trigger %s)", TRIGGER)
        for schema, table in tables:
            cur.execute(f"SELECT {DDL_SCHEMA}.track(to_regclass(%s))", (pg_qualified(schema, table),))
    return None


def _installed_current(cur) -> bool:
    """The trigger, this release's function, and both of its tables."""
    cur.execute(
        "SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = %s AND p.proname = 'on_ddl'",
        (DDL_SCHEMA,),
    )
    body = cur.fetchone()
    cur.execute(
        "SELECT count(*) FROM pg_catalog.pg_tables WHERE schemaname = %s AND tablename IN ('ddl_columns', 'ddl_log')",
        (DDL_SCHEMA,),
    )
    tables = cur.fetchone()[0]
    return ddl_capture_installed(cur) and body is not None and VERSION in body[0] and tables == 2


def logged_ddl(conn, lsns: list[int]) -> set[int]:
    """Which of these message positions the trigger itself logged (source.ddl: anyone may emit a
    message with the prefix; only the trigger writes its log)."""
    if not lsns:
        return set()
    from cdc_lakehouse.source.pgoutput import lsn_to_int, lsn_to_str

    with conn.cursor() as cur:
        cur.execute(
            f"SELECT lsn::text FROM {DDL_SCHEMA}.ddl_log WHERE lsn = ANY(%s::pg_lsn[])",
            ([lsn_to_str(n) for n in lsns],),
        )
        return {lsn_to_int(r[0]) for r in cur.fetchall()}


def capture_ddl(conn, ep: EndpointTables) -> None:
    """The trigger for the endpoint's tables, where the role may create it (committed); a
    warning naming what is missed otherwise."""
    import psycopg2

    try:
        missed = ensure_ddl_capture(conn, [(s, t) for t, (schemas, _) in ep.tables.items() for s in schemas])
        conn.commit()
    except psycopg2.Error as exc:  # never a reason to stop the capture: it works as without events
        conn.rollback()
        missed = f"schema changes are not captured as events: setting up the event trigger failed: {exc}".strip()
    if missed:
        log.warning("endpoint %s (%s): %s", ep.endpoint_id, ep.conn_id, missed)


def ddl_capture_problem() -> str:
    return (
        "schema changes are not captured as events: creating the event trigger "
        f"{TRIGGER} needs a superuser. Without it a column rename reaches the lake as a drop plus "
        "an add (the table stops on the drop, schema_changes.dropped_columns decides), and the "
        "other DDL is seen only with the next row change. To capture DDL in order with the data, "
        "run the capture once as a superuser, or install it yourself (docs/schema-changes.md)"
    )


def ddl_diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """What a DDL changed, from the trigger's column maps (attribute number -> name, type,
    default): renames keep the attribute number."""
    renamed = [[b["name"], after[n]["name"]] for n, b in before.items() if n in after and after[n]["name"] != b["name"]]
    added = [a["name"] for n, a in after.items() if n not in before]
    dropped = [b["name"] for n, b in before.items() if n not in after]
    retyped = [
        {"column": after[n]["name"], "from": b["type"], "to": after[n]["type"]}
        for n, b in before.items()
        if n in after and after[n]["type"] != b["type"]
    ]
    defaults = [
        {"column": after[n]["name"], "from": b.get("default"), "to": after[n].get("default")}
        for n, b in before.items()
        if n in after and after[n].get("default") != b.get("default")
    ]
    return {"renamed": renamed, "added": added, "dropped": dropped, "retyped": retyped, "defaults": defaults}
