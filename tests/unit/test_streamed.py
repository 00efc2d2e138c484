"""Streamed transactions (capture.streamed) on hand-built protocol-2 messages: spooled until their
commit, replayed in order without their xid, aborted ones and rolled-back subtransactions gone."""

from __future__ import annotations

import struct

from cdc_lakehouse.capture.streamed import StreamedTransactions, StreamStats, parse_abort, parse_commit
from cdc_lakehouse.source.pgoutput import Change, decode


def start(xid: int, first: bool) -> bytes:
    return b"S" + struct.pack(">IB", xid, int(first))


def insert(xid: int, relid: int, value: str) -> bytes:
    b = value.encode()
    return b"I" + struct.pack(">II", xid, relid) + b"N" + struct.pack(">h", 1) + b"t" + struct.pack(">i", len(b)) + b


def commit(xid: int, lsn: int) -> bytes:
    return b"c" + struct.pack(">IBqqq", xid, 0, lsn, lsn + 8, 777)


def abort(xid: int, subxid: int) -> bytes:
    return b"A" + struct.pack(">II", xid, subxid)


def values(replayed) -> list[str]:
    out = []
    for _, body in replayed:
        m = decode(body)
        assert isinstance(m, Change)
        out.append(m.new[0])
    return out


def test_a_committed_stream_replays_in_order_without_its_rolled_back_subtransaction(tmp_path):
    s = StreamedTransactions(tmp_path / "streams")
    s.start(start(10, True))
    s.add(insert(10, 5, "a"), 100)
    s.add(insert(11, 5, "b"), 110)  # subtransaction 11, rolled back below
    s.stop()
    s.start(start(20, True))  # another transaction's block in between
    s.add(insert(20, 5, "x"), 115)
    s.stop()
    s.start(start(10, False))
    s.add(insert(12, 5, "c"), 120)
    s.add(b"O" + struct.pack(">q", 1) + b"origin\0", 121)  # an origin: no xid, not kept
    s.stop()
    s.abort(parse_abort(abort(10, 11)))
    m = parse_commit(commit(10, 500))
    assert (m.xid, m.commit_lsn, m.end_lsn, m.commit_ts) == (10, 500, 508, 777)
    replayed = list(s.replay(m))
    assert [p for p, _ in replayed] == [100, 120]
    assert values(replayed) == ["a", "c"]
    s.abort(parse_abort(abort(20, 20)))  # the other one rolls back: gone
    s.close()
    assert s.stats == StreamStats(
        committed=1, aborted=1, subtransactions_aborted=1, spooled_bytes=s.stats.spooled_bytes
    )
    assert not (tmp_path / "streams").exists()


def test_a_transaction_streamed_again_from_its_first_segment_is_spooled_once(tmp_path):
    s = StreamedTransactions(tmp_path / "streams")
    s.start(start(7, True))
    s.add(insert(7, 5, "old"), 10)
    s.stop()
    s.start(start(7, True))  # the server starts it over
    s.add(insert(7, 5, "new"), 10)
    s.stop()
    assert values(s.replay(parse_commit(commit(7, 90)))) == ["new"]


def test_what_is_open_at_the_runs_end_is_dropped_and_counted(tmp_path):
    s = StreamedTransactions(tmp_path / "streams")
    s.start(start(3, True))
    s.add(insert(3, 5, "a"), 10)
    s.stop()
    s.abort(parse_abort(abort(99, 99)))  # a transaction this run never saw streamed
    s.close()
    assert s.stats.open_at_end == 1 and s.stats.aborted == 0
    assert not (tmp_path / "streams").exists()


def test_a_message_outside_a_block_or_a_block_inside_a_block_is_an_error(tmp_path):
    s = StreamedTransactions(tmp_path / "streams")
    try:
        s.add(insert(3, 5, "a"), 10)
    except ValueError as e:
        assert "outside a stream block" in str(e)
    else:
        raise AssertionError("accepted a streamed message outside a block")
    s.start(start(3, True))
    try:
        s.start(start(4, True))
    except ValueError as e:
        assert "inside the open block" in str(e)
    else:
        raise AssertionError("accepted a block inside a block")
