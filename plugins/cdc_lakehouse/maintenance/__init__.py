"""Maintenance: daily housekeeping with Iceberg's own Spark procedures, so tables stay fit.

Runs on the Spark driver. Targets: a replicated table's current table and changelog, a derived
table's output and unresolved tables, a feed consumer's Iceberg output. Without it the outputs
only grow: a derived table is merge-on-read (delete files with every incremental run), a feed
output gets small files and snapshots with every run.

  targets            Target: one table to maintain, its settings and the position it carries
  rewrite            compaction: rewrite_data_files, rewrite_position_delete_files, rewrite_manifests
  expiry             expire_snapshots (never the position's snapshot nor a consumer's hold), orphans
  verify             what a run must leave as it found it: only rewrites committed, same position
  landing_retention  landing runs every consuming table has applied, removed after their retention
  result             what one run returns, per target
  maintain_table     the maintenance of a replicated table, a derived table or a feed output

The latest-per-key view it publishes for a replicated table is built in views/.
"""
