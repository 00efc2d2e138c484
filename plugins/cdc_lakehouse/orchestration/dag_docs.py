"""doc_md of the generated DAGs: what each does and how to operate it."""

from __future__ import annotations

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.derived.config import TreeConfig
from cdc_lakehouse.serving.config import ExportConfig


def _header(cfg: TableConfig) -> str:
    shards = ", ".join(s for _, _, s in cfg.shards())
    return (
        f"**Table** `{cfg.name}` — source `{cfg.source.table}` in shards {shards}; "
        f"key `{', '.join(cfg.primary_key)}`; lake `lake.{cfg.current_table}` "
        f"({cfg.lake.write_mode}, format v{cfg.lake.format_version}, deletes {cfg.deletes}); "
        f"owner {cfg.owner}.\n\n{cfg.description}\n"
    )


# What every asset event of this package carries (orchestration.tasks.run_partition_key).
_KEYED = "asset events keyed by the run's partition key"
_DROP_CHOICE = (
    "a source column dropped with no `schema_changes.dropped_columns` entry: keep it or drop it "
    "(review_dropped >> decide_dropped >> record_dropped >> ingest_again; docs/operating.md, Approvals)"
)
_ON_EVENTS = (
    "one run per partition key of {what}'s asset events (a re-run or backfill upstream: one more run for that key)"
)


def _flow(trigger: str, reads: str, writes: str, approval: str = "none") -> str:
    """What triggers the DAG, what it consumes, what it produces, what waits for a person."""
    return (
        "## Triggered by, reads, writes\n"
        f"- **Triggered by**: {trigger}.\n- **Reads**: {reads}.\n- **Writes**: {writes}.\n"
        f"- **Approval**: {approval}.\n\nPartition keys: docs/operating.md, Partitioned asset events.\n\n"
    )


def ingest_doc(cfg: TableConfig) -> str:
    return f"""# Incremental ingest: `{cfg.name}`

{_header(cfg)}
{_flow(f"its schedule `{cfg.ingest.schedule}` (a data interval per run)", "the source endpoints' replication slots, then the landing zone", f"`lake.{cfg.current_table}` and `lake.{cfg.changelog_table}` ({_KEYED}: the interval's start) and the endpoints' consistent points", _DROP_CHOICE if cfg.approvals.dropped_columns else "none")}## What it does
1. **capture__&lt;endpoint&gt;** — one bounded run of the endpoint's logical replication slot
   (`pgoutput`): writes a heartbeat in every shard, reads every transaction committed before
   it, writes Parquet change events and a manifest to the landing zone, then confirms the slot.
2. **ingest** — Spark: validates the interval's events (malformed ones go to
   `lake.cdc_meta.quarantine`), appends them to `lake.{cfg.changelog_table}`, keeps the latest
   event per key and MERGEs it into `lake.{cfg.current_table}` with an LSN guard. The table's
   watermark (per shard, the LSN reached) is committed with the data.
3. **check_alerts** (teardown, runs even when the ingest failed) — the freshness alert when the
   committed ingest left the table behind its SLA; the capture alerts on its slot's retained WAL.
   Channels and thresholds: `include/alerting.yaml` and the table's `alerts:` (docs/operating.md, Alerts).

Per-run figures: `SELECT * FROM lake.cdc_meta.ingest_runs WHERE table_name = '{cfg.name}' ORDER BY committed_at DESC`.

## How to operate it
- **Rerun an interval**: clear the run's tasks. Capture reuses the run's manifest; ingest
  applies only what the watermark does not have yet, so reruns and backfills converge.
- **A source column dropped**: `decide_dropped` asks (Browse > Required Actions) whether to
  keep it (`keep_null`) or drop it; the answer is kept on the table and `ingest_again` applies
  the batch. A `schema_changes.dropped_columns` entry in the YAML answers for good.
- **Failed with a schema change**: the log names the column and the choices; set
  `schema_changes` in `include/tables/{cfg.name}.yaml`, then clear the task.
- **Failed on the error budget**: read the reasons with
  `SELECT reason, count(*) FROM lake.cdc_meta.quarantine WHERE table_name = '{cfg.name}' GROUP BY 1`;
  fix the source or `column_types`, or raise `ingest.error_budget`, then clear the task.
  **Replaying a quarantine** after the fix: `python -m cdc_lakehouse.cli quarantine replay {cfg.name}`
  applies the events that now pass (never over a newer row) and keeps the others with their reason;
  **clearing** after review: `python -m cdc_lakehouse.cli quarantine clear {cfg.name}`.
- **Slot dropped or invalidated** (the capture fails at once, naming the endpoint): the changes
  are gone from the WAL; trigger `cdc_recover__<endpoint>`, which re-bootstraps that endpoint's
  shards of every table on it and replaces the slot.
- Runs never overlap each other, the table's maintenance or its bootstrap (pool `{cfg.pool}`).
"""


def group_doc(group: str, cfgs: list[TableConfig]) -> str:
    names = ", ".join(f"`{c.name}`" for c in cfgs)
    return f"""# Grouped incremental ingest: `{group}`

{_flow(f"its schedule `{cfgs[0].ingest.schedule}` (a data interval per run)", "the source endpoints' replication slots, then the landing zone", f"each table's current and changelog tables ({_KEYED}: the interval's start)", _DROP_CHOICE)}## What it does
Captures each source endpoint's committed changes up to the interval's end, then ingests
tables {names} in **one Spark application** per run, so many small tables do not each pay a
JVM start, {max(c.ingest.parallel_tables for c in cfgs)} at once (`ingest.parallel_tables`), each on a
Spark session of its own. Each table is applied and committed on its own (landing -> changelog ->
LSN-guarded MERGE, watermark in the same commit); a failing table is reported at the end and does
not stop the others (the task then fails, naming it).

## How to operate it
- **Rerun an interval**: clear the run; each table continues from its own watermark, so a
  rerun or a backfill converges to the same state.
- **A table failed** (schema change, error budget): the task log names the table, the column
  or reason and the choices; fix the config and clear the run.
- **Quarantine**: `python -m cdc_lakehouse.cli quarantine list <table>`; after a fix `replay` applies
  what now passes; `clear` after review.
- Bootstrap and audit: see each table's `cdc_bootstrap__*` and `cdc_audit__*` docs.
"""


def bootstrap_doc(cfg: TableConfig) -> str:
    return f"""# Snapshot bootstrap: `{cfg.name}`

{_header(cfg)}
{_flow("a person (manual)", "every shard of the source table, under an exported snapshot", f"`lake.{cfg.current_table}` and `lake.{cfg.changelog_table}` ({_KEYED}: the run's logical date)", "when the table already holds rows (below)")}## What it does
Makes sure the capture slot and publication exist, then per endpoint creates a temporary
slot whose **exported snapshot** sees exactly the transactions committed before its
consistent point P. Spark reads every shard under that snapshot (ctid ranges in parallel,
at most {cfg.bootstrap.max_connections_per_host} connections per host), writes the rows to
the changelog (op `r`) and replaces the shards in `lake.{cfg.current_table}` in one commit
whose watermark is P. The incremental ingest continues from P: no gap, no overlap.

## How to operate it
- **First load / full re-bootstrap**: trigger with the default params.
- **Re-bootstrap one shard**: trigger with conf `{{"shards": ["<shard>"]}}`. Readers see the
  old rows or the new ones, never a mix; the changelog keeps its history.
- **Re-bootstrap the shards of one endpoint** (its slot was lost): conf `{{"endpoint": "<id>"}}`;
  `cdc_recover__<endpoint>` does it for every table on the endpoint. A lost slot is replaced.
- It stops before writing anything if a table is missing, the key is not unique and not
  null, a column type is unsupported, or the source lacks `wal_level=logical` or privileges.

## Approval
{_approval_doc(cfg)}
"""


def _approval_doc(cfg: TableConfig) -> str:
    if not cfg.approvals.rebootstrap:
        return "Off for this table (`approvals.rebootstrap: false`): every run goes straight to `bootstrap`."
    return (
        "`review` reads what the run would replace. When the table already holds rows at a complete "
        "position (not a first load, not a resumed chunked load), `approve` waits for a person: Browse > "
        "Required Actions shows the shards, their positions and row counts; **Reject** skips the "
        "bootstrap and writes nothing. `CDC_APPROVALS=off` in the workers' environment turns it off."
    )


def replay_doc(cfg: TableConfig) -> str:
    approval = (
        "Off for this table (`approvals.quarantine_replay: false`): every run goes straight to `replay`."
        if not cfg.approvals.quarantine_replay
        else "When events are quarantined, `approve` waits for a person: Browse > Required Actions shows how "
        "many and the most frequent reasons; **Reject** skips the replay and writes nothing. "
        "`CDC_APPROVALS=off` in the workers' environment turns it off."
    )
    return f"""# Quarantine replay: `{cfg.name}`

{_header(cfg)}
{_flow("a person (manual)", f"`{cfg.name}`'s rows of `lake.cdc_meta.quarantine`", f"`lake.{cfg.current_table}` (no asset event: the watermark does not move)", "when events are quarantined (below)")}## What it does
Reads `{cfg.name}`'s rows of `cdc_meta.quarantine` that have a landing payload, runs them through
the ingest's validation against the table's config as it is now, and merges those that pass into
`lake.{cfg.current_table}` under the LSN guard (an event older than the table's row changes
nothing). They leave the quarantine; the others stay with their reason. The watermark does not
move and the changelog is not appended to.

## How to operate it
- Fix the cause first (a column type in the YAML, a source-side correction), then trigger.
- List the quarantine: `python -m cdc_lakehouse.cli quarantine list {cfg.name}`.
- A second run after a successful one finds nothing new to apply.

## Approval
{approval}
"""


def history_doc(cfg: TableConfig) -> str:
    return f"""# History rebuild: `{cfg.name}`

{_header(cfg)}
{_flow("a person (manual)", f"`lake.{cfg.changelog_table}` at its current snapshot", f"`lake.{cfg.history_table}`, every row replaced in one commit (no asset event)")}## What it does
Rebuilds `lake.{cfg.history_table}` (docs/history-tables.md) from the whole changelog: one row
per version of each key, in one commit that carries the changelog snapshot it read. The ingest
keeps the history after each batch; a rebuild is for a history dropped or damaged by hand, or
after a change of how versions are made. It equals the table the ingest keeps, except where
late rows were dropped (docs/history-tables.md, "Late rows").

## How to operate it
- Trigger it; it runs in the table's writer pool, so it waits for an ingest in progress.
- `python spark_jobs/history.py --tables {cfg.name} --mode rebuild` does the same outside Airflow,
  without the pool: pause `{cfg.name}`'s ingest first (a history run that loses the race to the
  rebuild's commit fails its task, and the next one catches up). `--mode incremental` catches up
  with the changelog as the ingest would.
- A rebuild orders versions by LSN across every source server the changelog has seen; after a
  re-bootstrap from another server (`HistoryOrderError`) it is not a way around that error.
- The next ingest's history run continues from the rebuild's position.
"""


def recover_doc(endpoint: str, cfgs: list[TableConfig]) -> str:
    rows = "\n".join(f"- `{c.name}`: shards {', '.join(c.shards_on(endpoint))}" for c in cfgs)
    return f"""# Recovery of endpoint `{endpoint}` after its slot was lost

{_flow("a person (manual), after the endpoint's slot was lost", "the endpoint's shards, under an exported snapshot", f"each table's current and changelog tables ({_KEYED})")}## What it does
Re-bootstraps, table after table, the shards read through endpoint `{endpoint}` (no other
shard), as `cdc_bootstrap__<table>` with conf `{{{{"endpoint": "{endpoint}"}}}}` would:
{rows}

Always the snapshot mode, whatever `bootstrap.mode` says: a chunked run keeps the shards' old
positions. The first one drops the invalidated slot and creates it again; each table's snapshot
is taken after that, so the capture's next runs continue every shard with no gap. Until a table's shards
are done its ingest stops at the landing gap, naming this DAG; nothing is applied past a gap.

## How to operate it
- Trigger it when the capture fails with `SlotLostError` (the alert names the endpoint): after
  `max_slot_wal_keep_size` removed WAL the slot needed, PostgreSQL 18's
  `idle_replication_slot_timeout`, a dropped slot, or a failover to a server without the slot.
- A task that fails can be cleared: a bootstrap replaces its shards atomically.
- Each task runs in its table's writer pool, so it waits for that table's ingest or maintenance.
"""


def maintenance_doc(cfg: TableConfig) -> str:
    m = cfg.maintenance
    return f"""# Daily maintenance: `{cfg.name}`

{_header(cfg)}
{_flow(f"its schedule `{cfg.maintenance.schedule}` (a clock: compaction is due even after a failed hour)", f"`lake.{cfg.current_table}` and `lake.{cfg.changelog_table}`", f"the same tables, rewritten; `lake.{cfg.latest_view}` ({_KEYED})")}## What it does
With Iceberg's own Spark procedures, on the current table and the changelog:
`rewrite_data_files` ({m.compaction}), `rewrite_position_delete_files`, `rewrite_manifests`,
`expire_snapshots` (older than {m.snapshot_retention_hours} h, keeping at least
{m.min_snapshots_to_keep}, never the snapshot holding the watermark nor any snapshot from the oldest
one a consumer holds on, docs/guarantees.md, "Nothing lost"), `remove_orphan_files`
(older than {m.orphan_file_age_hours} h). Then rebuilds `lake.{cfg.latest_view}`, the latest row
per key over the changelog ({m.latest_view}). Before/after figures go to
`lake.cdc_meta.maintenance_runs`.

## How to operate it
- It shares the table's pool with ingest, so the two never run at once.
- **Consumer holds** (feed consumers, derived tables, exports keep the snapshot they read last):
  `python -m cdc_lakehouse.cli holds list`; a retired consumer's: `holds drop --consumer <kind>:<name>`.
- A failed run leaves the table valid (each procedure commits atomically); clear to retry.
"""


def audit_doc(cfg: TableConfig) -> str:
    a = cfg.audit
    return f"""# Hourly audit: `{cfg.name}`

{_header(cfg)}
{_flow(f"its schedule `{cfg.audit.schedule}` (a clock: it checks the state, not one interval)", f"every source shard's keys and `lake.{cfg.current_table}` at its watermark", "`lake.cdc_meta.audit_results` and `lake.cdc_meta.quality_results`; a repair, the current table", f"a repair of more than {cfg.approvals.repair_above_keys} keys" if cfg.approvals.repair_above_keys is not None else "none (approvals.repair_above_keys: null)")}## What it does
Compares the primary keys of every source shard with `lake.{cfg.current_table}` as of its
watermark (mode `{a.mode}`: full key comparison, or per-bucket counts and hashes first with
keys fetched only for differing buckets — which also finds changed values). Keys changed at
the source after the watermark are in flight, not mismatches. A key that mismatches in
{a.consecutive_mismatches} consecutive audits fails the audit and fires the alert. Great
Expectations checks the lake table (key unique and not null, LSN not null, freshness within
{a.freshness_sla_minutes} min from the heartbeats, row count vs source). Repair is
{"on" if a.repair else "off"}: persistent mismatches are re-read from the source and merged
through the ingest's LSN-guarded path. The **check_alerts** teardown alerts when the audit has
failed several runs in a row (`alerts.audit_failed_runs`, see `include/alerting.yaml`).

## Approval
{_repair_approval_doc(cfg)}

## How to read an audit
`SELECT * FROM lake.cdc_meta.audit_results WHERE table_name = '{cfg.name}' ORDER BY audited_at DESC`
gives one row per shard and run (missing, extra, different, in flight, verdict);
`lake.cdc_meta.quality_results` the Great Expectations results; the task log links the
stored Great Expectations report.
"""


def _repair_approval_doc(cfg: TableConfig) -> str:
    limit = cfg.approvals.repair_above_keys
    if not cfg.audit.repair or limit is None:
        return "None: `review` finds no repair left by the audit, and `approve` and `repair` are skipped."
    return (
        f"A repair of more than {limit} persistent keys (`approvals.repair_above_keys`) is not done by "
        "`audit`: `review` shows the keys per shard with samples and `approve` waits for a person "
        "(Browse > Required Actions). **Approve** runs `repair` (the audit again, repairing every "
        "persistent key); **Reject** fails the run and the mismatches stay. Unanswered, it fails when "
        "the next audit is due. `CDC_APPROVALS=off` lifts the limit: the audit repairs at once."
    )


def derived_doc(dcfg: TreeConfig, inputs: list[TableConfig]) -> str:
    n, g = dcfg.nodes, dcfg.grants
    names = ", ".join(f"`lake.{t.current_table}`" for t in inputs)
    root = f"the root's `{n.root_attribute}`, " if n.root_attribute else ""
    grants = (
        f"the effective grants (`{g.principal}` -> `{g.grant}` from `{g.table}.{g.node}`: per principal\n"
        "the nearest explicit grant, the node's own first, then its parent's, up to the root)"
        if g
        else "no grants (none configured)"
    )
    return f"""# Derived tree: `{dcfg.name}`

**Derived table** `{dcfg.name}` from {names}; owner {dcfg.owner}.

{dcfg.description}

{_flow(_ON_EVENTS.format(what=names), f"{names}", f"`lake.{dcfg.output_table}` (asset events with the same key) and `lake.{dcfg.unresolved_table}`")}## What it does
Runs once per partition key of the asset events of {names} (it never
reads a source). Spark places every node of `{n.table}` (`{n.id}` -> `{n.parent}`) in its tree, per shard,
and writes `lake.{dcfg.output_table}`: root, {root}depth, ancestor path (root first) and
{grants}.
Mode `auto` recomputes only the nodes changed since the output's watermark, their descendants
and the unresolved nodes; `full` recomputes every node. Nodes that cannot be placed (parent
missing or in another shard, a cycle, deeper than {dcfg.max_depth}) go to
`lake.{dcfg.unresolved_table}` with the reason and are retried every run.
Details: docs/derived-trees.md.

## How to operate it
- **Unresolved nodes**: `SELECT reason, count(*) FROM lake.{dcfg.unresolved_table} GROUP BY 1`;
  a missing parent usually arrives with a later ingest and resolves by itself; a cycle or a
  too-deep chain is source data to fix (or raise `max_depth` in its file in include/derived/).
- **Recompute everything** (after a config change, or to rule out drift): trigger with
  `{{"mode": "full"}}`.
- **Failed**: the task log names the cause; fix it and clear the task. The next run starts
  from the output's watermark, so nothing is skipped.
- **Too far behind** (`ConsumerLagError`): the inputs keep the snapshots the last run read for
  {dcfg.max_lag_hours} h (`max_lag_hours`, tag `cdc_consumer_derived_{dcfg.name}` on each input);
  a run after that finds them expired and stops: trigger with `{{"mode": "full"}}`.
- Runs never overlap (pool `{dcfg.pool}`); the inputs' ingests are not blocked. Its compaction
  and expiry: `cdc_maintenance__{dcfg.name}`.
"""


def derived_maintenance_doc(dcfg: TreeConfig) -> str:
    m = dcfg.maintenance
    return f"""# Daily maintenance: derived table `{dcfg.name}`

**Derived table** `{dcfg.name}`; owner {dcfg.owner}.

{_flow(f"its schedule `{dcfg.maintenance.schedule}`", f"`lake.{dcfg.output_table}`", "the same tables, rewritten")}## What it does
With Iceberg's own Spark procedures, on `lake.{dcfg.output_table}` and `lake.{dcfg.unresolved_table}`
(merge-on-read: every incremental run adds delete files): `rewrite_data_files` (bin-pack, every
delete file applied), `rewrite_position_delete_files`, `rewrite_manifests`, `expire_snapshots`
(older than {m.snapshot_retention_hours} h, keeping at least {m.min_snapshots_to_keep}, never the
snapshot holding the tree's watermark nor what a consumer such as a serving export holds),
`remove_orphan_files` (older than {m.orphan_file_age_hours} h). Before/after figures go to
`lake.cdc_meta.maintenance_runs`. Settings: `maintenance:` in its file in include/derived/.

## How to operate it
- It shares the derived table's pool (`{dcfg.pool}`) with its runs, so the two never run at once.
- A failed run leaves the tables valid (each procedure commits atomically); clear to retry.
"""


def export_doc(ecfg: ExportConfig, source_table: str) -> str:
    st = ecfg.store
    trigger = (
        f"on schedule `{ecfg.schedule}`"
        if ecfg.schedule
        else f"once per partition key of `lake.{source_table}`'s asset events"
    )
    return f"""# Serving export: `{ecfg.name}`

**Export** of `lake.{source_table}` into {st.kind} namespace `{st.namespace}` (connection
`{st.conn_id}`); owner {ecfg.owner}.

{ecfg.description}

{_flow(f"its schedule `{ecfg.schedule}`" if ecfg.schedule else _ON_EVENTS.format(what=f"`lake.{source_table}`"), f"`lake.{source_table}`, from the version's exported snapshot", f"{st.kind} namespace `{st.namespace}`")}## What it does
Runs {trigger}. The first run (and `full`) writes a new version of the namespace from Spark's
executors, checks it (one key per source row, {ecfg.validate_sample} values decoded and compared), then
switches the alias to it in one atomic step: readers never see a half-written version and fall
back to the previous one. Later runs are incremental: only keys whose values changed since the
version's exported snapshot are upserted, deleted keys are deleted, and the position moves only
after every write succeeded. {ecfg.keep_versions} complete versions are kept. Details: docs/serving-export.md.

## How to operate it
- **Force a full export** (new version, e.g. after a suspected drift): trigger with `{{"mode": "full"}}`.
- **Roll the alias back** to the previous version: trigger with `{{"mode": "rollback"}}`; a second
  rollback rolls forward again. The alias is then held: scheduled runs change nothing (state
  `held` in the log) until you trigger `{{"mode": "full"}}` (a new version from the source as it is)
  or `{{"mode": "resume"}}` (the version readers now use catches up incrementally).
- **Failed**: the alias (full) or the position (incremental) did not move; fix the cause and clear
  the task. A version left half-written by a failed full run is dropped by the next successful full run.
- **Too far behind** (`ConsumerLagError`): the source keeps the exported and pending snapshots for
  {ecfg.max_lag_hours} h after the last run (`max_lag_hours`, tag `cdc_consumer_export_{ecfg.name}`); a
  run after that finds them expired and stops: trigger `{{"mode": "full"}}`.
- Runs never overlap (pool `{ecfg.pool}`).
"""


def feed_doc(cfg: TableConfig, consumer: str, output: str, about: str, max_lag_hours: int) -> str:
    return f"""# Change-feed consumer: `{consumer}`

{about}

{_flow(_ON_EVENTS.format(what=f"`lake.{cfg.current_table}`"), f"`lake.{cfg.changelog_table}` up to the snapshot the event carries", f"`lake.{output}` and its offset, in one commit (asset events with the same key)")}## What it does
Runs once per partition key of `lake.{cfg.current_table}`'s asset events (its ingest's or
bootstrap's, which carry the snapshot id). It reads the table's net changes since the offset
committed with `lake.{output}` (one row per key: upsert or delete), applies them, and commits
the output and the new offset in one Iceberg commit: a run killed anywhere neither skips nor
repeats a change. Contract: docs/change-feed.md.

## How to operate it
- **Where it is**: the offset is the `cdc.feed.offsets` property of the output's newest
  snapshot: `SELECT committed_at, summary['cdc.feed.offsets'] FROM lake.{output}.snapshots`.
- **Failed**: the task log names the cause; fix it and clear the task (it starts from the
  committed offset). An `OffsetConflictError` means another run committed first: look for a
  second deployment; nothing was written by the failed run.
- **Start over**: trigger with `{{"mode": "full"}}` (every live row replaces the output, one
  commit with the new offset), or drop `lake.{output}`; the next run rebuilds it.
- **Too far behind** (`ConsumerLagError`): `lake.{cfg.current_table}` keeps the offset's snapshot
  for {max_lag_hours} h after the consumer's last run (tag `cdc_consumer_feed_{consumer}`); a run
  after that finds it expired and stops, naming the fix: trigger with `{{"mode": "full"}}`.
- **Maintenance**: the `maintenance` task compacts and expires `lake.{output}` once per schedule,
  after a consume (`maintenance_due` skips it otherwise); it never removes the offsets' snapshot.
"""
