"""What every benchmark records besides time: the peak memory of a process tree, and the machine."""

from __future__ import annotations

import json
import os
import platform
import threading
import time


class PeakRSS:
    """Peak resident memory of a process and its children (e.g. the Spark JVM) while active:
    this process by default, or another one by pid."""

    def __init__(self, pid: int | None = None, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
            except psutil.Error:
                pass
            time.sleep(self.interval)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def machine() -> dict:
    import psutil

    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def provenance(spark_version: str) -> dict:
    """Where a result comes from: the command, the commit, when, the machine and Spark."""
    import subprocess
    import sys
    from datetime import UTC, datetime
    from pathlib import Path

    code = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    ).stdout.strip()
    return {
        "command": " ".join(sys.argv),
        "code": code,
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "spark": spark_version,
    }


def last_execution_id(spark) -> int:
    """The newest SQL execution id of the session so far (-1: none): pass it to scan_files."""
    store = spark._jsparkSession.sharedState().statusStore()
    execs = store.executionsList()
    return max((execs.apply(i).executionId() for i in range(execs.size())), default=-1)


# Iceberg's Spark scan metrics, by the description Spark's SQL UI names them with.
_SCAN_METRICS = {
    "number of result data files": "result_data_files",
    "number of skipped data files": "skipped_data_files",
    "number of result delete files": "result_delete_files",
}


_JOINS = ("BroadcastHashJoin", "SortMergeJoin", "ShuffledHashJoin", "BroadcastNestedLoopJoin")


def scan_files(spark, after: int) -> list[dict]:
    """Per SQL execution after `after` that scanned an Iceberg table: the data files its scans
    kept and skipped, from the custom metrics Iceberg's Spark scan reports to the SQL UI
    ("number of result data files", "number of skipped data files"), and whether it was a row-level write (MERGE).
    This is what shows whether a MERGE read every file of the table or pruned some."""
    # The SQL listener runs on Spark's asynchronous event queue: let it catch up first.
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()
    store = spark._jsparkSession.sharedState().statusStore()
    execs = store.executionsList()
    out = []
    for i in range(execs.size()):
        e = execs.apply(i)
        if e.executionId() <= after:
            continue
        values = store.executionMetrics(e.executionId())
        found: dict[str, int] = {}
        seen: set[int] = set()
        metrics = e.metrics()
        for j in range(metrics.size()):
            m = metrics.apply(j)
            name = m.name()
            # Adaptive execution re-lists a plan's metrics on every re-plan: count each once.
            if name not in _SCAN_METRICS or m.accumulatorId() in seen:
                continue
            seen.add(m.accumulatorId())
            name = _SCAN_METRICS[name]
            v = values.get(m.accumulatorId())
            if v.isDefined():
                digits = "".join(ch for ch in str(v.get()) if ch.isdigit())
                found[name] = found.get(name, 0) + int(digits or 0)
        if found:
            plan = e.physicalPlanDescription() or ""
            out.append(
                {
                    "execution": e.executionId(),
                    "merge": any(w in plan for w in ("WriteDelta", "ReplaceData", "MergeRows")),
                    # How the MERGE joined the batch to the table: a sort-merge join shuffles the whole table.
                    "joins": sorted({j for j in _JOINS if j in plan}),
                    "plan": plan,
                    **found,
                }
            )
    return out


def files_holding_keys(spark, table: str, keys_parquet: str, key: str = "id", shard: str = "_cdc_shard") -> dict:
    """How many of `table`'s data files a perfect pruner would still have to read for the batch
    in `keys_parquet`: those whose (shard, key) bounds in the file metadata hold a batch key."""
    import numpy as np
    import pyarrow.parquet as pq

    batch = pq.read_table(keys_parquet, columns=[shard, key]).to_pandas()
    ids, shards = batch[key].to_numpy(), batch[shard].astype(str).to_numpy()
    files = spark.sql(
        f"SELECT readable_metrics.{key}.lower_bound lo, readable_metrics.{key}.upper_bound hi, "
        f"readable_metrics.{shard}.lower_bound slo, readable_metrics.{shard}.upper_bound shi FROM {table}.data_files"
    ).collect()
    holding = 0
    for f in files:
        if f["lo"] is None:  # no stats: it must be read
            holding += 1
            continue
        inside = (ids >= f["lo"]) & (ids <= f["hi"]) & (shards >= str(f["slo"])) & (shards <= str(f["shi"]))
        holding += bool(np.any(inside))
    return {"data_files": len(files), "files_holding_batch_keys": holding}


def worker_result(proc):
    """A bench worker's result, from its `RESULT <json>` line (None if it printed none); its
    other output is printed as it comes. Waits for the worker to end."""
    result = None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
        else:
            print(line, end="", flush=True)
    proc.wait()
    return result
