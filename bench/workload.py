"""Synthetic Notion-shaped data for the benchmarks, generated with NumPy/pyarrow (no database):
a base table of N blocks in 4 shards, and a change batch in the landing format (about 90%
updates with recency skew, 8% inserts, 2% deletes, hot keys changed several times, a share
of updates leaving the long content out as an unchanged TOAST value).

The expected final state is computed independently with DuckDB from the same inputs, so every
engine's result is checked against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from cdc_lakehouse.landing.format import TYPED_FORMAT
from cdc_lakehouse.landing.writer import ROW_GROUP_ROWS

SHARDS = ["s0", "s1", "s2", "s3"]
COLUMNS = [
    ("id", "bigint", "bigint"),
    ("space_id", "bigint", "bigint"),
    ("type", "character varying(32)", "string"),
    ("properties", "jsonb", "string"),
    ("content", "text", "string"),
    ("updated_at", "timestamp with time zone", "timestamp"),
    ("is_archived", "boolean", "boolean"),
    ("version", "integer", "int"),
    ("score", "numeric(12,4)", "decimal(12,4)"),
]
SCHEMA_JSON = json.dumps(
    [{"name": n, "type": t, "lake_type": lt, "key": n == "id"} for n, t, lt in COLUMNS],
    separators=(",", ":"),
    sort_keys=True,
)
BASE_LSN = 1_000


def _content(ids: np.ndarray, salt: int) -> np.ndarray:
    # ~200 bytes of text per block (a paragraph), varying by id and version.
    word = np.char.add("para ", (ids * 7919 + salt).astype(str))
    return np.char.add(
        word,
        " lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
        "incididunt ut labore et dolore magna aliqua ut enim ad minim veniam quis nostrud",
    )


def base_table(rows: int, seed: int = 1, start: int = 1) -> pa.Table:
    """The current state before the batch: ids start..start+rows-1, shard = id % 4, version 1."""
    rng = np.random.default_rng(seed if start == 1 else [seed, start])
    ids = np.arange(start, start + rows, dtype=np.int64)
    shard = np.array(SHARDS)[ids % 4]
    ts = np.datetime64("2026-01-01T00:00:00", "us") + (ids * 1000).astype("timedelta64[us]")
    return pa.table(
        {
            "_cdc_shard": shard,
            "id": ids,
            "space_id": (ids % 1000).astype(np.int64),
            "type": np.array(["page", "text", "to_do", "heading"])[ids % 4],
            "properties": np.char.add('{"title": "block ', np.char.add(ids.astype(str), '"}')),
            "content": _content(ids, 0),
            "updated_at": pa.array(ts, pa.timestamp("us", tz="UTC")),
            "is_archived": rng.random(rows) < 0.05,
            "version": np.ones(rows, dtype=np.int32),
            "score": pa.array([f"{v}.5000" for v in rng.integers(0, 10_000_000, rows)]).cast(pa.decimal128(12, 4)),
            "_cdc_op": np.full(rows, "c"),
            "_cdc_commit_lsn": np.full(rows, BASE_LSN, dtype=np.int64),
            "_cdc_seq": np.full(rows, -1, dtype=np.int64),
            "_cdc_commit_ts": pa.array(
                np.full(rows, np.datetime64("2026-01-01T00:00:00", "us")), pa.timestamp("us", tz="UTC")
            ),
        }
    )


@dataclass
class Batch:
    table: pa.Table  # landing events
    events: int
    updates: int
    inserts: int
    deletes: int
    toast: int


def change_batch(
    rows: int,
    changes: int,
    seed: int = 2,
    toast_share: float = 0.3,
    txn_size: int = 20,
    *,
    lsn_base: int = BASE_LSN,
    first_new_id: int | None = None,
    update_lo: int = 1,
    delete_pool: np.ndarray | None = None,
    start_ts: str = "2026-06-01T00:00:00",
) -> Batch:
    """`changes` events: updates (recency-skewed, repeats included), inserts of new ids, deletes.
    One of a series (bench/churn_bench.py): commit LSNs above lsn_base, inserts from first_new_id
    (default rows + 1), updates of ids from update_lo up, deletes drawn from delete_pool (ids no
    batch updates: a deleted row is never updated again); commit times from start_ts."""
    rng = np.random.default_rng(seed)
    n_ins = int(changes * 0.08)
    n_del = int(changes * 0.02)
    n_upd = changes - n_ins - n_del
    hot = rng.random(n_upd) < 0.8
    recent_lo = max(update_lo, rows - rows // 10)
    upd_ids = np.where(hot, rng.integers(recent_lo, rows + 1, n_upd), rng.integers(update_lo, rows + 1, n_upd))
    first = rows + 1 if first_new_id is None else first_new_id
    ins_ids = np.arange(first, first + n_ins, dtype=np.int64)
    # A deleted row is never updated later at the source (an update after a delete of the same key
    # would need a re-insert): delete rows this batch does not update, each once.
    pool = np.arange(1, rows + 1, dtype=np.int64) if delete_pool is None else delete_pool
    del_ids = rng.choice(np.setdiff1d(pool, upd_ids), n_del, replace=False)
    ops = np.concatenate([np.full(n_upd, "u"), np.full(n_ins, "c"), np.full(n_del, "d")])
    ids = np.concatenate([upd_ids, ins_ids, del_ids]).astype(np.int64)
    order = rng.permutation(len(ids))
    # Inserts must precede later updates of the same new id; new ids are not updated here.
    ops, ids = ops[order], ids[order]
    n = len(ids)
    seqn = np.arange(n, dtype=np.int64)
    commit_lsn = lsn_base + 100 + (seqn // txn_size) * 1000
    seq = (seqn % txn_size) + 1
    version = (seqn + 2).astype(np.int64)  # which event won is visible in the final state
    toast = (ops == "u") & (rng.random(n) < toast_share)
    shard = np.array(SHARDS)[ids % 4]
    content = np.char.add(_content(ids, 0), np.char.add(" v", version.astype(str)))
    ts = np.datetime64(start_ts, "us") + (seqn * 1000).astype("timedelta64[us]")
    ts_text = np.datetime_as_string(ts, unit="us")
    afters, befores, unav = [], [], []
    for i in range(n):
        if ops[i] == "d":
            afters.append(None)
            befores.append([("id", str(ids[i]))])
            unav.append(None)
            continue
        row = [
            ("id", str(ids[i])),
            ("space_id", str(ids[i] % 1000)),
            ("type", "text"),
            ("properties", f'{{"title": "v{version[i]}"}}'),
            ("updated_at", ts_text[i].replace("T", " ") + "+00"),
            ("is_archived", "f"),
            ("version", str(version[i])),
            ("score", f"{version[i] % 1000}.5000"),
        ]
        if toast[i]:
            unav.append(["content"])
        else:
            row.append(("content", str(content[i])))
            unav.append(None)
        afters.append(row)
        befores.append(None)
    from cdc_lakehouse.landing.format import landing_arrow_schema

    schema = landing_arrow_schema()
    source = pa.StructArray.from_arrays(
        [
            pa.array(["postgresql"] * n),
            pa.array(["bench"] * n),
            pa.array(["bench"] * n),
            pa.array(["bench"] * n),
            pa.array(shard),
            pa.array(["block"] * n),
            pa.array(commit_lsn),
            pa.array(commit_lsn - 10),
            pa.array(commit_lsn // 1000),
            pa.array(seq),
            pa.array(ts, pa.timestamp("us")).cast(pa.timestamp("us", tz="UTC")),
        ],
        fields=list(schema.field("source").type),
    )
    table = pa.Table.from_arrays(
        [
            pa.array(ops),
            pa.array(befores, schema.field("before").type),
            pa.array(afters, schema.field("after").type),
            pa.array(unav, schema.field("unavailable").type),
            source,
            pa.array([SCHEMA_JSON] * n),
            pa.array(np.zeros(n, dtype=np.int64)),
            pa.array(["bench-run"] * n),
        ],
        schema=schema,
    )
    return Batch(table, n, n_upd, n_ins, n_del, int(toast.sum()))


def write_landing(
    batch: Batch, root: Path, endpoint: str, run_id: str, start_lsn: int, landing_format: int = TYPED_FORMAT
) -> dict:
    """The batch as one capture run: Parquet files and a manifest, as capture would write them:
    typed (format 2) through the capture's own writer, or as text (format 1, before issue #56)."""
    d = root / endpoint / "block" / f"run={run_id}"
    d.mkdir(parents=True, exist_ok=True)
    files = []
    per_file = 500_000
    if landing_format == TYPED_FORMAT:
        files = _write_typed(batch, d, endpoint, run_id, per_file)
    for i in range(0, batch.table.num_rows if landing_format != TYPED_FORMAT else 0, per_file):
        name = f"part-{i // per_file:05d}.parquet"
        # Row groups as the capture's writer flushes them (landing.writer.ROW_GROUP_ROWS).
        pq.write_table(batch.table.slice(i, per_file), d / name, compression="snappy", row_group_size=ROW_GROUP_ROWS)
        files.append(
            {"name": name, "rows": min(per_file, batch.table.num_rows - i), "bytes": (d / name).stat().st_size}
        )
    max_lsn = int(np.max(batch.table.column("source").combine_chunks().field("commit_lsn")))
    schemas = {f"{s}.block": json.loads(SCHEMA_JSON) for s in SHARDS}
    manifest = {
        "format": landing_format,
        "run_id": run_id,
        "endpoint": endpoint,
        "start_lsn": start_lsn,
        "end_lsn": max_lsn + 100,
        "last_commit_lsn": max_lsn,
        "last_commit_ts": "2026-06-01T01:00:00+00:00",
        "capped": False,
        "events": batch.events,
        "tables": [
            {
                "table": "block",
                "dir": f"{endpoint}/block/run={run_id}",
                "files": files,
                "events": batch.events,
                "shards": SHARDS,
            }
        ],
        "heartbeats": {
            s: {"commit_lsn": max_lsn + 50, "end_lsn": max_lsn + 100, "commit_ts": "2026-06-01T01:00:00+00:00"}
            for s in SHARDS
        },
        "schemas": schemas,
        "schema_changes": [],
    }
    mdir = root / endpoint / "_manifests"
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / f"{run_id}.json").write_text(json.dumps(manifest))
    return manifest


def _write_typed(batch: Batch, d: Path, endpoint: str, run_id: str, per_file: int) -> list[dict]:
    """The batch's events through landing.writer.TableWriter (the capture's writer: values typed
    per column at each row group); returns the manifest's file entries."""
    from cdc_lakehouse.landing.writer import ImageColumns, TableWriter

    names = [n for n, _, _ in COLUMNS]
    image = ImageColumns(tuple((n, lt) for n, _, lt in COLUMNS), SCHEMA_JSON)
    consts = {
        "connector": "postgresql",
        "endpoint": endpoint,
        "host": "bench",
        "db": "bench",
        "ts_ms": 0,
        "run_id": run_id,
    }
    w = TableWriter(d, consts, file_rows=per_file, table="block")
    t = batch.table
    src = t.column("source").combine_chunks()
    ts_us = src.field("commit_ts").cast(pa.int64()).to_pylist()
    cols = [src.field(k).to_pylist() for k in ("schema", "commit_lsn", "lsn", "xid", "seq")]
    for i, (op, before, after, unav) in enumerate(
        zip(*(t.column(c).to_pylist() for c in ("op", "before", "after", "unavailable")), strict=True)
    ):
        images = [None if img is None else [dict(img).get(n) for n in names] for img in (before, after)]
        schema, commit_lsn, lsn, xid, seq = (c[i] for c in cols)
        w.add(op, images[0], images[1], unav, schema, image, commit_lsn, lsn, xid, seq, ts_us[i])
    return [f.to_dict() for f in w.close()]


def reduced_changes(batch: Batch, base_path: str):
    """Latest event per key with TOAST values filled (DuckDB): what every peer engine applies."""
    import duckdb

    con = duckdb.connect()
    con.register("ev", batch.table)
    return con.execute(f"""
        WITH e AS (
          SELECT op, source.schema AS _cdc_shard, CAST(coalesce(map_extract(after, 'id')[1], map_extract(before, 'id')[1]) AS BIGINT) AS id,
                 after, unavailable, source.commit_lsn AS lsn, source.seq AS seq
          FROM ev),
        l AS (SELECT * FROM e QUALIFY row_number() OVER (PARTITION BY _cdc_shard, id ORDER BY lsn DESC, seq DESC) = 1),
        -- an unchanged TOAST value comes from the key's latest earlier event that carried it, else the base
        prev AS (SELECT _cdc_shard, id, arg_max(map_extract(after, 'content')[1], lsn * 1000000 + seq) AS content
                 FROM e WHERE op <> 'd' AND (unavailable IS NULL OR NOT list_contains(unavailable, 'content'))
                 GROUP BY ALL),
        b AS (SELECT _cdc_shard, id, content FROM read_parquet('{base_path}'))
        SELECT l.op, l._cdc_shard, l.id,
               CAST(map_extract(after, 'space_id')[1] AS BIGINT) AS space_id, map_extract(after, 'type')[1] AS type,
               map_extract(after, 'properties')[1] AS properties,
               coalesce(map_extract(after, 'content')[1], prev.content, b.content) AS content,
               CAST(replace(map_extract(after, 'updated_at')[1], '+00', '') AS TIMESTAMPTZ) AS updated_at,
               map_extract(after, 'is_archived')[1] = 't' AS is_archived,
               CAST(map_extract(after, 'version')[1] AS INTEGER) AS version,
               CAST(map_extract(after, 'score')[1] AS DECIMAL(12,4)) AS score
        FROM l LEFT JOIN prev USING (_cdc_shard, id) LEFT JOIN b USING (_cdc_shard, id)
    """).to_arrow_table()


def expected_checksum(base_path: str, reduced: pa.Table) -> dict:
    """count, and sums over id/version/content length of the final state (base + reduced changes)."""
    import duckdb

    con = duckdb.connect()
    con.register("r", reduced)
    row = con.execute(
        f"SELECT count(*), sum(id), sum(version), sum(length(content)) FROM ({final_state_sql(base_path)})"
    ).fetchone()
    return {"rows": int(row[0]), "sum_id": int(row[1]), "sum_version": int(row[2]), "sum_content": int(row[3])}


def final_state_sql(base_path: str) -> str:
    """(shard, id, version, content) of base + the reduced changes registered as `r` (DuckDB)."""
    return f"""
        SELECT _cdc_shard, id, version, content FROM read_parquet('{base_path}') b
        WHERE NOT EXISTS (SELECT 1 FROM r WHERE r._cdc_shard = b._cdc_shard AND r.id = b.id)
        UNION ALL SELECT _cdc_shard, id, version, content FROM r WHERE op <> 'd'"""
