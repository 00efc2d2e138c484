"""Schema changes as events: an event trigger that writes each table DDL into the WAL.

PostgreSQL's logical decoding carries no DDL: a change of columns shows only in the relation
message of the table's next row change, so a rename looks like a drop plus an add. Where the
capture's role may create one (a superuser, or on PostgreSQL 15 nothing less), a
`ddl_command_end` event trigger compares the table's columns (by attribute number, which a
rename keeps) with the copy it kept after the previous DDL, and writes the difference as a
transactional logical message with prefix DDL_PREFIX: in the DDL's own transaction, so the
capture reads it in commit order with the data (capture.stream, manifest `ddl`).

The trigger function is SECURITY DEFINER (any role's DDL can write its copy and the message) and
never fails the user's DDL: an error inside it becomes a WARNING, and that change is inferred
from relation messages as without the trigger. Without the privilege, nothing is installed and
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
VERSION = "cdc_lakehouse ddl trigger v1"  # in the function's body: a newer release replaces an older one

_FUNCTION = f"""
CREATE OR REPLACE FUNCTION {DDL_SCHEMA}.columns_of(rel oid) RETURNS jsonb LANGUAGE sql STABLE AS $f$
  SELECT coalesce(jsonb_object_agg(a.attnum::text, jsonb_build_object(
           'name', a.attname, 'type', format_type(a.atttypid, a.atttypmod),
           'default', pg_get_expr(d.adbin, d.adrelid))), '{{}}'::jsonb)
  FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
  WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped
$f$;
CREATE OR REPLACE FUNCTION {DDL_SCHEMA}.on_ddl() RETURNS event_trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog AS $f$
DECLARE
  -- {VERSION}
  rel oid;
  was jsonb;
  now_ jsonb;
BEGIN
  FOR rel IN SELECT DISTINCT objid FROM pg_event_trigger_ddl_commands()
             WHERE classid = 'pg_class'::regclass AND object_type IN ('table', 'table column') LOOP
    BEGIN
      now_ := {DDL_SCHEMA}.columns_of(rel);
      SELECT columns INTO was FROM {DDL_SCHEMA}.ddl_columns WHERE relid = rel;
      -- A new table (its oid may be a dropped one's, whose copy is stale) only gets its copy.
      IF was IS NOT NULL AND was <> now_ AND tg_tag NOT LIKE 'CREATE %' THEN
        PERFORM pg_logical_emit_message(true, '{DDL_PREFIX}', jsonb_build_object(
          'table', (SELECT n.nspname || '.' || c.relname FROM pg_class c
                    JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = rel),
          'tag', tg_tag, 'before', was, 'after', now_)::text);
      END IF;
      INSERT INTO {DDL_SCHEMA}.ddl_columns AS t (relid, columns) VALUES (rel, now_)
        ON CONFLICT (relid) DO UPDATE SET columns = excluded.columns;
    EXCEPTION WHEN OTHERS THEN
      RAISE WARNING 'cdc_lakehouse: schema change of relation % not captured as an event: %', rel, SQLERRM;
    END;
  END LOOP;
END
$f$;
"""


def ddl_capture_installed(cur) -> bool:
    cur.execute("SELECT 1 FROM pg_event_trigger WHERE evtname = %s AND evtenabled <> 'D'", (TRIGGER,))
    return cur.fetchone() is not None


def ensure_ddl_capture(conn, tables: list[tuple[str, str]]) -> str | None:
    """Install the trigger (once per database) and record the current columns of `tables`
    ((schema, table) pairs) it has not seen yet. Returns what is missed when the role may not
    create an event trigger (None when installed); the caller commits."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = %s AND p.proname = 'on_ddl'",
            (DDL_SCHEMA,),
        )
        body = cur.fetchone()
        current = ddl_capture_installed(cur) and body is not None and VERSION in body[0]
        if not current:
            cur.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            row = cur.fetchone()
            if not (row and row[0]):
                return ddl_capture_problem()
            cur.execute(f"CREATE SCHEMA IF NOT EXISTS {DDL_SCHEMA}")
            cur.execute(
                f"CREATE TABLE IF NOT EXISTS {DDL_SCHEMA}.ddl_columns (relid oid PRIMARY KEY, columns jsonb NOT NULL)"
            )
            cur.execute(_FUNCTION)
            cur.execute(f"DROP EVENT TRIGGER IF EXISTS {TRIGGER}")
            cur.execute(f"CREATE EVENT TRIGGER {TRIGGER} ON ddl_command_end EXECUTE FUNCTION {DDL_SCHEMA}.on_ddl()")
            log.info("schema changes of this database are captured as events (event trigger %s)", TRIGGER)
        for schema, table in tables:
            cur.execute(
                f"INSERT INTO {DDL_SCHEMA}.ddl_columns (relid, columns) "
                f"SELECT c.oid, {DDL_SCHEMA}.columns_of(c.oid) FROM pg_class c "
                "WHERE c.oid = to_regclass(%s) ON CONFLICT (relid) DO NOTHING",
                (pg_qualified(schema, table),),
            )
    return None


def capture_ddl(conn, ep: EndpointTables) -> None:
    """The trigger for the endpoint's tables, where the role may create it (committed); a
    warning naming what is missed otherwise."""
    missed = ensure_ddl_capture(conn, [(s, t) for t, (schemas, _) in ep.tables.items() for s in schemas])
    conn.commit()
    if missed:
        log.warning("endpoint %s (%s): %s", ep.endpoint_id, ep.conn_id, missed)


def ddl_capture_problem() -> str:
    return (
        "schema changes are not captured as events: creating the event trigger "
        f"{TRIGGER} needs a superuser. Without it a column rename reaches the lake as a drop plus "
        "an add (the table stops on the drop, schema_changes.dropped_columns decides), and the "
        "other DDL is seen only with the next row change. To capture DDL in order with the data, "
        "run the capture once as a superuser, or install it yourself (docs: README, 'Schema changes as events')"
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
