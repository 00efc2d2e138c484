"""lake.holds (names, lapse arithmetic): pure logic. The holds themselves are tested on real
tables in tests/integration/test_consumer_holds.py."""

from __future__ import annotations

import pytest
from cdc_lakehouse.identifiers import IdentifierError
from cdc_lakehouse.lake.holds import HOUR_MS, Hold, hold_name, lag_error


def test_hold_names_come_from_validated_identifiers_and_name_their_consumer():
    assert hold_name("feed", "block_counts") == "cdc_consumer_feed_block_counts"
    pending = hold_name("export", "tree_x", pending=42)
    assert pending == "cdc_consumer_export_tree_x__pending_42"
    h = Hold("lake.n.t", pending, 42, 0, HOUR_MS)
    assert h.consumer == "export:tree_x" and h.expires_at_ms == HOUR_MS
    assert not h.lapsed(HOUR_MS - 1) and h.lapsed(HOUR_MS)
    assert not Hold("lake.n.t", "cdc_consumer_feed_x", 1, 0, None).lapsed(10**15)  # no RETAIN: kept for ever
    for bad in ("Bad", "x`; DROP TABLE y", ""):
        with pytest.raises(IdentifierError):
            hold_name("feed", bad)
    with pytest.raises(ValueError, match="unknown consumer kind"):
        hold_name("mirror", "x")


def test_the_lag_error_names_consumer_table_snapshot_max_lag_and_fix():
    msg = str(lag_error("derived", "tree", "lake.t.block", 7, 336, "trigger cdc_derived__tree with mode=full"))
    for part in (
        "derived consumer tree",
        "lake.t.block",
        "snapshot 7",
        "336 h",
        "cdc_consumer_derived_tree",
        "mode=full",
    ):
        assert part in msg, (part, msg)
