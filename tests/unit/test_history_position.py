"""The position a history commit carries (history.maintain.HistoryPosition): pure logic."""

from cdc_lakehouse.history.maintain import HISTORY_PROP, HistoryPosition, history_position_in
from cdc_lakehouse.lake.snapshots import Snapshot


def test_a_position_survives_its_snapshot_property():
    pos = HistoryPosition(8002709321254461894, {"db.s0": 39231608, "db.s1": 7})
    assert HistoryPosition.from_json(pos.to_json()) == pos
    assert HistoryPosition.from_json('{"changelog_snapshot": 5}') == HistoryPosition(5, {})


def test_the_newest_snapshot_carrying_a_position_is_the_historys():
    old, new = HistoryPosition(1, {"s0": 10}), HistoryPosition(2, {"s0": 20})
    chain = [  # newest first, as lake.snapshots.current_ancestors gives them
        Snapshot(30, 20, "replace"),  # a compaction carries none
        Snapshot(20, 10, "overwrite", {HISTORY_PROP: new.to_json()}),
        Snapshot(10, None, "append", {HISTORY_PROP: old.to_json()}),
    ]
    assert history_position_in(chain) == new
    assert history_position_in(chain[2:]) == old
    assert history_position_in([Snapshot(1, None, "append")]) is None
