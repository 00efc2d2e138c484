"""The package as Spark receives it on a cluster: a zip for --py-files, rebuilt when stale.

Everything but the Airflow-only `orchestration/` package: executors never import it, and it would
only grow the zip. The development stack (devstack/ at the repository root) is outside the package
and never in the zip.
"""

from __future__ import annotations

import os
import threading
import zipfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
NOT_SHIPPED = ("orchestration",)


def pyfiles_zip(build_dir: Path | None = None) -> Path:
    from cdc_lakehouse.settings import local_paths

    build = build_dir or local_paths()["build"]
    target = build / "cdc_lakehouse.zip"
    sources = sorted(
        p
        for p in PACKAGE_DIR.rglob("*.py")
        if "__pycache__" not in p.parts and p.relative_to(PACKAGE_DIR).parts[0] not in NOT_SHIPPED
    )
    newest = max(p.stat().st_mtime for p in sources)
    if target.exists() and target.stat().st_mtime >= newest:
        return target
    build.mkdir(parents=True, exist_ok=True)
    # One temporary file per thread: a group run's worker threads each start a session, and so
    # may each rebuild a stale zip at once (runtime.session.worker_session).
    tmp = target.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sources:
            zf.write(p, Path("cdc_lakehouse") / p.relative_to(PACKAGE_DIR))
    os.replace(tmp, target)
    return target


if __name__ == "__main__":
    print(pyfiles_zip())
