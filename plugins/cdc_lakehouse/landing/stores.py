"""landing.stores: where landing files live, written by the capture (Airflow worker): a local
directory (files and directories fsynced, manifests replaced atomically) or an s3:// prefix
through the Amazon provider's S3Hook. open_landing picks one from the landing URI."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cdc_lakehouse.landing.format import dump_json
from cdc_lakehouse.landing.writer import DIR_MODE, FILE_MODE, fsync_dir, fsync_file, mkdirs

# --- stores ------------------------------------------------------------------------------------


class LandingUnavailable(RuntimeError):
    """The landing zone cannot be written: raised before a capture reads anything from its slot."""


class LocalLanding:
    """A landing zone on the local filesystem (the embedded default)."""

    def __init__(self, uri: str):
        u = urlsplit(uri)
        self.uri = uri.rstrip("/")
        self.root = Path(u.path if u.scheme == "file" else uri)
        mkdirs(self.root, Path(self.root.resolve().anchor))  # what it creates is private, the root included

    def verify(self) -> None:
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise LandingUnavailable(
                f"landing zone {self.uri}: {self.root} is not writable by this user; fix its "
                "owner or mode, or point the lake connection's landing_uri elsewhere"
            )

    def staging_dir(self) -> Path:
        d = self.root / "_staging" / uuid.uuid4().hex
        mkdirs(d, self.root)
        return d

    def publish_dir(self, staged: Path, rel: str) -> None:
        """Make the staged run directory visible under rel, durably (fsync files and dirs), private
        whoever made it (the capture's mkdir takes the process umask)."""
        os.chmod(staged, DIR_MODE)
        for f in staged.iterdir():
            os.chmod(f, FILE_MODE)
            fsync_file(f)
        target = self.root / rel
        mkdirs(target.parent, self.root)
        if target.exists():  # leftovers of a crashed attempt that never got a manifest
            shutil.rmtree(target)
        os.replace(staged, target)
        fsync_dir(target)
        fsync_dir(target.parent)

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def write_json(self, rel: str, obj: Any) -> None:
        path = self.root / rel
        mkdirs(path.parent, self.root)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "w") as f:
            f.write(dump_json(obj))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def read_json(self, rel: str) -> Any:
        return json.loads((self.root / rel).read_text())

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def list_names(self, rel: str) -> list[str]:
        d = self.root / rel
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def delete(self, rel: str) -> None:
        p = self.root / rel
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    def file_uri(self, rel: str) -> str:
        return f"file://{self.root / rel}"


class S3Landing:
    """A landing zone under an s3:// prefix, written through the Amazon provider's S3Hook."""

    def __init__(self, uri: str, aws_conn_id: str | None = "aws_default", hook: Any = None):
        u = urlsplit(uri)
        self.uri = uri.rstrip("/")
        self.bucket = u.netloc
        self.prefix = u.path.strip("/")
        if hook is None:
            from airflow.providers.amazon.aws.hooks.s3 import S3Hook

            hook = S3Hook(aws_conn_id=aws_conn_id)
        self.hook = hook
        self.aws_conn_id = aws_conn_id

    def verify(self) -> None:
        # check_for_bucket is False for a missing bucket and for one these keys may not see (403).
        if not self.hook.check_for_bucket(self.bucket):
            raise LandingUnavailable(
                f"landing zone {self.uri}: bucket {self.bucket!r} does not exist or the AWS connection "
                f"{self.aws_conn_id!r} cannot reach it; create the bucket, or fix the lake connection's "
                "landing_uri / landing_conn_id, or the AWS connection's keys, region and endpoint_url"
            )

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def staging_dir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="cdc-landing-"))

    def publish_dir(self, staged: Path, rel: str) -> None:
        # Objects become visible one by one; the manifest written afterwards is what commits them.
        for f in sorted(staged.iterdir()):
            self.hook.load_file(str(f), key=self._key(f"{rel}/{f.name}"), bucket_name=self.bucket, replace=True)
        shutil.rmtree(staged, ignore_errors=True)

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def write_json(self, rel: str, obj: Any) -> None:
        self.hook.load_string(
            dump_json(obj),
            key=self._key(rel),
            bucket_name=self.bucket,
            replace=True,
        )

    def read_json(self, rel: str) -> Any:
        return json.loads(self.hook.read_key(self._key(rel), bucket_name=self.bucket))

    def exists(self, rel: str) -> bool:
        return bool(self.hook.check_for_key(self._key(rel), bucket_name=self.bucket))

    def list_names(self, rel: str) -> list[str]:
        prefix = self._key(rel).rstrip("/") + "/"
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=prefix) or []
        return sorted({k[len(prefix) :].split("/")[0] for k in keys if k != prefix})

    def delete(self, rel: str) -> None:
        keys = self.hook.list_keys(bucket_name=self.bucket, prefix=self._key(rel)) or []
        if keys:
            self.hook.delete_objects(bucket=self.bucket, keys=keys)

    def file_uri(self, rel: str) -> str:
        return f"s3://{self.bucket}/{self._key(rel)}"


def open_landing(uri: str, aws_conn_id: str | None = None) -> LocalLanding | S3Landing:
    scheme = urlsplit(uri).scheme
    if scheme in ("", "file"):
        return LocalLanding(uri)
    if scheme in ("s3", "s3a"):
        return S3Landing(uri, aws_conn_id or "aws_default")
    raise ValueError(f"landing URI {uri!r}: use file:///path or s3://bucket/prefix")
