"""The workload of the demo, the tests and the benchmarks keeps its block trees whole, as the
product does: the demo's derived tree then has no unresolved node that reads like a bug."""

from __future__ import annotations

from collections import Counter

import psycopg2

from devstack.workload import NotionWorkload


def test_the_workload_leaves_no_block_without_its_parent(pg, unique):
    """Deletes (each block with its subtree), inserts (under a parent that exists) and key changes
    (children follow the block) over a few steps: no block's parent is missing from its shard."""
    db = f"wl_{unique}"
    pg.execute(f"CREATE DATABASE {db}")
    try:
        wl = NotionWorkload(pg.dsn(db), ["s0", "s1"], seed=7)
        wl.create()
        wl.load(blocks_per_shard=600)
        counts: Counter = Counter()
        for _ in range(4):
            counts += wl.step(1000, pk_changes=3)
        assert counts["delete"] >= 40 and counts["pk_change"] >= 10 and counts["insert"] >= 300, counts
        conn = psycopg2.connect(pg.dsn(db))
        try:
            with conn.cursor() as cur:
                orphans = {}
                for s in wl.schemas:
                    cur.execute(
                        f"SELECT count(*) FROM {s}.block b WHERE b.parent_id IS NOT NULL "
                        f"AND NOT EXISTS (SELECT 1 FROM {s}.block p WHERE p.id = b.parent_id)"
                    )
                    orphans[s] = cur.fetchone()[0]
        finally:
            conn.close()
        assert orphans == {"s0": 0, "s1": 0}, orphans
    finally:
        pg.execute(f"DROP DATABASE {db} WITH (FORCE)")
