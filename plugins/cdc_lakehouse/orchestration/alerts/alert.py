"""The alert: what it says (summary, details, the fix), in the forms the channels send."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from cdc_lakehouse.secrecy import redact


@dataclass
class Alert:
    kind: str
    summary: str
    tables: list[str]
    details: dict[str, Any]
    fix: str
    state: Literal["firing", "resolved"] = "firing"
    figure: float | None = None
    threshold: float | None = None
    dag_id: str | None = None
    task_id: str | None = None
    run_id: str | None = None
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())

    def __post_init__(self) -> None:
        self.summary = redact(self.summary)
        self.fix = redact(self.fix)
        self.details = {k: redact(v) for k, v in self.details.items() if v is not None}

    @property
    def subject(self) -> str:
        """One line, printable ASCII, at most 100 characters (SNS's limits)."""
        head = (
            "RESOLVED"
            if self.state == "resolved"
            else {"task_failed": "FAILED", "audit_failing": "AUDIT", "wal_retained": "WAL", "freshness": "STALE"}[
                self.kind
            ]
        )
        s = f"[CDC {head}] {self.summary}"
        s = "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in s)
        return s if len(s) <= 100 else s[:97] + "..."

    def text(self) -> str:
        lines = [("Resolved: " if self.state == "resolved" else "") + self.summary, ""]
        lines += [f"{k}: {v}" for k, v in self.details.items()]
        if self.state == "firing":
            lines += ["", f"What to do: {self.fix}"]
        where = ", ".join(
            f"{k} {v}" for k, v in (("DAG", self.dag_id), ("task", self.task_id), ("run", self.run_id)) if v
        )
        if where:
            lines += ["", f"Airflow: {where}"]
        lines += [f"Alert: {self.kind} ({self.state}) at {self.at}"]
        return "\n".join(lines)

    def html(self) -> str:
        return f'<pre style="font-family: monospace">{html.escape(self.text())}</pre>'

    def record(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "kind": self.kind,
            "state": self.state,
            "tables": self.tables,
            "table": self.tables[0] if len(self.tables) == 1 else None,
            "summary": self.summary,
            "details": self.details,
            "figure": self.figure,
            "threshold": self.threshold,
            "fix": self.fix,
            "dag_id": self.dag_id,
            "task_id": self.task_id,
            "run_id": self.run_id,
        }


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "unknown"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"
