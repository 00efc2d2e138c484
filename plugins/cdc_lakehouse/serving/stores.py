"""Online key-value stores behind one small interface (docs/serving-export.md).

A namespace holds numbered versions; an alias document names the current and the previous
version. Per version: a metadata document (VersionMeta: schema, source position, state) and
the data, key string -> encoded value. Only two primitives need the store's atomicity:
compare-and-set of one small document (the alias, a version's metadata) and batched writes.

    Redis     documents are string keys, swapped by a Lua compare-and-set; a version's data is
              spread over `buckets` hashes ({ns}:v{N}:b{i}; the count is in its metadata), so its
              key count is a few HLENs and dropping it a few UNLINKs, never a SCAN of its entries.
    DynamoDB  documents are items of one control table, swapped by a conditional PutItem;
              a version's data is its own table ({prefix}{ns}.v{N}), dropped whole.

Store URIs carry credentials, so they are secrets: the worker resolves them from an Airflow
connection into CDC_STORE_URI__<CONN> (runtime.secrets hands it to the job), tests and jobs
started by hand set that variable.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Iterator
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, Field, PrivateAttr

Item = tuple[str, bytes | None]  # key string, encoded value (None: delete the key)


class _Doc(BaseModel):
    # The text as read from the store: compare-and-set compares against it, not a re-serialization
    # (a document written by an older release, with fewer fields, would never match one).
    _raw: str | None = PrivateAttr(None)

    @classmethod
    def read(cls, raw: str | None):
        if raw is None:
            return None
        doc = cls.model_validate_json(raw)
        doc._raw = raw
        return doc

    def expected(self) -> str:
        return self._raw if self._raw is not None else self.model_dump_json()

    def __eq__(self, other: object) -> bool:  # the fields, not where the text came from
        return type(other) is type(self) and self.model_dump() == other.model_dump()

    # mutable model: unhashable, as pydantic's own. ignore: typeshed types object.__hash__ as a
    # method, and None is how Python spells "unhashable" (python/mypy#4266).
    __hash__ = None  # type: ignore[assignment]


class Alias(_Doc):
    """Which version readers use, and the one they fall back to."""

    current: int
    previous: int | None = None
    held: bool = Field(False, description="set by a rollback: auto runs leave the alias alone")


class VersionMeta(_Doc):
    """One version's metadata, stored next to its data: a reader decodes any version with it."""

    version: int
    state: Literal["writing", "complete"] = "writing"
    value_schema: str = Field(description="the Avro schema of the values")
    key_columns: list[str]
    source: str = Field(description="catalog-qualified source table")
    snapshot: int | None = Field(None, description="source snapshot the version holds (the exported position)")
    # Snapshots of incremental runs that started writing into this version and did not commit:
    # their keys may hold values of those snapshots, so the next run rewrites them too.
    pending: list[int] = Field(default_factory=list)
    count: int | None = None
    created_at: str = ""
    buckets: int | None = Field(None, description="redis: the hashes its keys are spread over")


def store_uri_env(conn_id: str) -> str:
    return "CDC_STORE_URI__" + "".join(c if c.isalnum() else "_" for c in conn_id).upper()


def store_uri(conn_id: str) -> str:
    """The store's URI from the job's environment (put there by runtime.secrets)."""
    uri = os.environ.get(store_uri_env(conn_id))
    if not uri:
        raise RuntimeError(
            f"no URI for store connection {conn_id!r}: set {store_uri_env(conn_id)} "
            f"(a redis:// or dynamodb:// URI), or run the export from Airflow with a connection {conn_id!r}"
        )
    return uri


def bucket_of(key: str, buckets: int) -> int:
    # crc32, not hash(): it must agree across processes and Python versions.
    return zlib.crc32(key.encode()) % buckets


class Store:
    """What the export and the reader need of a store; subclasses supply the primitives."""

    batch_size = 1000

    # --- primitives ---------------------------------------------------------------------------
    def get_doc(self, key: str) -> str | None:
        raise NotImplementedError

    def cas_doc(self, key: str, expected: str | None, new: str | None) -> bool:
        """Set key to new (None: delete) only if it holds expected (None: absent)."""
        raise NotImplementedError

    def create_data(self, ns: str, version: int) -> None:
        raise NotImplementedError

    def drop_data(self, ns: str, version: int) -> None:
        raise NotImplementedError

    def write(self, ns: str, version: int, items: Iterable[Item]) -> int:
        """Upserts and deletes in batches; returns how many items were applied."""
        raise NotImplementedError

    def read(self, ns: str, version: int, keys: list[str]) -> list[bytes | None]:
        """The values of keys (None: absent); VersionDataMissing when the store can tell that the
        version's data is gone."""
        raise NotImplementedError

    def count(self, ns: str, version: int) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Release connections."""

    def check(self) -> None:
        """Refuse a store that may drop what it holds (called before an export writes)."""

    # --- documents ----------------------------------------------------------------------------
    @staticmethod
    def alias_key(ns: str) -> str:
        return f"{ns}:alias"

    @staticmethod
    def meta_key(ns: str, version: int) -> str:
        return f"{ns}:v{version}:meta"

    @staticmethod
    def versions_key(ns: str) -> str:
        return f"{ns}:versions"

    def alias(self, ns: str) -> Alias | None:
        return Alias.read(self.get_doc(self.alias_key(ns)))

    def switch_alias(self, ns: str, expected: Alias | None, new: Alias) -> None:
        """Atomic: readers see the old alias or the new one. Refused if another writer moved it."""
        old = expected.expected() if expected else None
        if not self.cas_doc(self.alias_key(ns), old, new.model_dump_json()):
            raise AliasMoved(
                f"namespace {ns!r}: the alias changed since this run read it ({old}); another export or a "
                "rollback ran meanwhile. Nothing was switched; rerun the export."
            )
        new._raw = new.model_dump_json()

    def meta(self, ns: str, version: int) -> VersionMeta | None:
        return VersionMeta.read(self.get_doc(self.meta_key(ns, version)))

    def put_meta(self, ns: str, expected: VersionMeta | None, new: VersionMeta) -> None:
        old = expected.expected() if expected else None
        if not self.cas_doc(self.meta_key(ns, new.version), old, new.model_dump_json()):
            raise AliasMoved(f"namespace {ns!r} version {new.version}: its metadata changed under this run")
        new._raw = new.model_dump_json()  # model_copy() carries the source's _raw: now it is this text

    def versions(self, ns: str) -> list[int]:
        raw = self.get_doc(self.versions_key(ns))
        return sorted(json.loads(raw)) if raw else []

    def _set_versions(self, ns: str, change) -> None:
        for _ in range(100):  # compare-and-set loop: concurrent writers of other versions retry
            raw = self.get_doc(self.versions_key(ns))
            new = json.dumps(sorted(change(set(json.loads(raw)) if raw else set())))
            if self.cas_doc(self.versions_key(ns), raw, new):
                return
        raise AliasMoved(f"namespace {ns!r}: could not update its version list")

    def new_version(self, ns: str, meta: VersionMeta) -> None:
        """Register, then create: a version is listed (so retention can drop it) before it has data."""
        alias = self.alias(ns)
        if alias is not None and meta.version in (alias.current, alias.previous):
            raise AliasMoved(f"namespace {ns!r}: version {meta.version} is behind the alias ({alias}); not reused")
        self._set_versions(ns, lambda s: s | {meta.version})
        # Claimed, not overwritten: a second writer that picked the same number stops here.
        self.put_meta(ns, None, meta)
        self.create_data(ns, meta.version)

    def drop_version(self, ns: str, version: int) -> None:
        """Metadata first: a crash half way leaves data no reader can reach, never metadata that
        promises data which is gone. Listed until the end, so a crash leaves it for the next retention."""
        raw = self.get_doc(self.meta_key(ns, version))
        if raw is not None and not self.cas_doc(self.meta_key(ns, version), raw, None):
            raise AliasMoved(f"namespace {ns!r}: version {version}'s metadata changed while it was being dropped")
        self.drop_data(ns, version)
        self._set_versions(ns, lambda s: s - {version})

    # --- reads through the alias --------------------------------------------------------------
    def resolve(self, ns: str) -> list[VersionMeta]:
        """The versions a reader may use, in order: the current, then the previous."""
        a = self.alias(ns)
        if a is None:
            return []
        metas = [self.meta(ns, v) for v in (a.current, a.previous) if v is not None]
        return [m for m in metas if m is not None and m.state == "complete"]


class AliasMoved(RuntimeError):
    """Another writer changed the alias or a version's metadata since this run read it."""


class VersionDataMissing(LookupError):
    """A version's data is not in the store (dropped, or never created): its keys are unknown,
    not absent. Raised by stores that can tell (DynamoDB: its table is gone); a Redis version
    without data looks empty, which the reader tells apart by its metadata (serving.reader)."""


class RedisStore(Store):
    CAS = """
local cur = redis.call('GET', KEYS[1])
if (cur or '') ~= ARGV[1] then return 0 end
if ARGV[3] == '1' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2]) end
return 1
"""

    def __init__(self, uri: str, buckets: int = 64):
        import redis

        self.client = redis.Redis.from_url(uri)
        self.buckets = buckets  # of versions this store creates; others' come from their metadata
        self._layout: dict[tuple[str, int], int] = {}
        self._cas = self.client.register_script(self.CAS)

    def get_doc(self, key: str) -> str | None:
        v = self.client.get(key)
        return v.decode() if isinstance(v, bytes) else v  # bytes: the client does not decode responses

    def cas_doc(self, key: str, expected: str | None, new: str | None) -> bool:
        return bool(self._cas(keys=[key], args=[expected or "", new or "", "1" if new is None else "0"]))

    def _buckets(self, ns: str, version: int) -> int:
        """A version is read and written with the bucket count it was created with, whatever the
        export's config says today."""
        n = self._layout.get((ns, version))
        if n is None:
            meta = self.meta(ns, version)
            n = self._layout[(ns, version)] = (meta.buckets if meta and meta.buckets else None) or self.buckets
        return n

    def _hash(self, ns: str, version: int, key: str) -> str:
        return f"{ns}:v{version}:b{bucket_of(key, self._buckets(ns, version))}"

    def _data_keys(self, ns: str, version: int) -> list[bytes]:
        # The bucket hashes themselves, found by pattern: a few keys per version, not one per entry,
        # so this SCAN is cheap and needs no layout (the metadata may already be gone).
        return list(self.client.scan_iter(match=f"{ns}:v{version}:b*", count=1000))

    def new_version(self, ns: str, meta: VersionMeta) -> None:
        buckets = meta.buckets or self.buckets
        meta = meta.model_copy(update={"buckets": buckets})
        self._layout[(ns, meta.version)] = buckets
        super().new_version(ns, meta)

    def create_data(self, ns: str, version: int) -> None:
        self.drop_data(ns, version)  # a number reused after a failed run starts empty

    def drop_data(self, ns: str, version: int) -> None:
        keys = self._data_keys(ns, version)
        if keys:
            self.client.unlink(*keys)  # freed in the background
        self._layout.pop((ns, version), None)

    def write(self, ns: str, version: int, items: Iterable[Item]) -> int:
        n = 0
        for batch in _batches(items, self.batch_size):
            pipe = self.client.pipeline(transaction=False)
            for key, value in batch:
                if value is None:
                    pipe.hdel(self._hash(ns, version, key), key)
                else:
                    pipe.hset(self._hash(ns, version, key), key, value)
            pipe.execute()
            n += len(batch)
        return n

    def read(self, ns: str, version: int, keys: list[str]) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(self._hash(ns, version, key), key)
        return pipe.execute()

    def count(self, ns: str, version: int) -> int:
        pipe = self.client.pipeline(transaction=False)
        for h in self._data_keys(ns, version):
            pipe.hlen(h)
        return sum(pipe.execute())

    def close(self) -> None:
        self.client.close()

    def check(self) -> None:
        import redis

        try:
            policy = self.client.config_get("maxmemory-policy").get("maxmemory-policy", "noeviction")
        except redis.ResponseError:
            return  # CONFIG is disabled on some managed Redis services: nothing to check with
        # volatile-* policies evict only keys with a TTL, and ours have none.
        if policy is not None and policy.startswith("allkeys-"):
            raise RuntimeError(
                f"the Redis server evicts keys under memory pressure (maxmemory-policy {policy}): an export "
                "would lose keys silently. Set maxmemory-policy to noeviction (or a volatile-* policy) on it"
            )


def _batches(items: Iterable[Item], size: int) -> Iterator[list[Item]]:
    batch: list[Item] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def open_store(kind: str, uri: str, **options: Any) -> Store:
    if kind == "redis":
        return RedisStore(uri, buckets=options.get("buckets", 64))
    if kind == "dynamodb":
        from cdc_lakehouse.serving.dynamodb import DynamoStore

        return DynamoStore(uri, table_prefix=options.get("table_prefix", ""))
    raise ValueError(f"unknown store kind {kind!r} (redis, dynamodb)")


def parse_dynamodb_uri(uri: str) -> dict[str, Any]:
    """dynamodb://[KEY:SECRET@][HOST:PORT]/?region=R[&scheme=http][&session_token=T] -> boto3 kwargs.
    No host: AWS's regional endpoint; no key: the SDK's default credential chain."""
    u = urlsplit(uri)
    # unquote, not parse_qs: a session token's `+` is not a space (percent-encode `&` and `=`).
    q = {unquote(k): unquote(v) for k, _, v in (p.partition("=") for p in u.query.split("&") if p)}
    kw: dict[str, Any] = {"region_name": q.get("region", "us-east-1")}
    try:
        port = u.port
    except ValueError:  # the message would quote part of the netloc, which holds the secret key
        raise ValueError("malformed dynamodb:// store URI: percent-encode the key and secret") from None
    if u.hostname:
        kw["endpoint_url"] = f"{q.get('scheme', 'https')}://{u.hostname}" + (f":{port}" if port else "")
    if u.username:
        kw["aws_access_key_id"] = unquote(u.username)
        kw["aws_secret_access_key"] = unquote(u.password or "")
    if q.get("session_token"):
        kw["aws_session_token"] = q["session_token"]
    return kw
