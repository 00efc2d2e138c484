"""lake.columns: split out of lake.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass

# Changelog-only metadata columns.
LSN_EVENT_COL = "_cdc_lsn"
XID_COL = "_cdc_xid"
UNAVAILABLE_COL = "_cdc_unavailable"
RUN_COL = "_cdc_run_id"
INGESTED_COL = "_cdc_ingested_at"
