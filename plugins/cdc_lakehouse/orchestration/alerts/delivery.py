"""Delivery: log, record (cdc_alerts.jsonl) and send an alert through every channel that wants it."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cdc_lakehouse.orchestration.alerts.alert import Alert
from cdc_lakehouse.orchestration.alerts.config import AlertingConfig, Channel
from cdc_lakehouse.secrecy import redact

if TYPE_CHECKING:
    from airflow.sdk import Context

log = logging.getLogger(__name__)


def deliver(
    alert: Alert, channels: list[Channel], context: Mapping[str, Any] | None = None, ac: AlertingConfig | None = None
) -> list[str]:
    """Log, record and send the alert through every channel that wants its kind.

    Returns the channels' errors (never raises): one channel's failure never stops the others."""
    level = logging.INFO if alert.state == "resolved" else logging.ERROR
    log.log(level, "CDC ALERT %s (%s): %s", alert.kind, alert.state, alert.text().replace("\n", " | "))
    sent, errors = [], []
    for ch in channels:
        if not ch.wants(alert.kind):
            continue
        try:
            # notify(), not __call__: the message is final; rendering it as a template would
            # evaluate whatever an error text happens to contain.
            # cast: the task's context as Airflow handed it over (or none), which is what Context types.
            ch.notifier(alert).notify(cast("Context", context or {}))
            sent.append(ch.name)
        except Exception as exc:  # noqa: BLE001 - reported, the other channels still get it
            errors.append(f"channel {ch.name!r} ({ch.type}): {redact(exc)}")
            log.error("CDC alert not delivered through channel %r: %s", ch.name, redact(exc))
    _record(alert, sent, errors, ac)
    return errors


def _record(alert: Alert, sent: list[str], errors: list[str], ac: AlertingConfig | None) -> None:
    log_file = (ac or AlertingConfig()).log_file
    home = os.environ.get("AIRFLOW_HOME")
    if not log_file or not (home or os.path.isabs(log_file)):
        return
    try:
        path = Path(home or "/") / log_file
        with open(path, "a") as f:
            f.write(json.dumps({**alert.record(), "sent": sent, "errors": errors}, default=str) + "\n")
    except OSError as exc:
        log.warning("could not record the alert: %s", exc)
