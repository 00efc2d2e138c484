"""Reading an export the way an online service does: through the alias, never a half-written version.

`get_many` resolves the alias once, so one call never mixes versions; when the current version's
metadata is gone or not complete (dropped, or a store restored without it), it reads the
previous version instead. A key absent from the version it reads is absent: no fallback per key,
which would bring deleted keys back.

A version can be dropped between the resolve and the read (two exports, or a rollback and the
retention, in between): its keys would all read as absent. A drop deletes the version's metadata
before its data (Store.drop_version), so the metadata is read again after the data: unchanged,
the data read was the version's; gone or replaced, the alias is resolved again. After
MAX_RESOLVES attempts, or when a version's data is missing under complete metadata, it raises:
an error, never "absent" for a key that exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cdc_lakehouse.serving.encoding import decoder, key_string
from cdc_lakehouse.serving.stores import Store, VersionDataMissing, VersionMeta

MAX_RESOLVES = 3


class Reader:
    def __init__(self, store: Store, namespace: str):
        self.store = store
        self.ns = namespace
        # By schema text, not version number: a number can be reused (a store wiped or restarted
        # empty), and a long-lived reader must not decode a new version with an old schema.
        self._decoders: dict[str, Callable[[bytes], dict[str, Any]]] = {}

    def get_many(self, keys: list[list[Any] | tuple[Any, ...]]) -> tuple[int, list[dict[str, Any] | None]]:
        """(version read, one decoded value or None per key)."""
        wanted = [key_string(k) for k in keys]
        for _ in range(MAX_RESOLVES):
            metas = self.store.resolve(self.ns)
            if not metas:
                raise LookupError(f"namespace {self.ns!r} has no complete version behind its alias")
            meta = metas[0]
            try:
                raw: list[bytes | None] | None = self.store.read(self.ns, meta.version, wanted)
            except VersionDataMissing:
                raw = None
            if not self._unchanged(meta):
                continue  # dropped (or its number reused) while being read: resolve again
            if raw is None:
                raise VersionDataMissing(
                    f"namespace {self.ns!r}: version {meta.version} is complete in its metadata but its data is "
                    "gone from the store; roll the alias back to an intact version or rerun the export"
                )
            return meta.version, [self._decode(meta.value_schema, v) if v is not None else None for v in raw]
        raise LookupError(
            f"namespace {self.ns!r}: the versions behind its alias were dropped while being read, {MAX_RESOLVES} "
            "times in a row; retry the read (exports or rollbacks are switching the alias faster than it reads)"
        )

    def _unchanged(self, meta: VersionMeta) -> bool:
        """The version's metadata is still the text this read resolved."""
        now = self.store.get_doc(self.store.meta_key(self.ns, meta.version))
        return now is not None and now == meta.expected()

    def _decode(self, value_schema: str, value: bytes) -> dict[str, Any]:
        decode = self._decoders.get(value_schema)
        if decode is None:
            decode = self._decoders[value_schema] = decoder(value_schema)
        return decode(value)

    def get(self, *key: Any) -> dict[str, Any] | None:
        return self.get_many([key])[1][0]


def get(store: Store, namespace: str, *key: Any) -> dict[str, Any] | None:
    """The value of one key (its key columns' values, in order) in the namespace's current version."""
    return Reader(store, namespace).get(*key)
