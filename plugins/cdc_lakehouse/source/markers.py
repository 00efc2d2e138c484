"""The chunked bootstrap's watermark messages in the WAL: how the bootstrap writes them and the
prefix by which the capture recognizes them.

Around each chunk it reads, the bootstrap (bootstrap.chunks) writes a low and a high marker as
transactional logical messages; the capture (capture.stream) records the messages with
MARKER_PREFIX in its run's manifest, so the order of chunks and stream is visible in the landing.
"""

from __future__ import annotations

import json
from typing import Any

from cdc_lakehouse.source.pgoutput import lsn_to_int

# The prefix of the logical messages; the capture records the messages with this prefix.
MARKER_PREFIX = "cdc_lakehouse"


def emit_marker(cur, payload: dict[str, Any]) -> int:
    """A transactional logical message (its own transaction, autocommit); returns its LSN."""
    cur.execute(
        "SELECT pg_logical_emit_message(true, %s, %s)::text",
        (MARKER_PREFIX, json.dumps(payload, separators=(",", ":"), sort_keys=True)),
    )
    return lsn_to_int(cur.fetchone()[0])
