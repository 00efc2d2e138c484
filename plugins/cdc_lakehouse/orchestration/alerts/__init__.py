"""Alerts through Airflow's notifiers: e-mail (SMTP), Amazon SNS, Slack or any provider's notifier.

Four kinds, each naming the table, the shard or endpoint where relevant, the figure, the
threshold and what to do:

  task_failed    every CDC task's on_failure_callback (CdcFailureNotifier), after its retries
  audit_failing  the audit of a table failed N runs in a row   (teardown task check_alerts of cdc_audit__T)
  wal_retained   a capture slot retains more WAL than allowed  (the capture task, which does not fail for it)
  freshness      the lake lags its sources beyond the SLA      (teardown task check_alerts of the ingest DAG)
                 or an ingest run is still unfinished when it passes (the ingest DAG's deadline, deadlines.py)

Channels and default thresholds are data: include/alerting.yaml (or the file named by
CDC_ALERTING_FILE), validated here; per-table thresholds are the table YAML's `alerts:` and its
`alert_emails` get every alert of the table by e-mail. Every alert is also a log line and a
JSON line in $AIRFLOW_HOME/cdc_alerts.jsonl, with the delivery result per channel.

Alert storms: the state of a condition is derived from the run history the jobs already keep in
cdc_meta (audit_results, quality_results, capture_runs, ingest_runs), so no other state exists.
A condition alerts on the run where it starts (for audits: the N-th failed run in a row), then
again every `renotify_every_runs` runs while it lasts, and once with "resolved" on the first
run where it is gone. A failed task alerts every time it fails for good (after its retries).

Secrets: error texts can hold DSNs. Every text passes secrecy.redact() (every secret value this
process knows by origin, credential-named key=value pairs, Authorization headers, user:pass@ in
URLs, and Airflow's own masked secrets) before it is logged, written or sent, and notifiers
get a finished message through notify(): nothing from an error is rendered as a Jinja template.

Module level imports stay light: this package is imported while DAGs are parsed.

  config    include/alerting.yaml: channels, default thresholds; a table's rules and channels
  alert     the alert and its forms (subject, text, HTML, JSON record)
  delivery  log, record and send an alert through its channels
  failures  failed tasks: CdcFailureNotifier, the on_failure_callback of every CDC task
  checks    the rules over the run history in cdc_meta (WAL, audits, freshness; the storm rule)
  task_checks  what the tasks call: run_checks (check_alerts tasks) and notify_wal (capture)
"""

from cdc_lakehouse.orchestration.alerts.checks import (
    check_audit,
    check_freshness,
    check_shard_freshness,
    check_wal,
    decide,
)
from cdc_lakehouse.orchestration.alerts.config import (
    AlertConfigError,
    AlertDeliveryError,
    AlertingConfig,
    SlackChannel,
    alerting_errors,
    channels_for,
    load_alerting,
    rules_for,
)
from cdc_lakehouse.orchestration.alerts.failures import CdcFailureNotifier, failure_alert, on_task_failure
from cdc_lakehouse.orchestration.alerts.task_checks import notify_wal, run_checks
from cdc_lakehouse.secrecy import redact

# What DAG files, tasks and tests import from here (redact stays in cdc_lakehouse.secrecy).
__all__ = [
    "AlertConfigError",
    "AlertDeliveryError",
    "AlertingConfig",
    "CdcFailureNotifier",
    "SlackChannel",
    "alerting_errors",
    "channels_for",
    "check_audit",
    "check_freshness",
    "check_shard_freshness",
    "check_wal",
    "decide",
    "failure_alert",
    "load_alerting",
    "notify_wal",
    "on_task_failure",
    "redact",
    "rules_for",
    "run_checks",
]
