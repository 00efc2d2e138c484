"""Reading an export the way an online service does: through the alias, never a half-written version.

`get_many` resolves the alias once, so one call never mixes versions; when the current version's
metadata is gone or not complete (dropped, or a store restored without it), it reads the
previous version instead. A key absent from the version it reads is absent: no fallback per key,
which would bring deleted keys back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cdc_lakehouse.serving.encoding import decoder, key_string
from cdc_lakehouse.serving.stores import Store


class Reader:
    def __init__(self, store: Store, namespace: str):
        self.store = store
        self.ns = namespace
        # By schema text, not version number: a number can be reused (a store wiped or restarted
        # empty), and a long-lived reader must not decode a new version with an old schema.
        self._decoders: dict[str, Callable[[bytes], dict[str, Any]]] = {}

    def get_many(self, keys: list[list[Any] | tuple[Any, ...]]) -> tuple[int, list[dict[str, Any] | None]]:
        """(version read, one decoded value or None per key)."""
        metas = self.store.resolve(self.ns)
        if not metas:
            raise LookupError(f"namespace {self.ns!r} has no complete version behind its alias")
        meta = metas[0]
        decode = self._decoders.get(meta.value_schema)
        if decode is None:
            decode = self._decoders[meta.value_schema] = decoder(meta.value_schema)
        raw = self.store.read(self.ns, meta.version, [key_string(k) for k in keys])
        return meta.version, [decode(v) if v is not None else None for v in raw]

    def get(self, *key: Any) -> dict[str, Any] | None:
        return self.get_many([key])[1][0]


def get(store: Store, namespace: str, *key: Any) -> dict[str, Any] | None:
    """The value of one key (its key columns' values, in order) in the namespace's current version."""
    return Reader(store, namespace).get(*key)
