"""The serving stores' contract, run against each store for real: a private redis-server and
DynamoDB on the local moto server. The export and the reader rely on exactly these behaviours."""

from __future__ import annotations

import json

import pytest
from cdc_lakehouse.serving.dynamodb import DynamoStore
from cdc_lakehouse.serving.encoding import encoder, key_string
from cdc_lakehouse.serving.reader import Reader
from cdc_lakehouse.serving.stores import (
    Alias,
    AliasMoved,
    RedisStore,
    VersionDataMissing,
    VersionMeta,
    parse_dynamodb_uri,
)


@pytest.fixture(params=["redis", "dynamodb"])
def store(request, unique):
    # getfixturevalue: a redis-only run starts no moto server, and the reverse.
    if request.param == "redis":
        s = RedisStore(request.getfixturevalue("redis_server").uri, buckets=8)
    else:
        port = request.getfixturevalue("s3_server").port
        uri = f"dynamodb://local:local@127.0.0.1:{port}/?region=us-east-1&scheme=http"
        s = DynamoStore(uri, table_prefix=f"t{unique}_")
        s.client.meta.events.register("before-parameter-build.dynamodb.BatchWriteItem", _as_strict_as_dynamodb)
    yield s
    s.close()


def _as_strict_as_dynamodb(params, **_):
    # moto applies batches that DynamoDB refuses: more than 25 requests, or a key twice.
    for requests in params["RequestItems"].values():
        keys = [r["PutRequest"]["Item"]["k"] if "PutRequest" in r else r["DeleteRequest"]["Key"]["k"] for r in requests]
        keys = [k["S"] for k in keys]
        assert len(keys) <= 25 and len(set(keys)) == len(keys), keys


@pytest.fixture
def ns(unique):
    return f"ns_{unique}"


def meta(version: int, state: str = "writing") -> VersionMeta:
    # buckets as the redis fixture's: RedisStore records its layout in the metadata it creates.
    return VersionMeta(
        version=version, state=state, value_schema="{}", key_columns=["id"], source="lake.t.block", buckets=8
    )


def test_alias_switches_only_from_the_expected_one(store, ns):
    assert store.alias(ns) is None
    store.switch_alias(ns, None, Alias(current=1))
    assert store.alias(ns) == Alias(current=1)
    for stale in (None, Alias(current=7)):
        with pytest.raises(AliasMoved):
            store.switch_alias(ns, stale, Alias(current=2, previous=1))
    assert store.alias(ns) == Alias(current=1)
    store.switch_alias(ns, Alias(current=1), Alias(current=2, previous=1))
    assert store.alias(ns) == Alias(current=2, previous=1)


def test_write_upserts_and_deletes(store, ns):
    store.new_version(ns, meta(1))
    assert store.write(ns, 1, [("a", b"1"), ("b", b"2"), ("c", b"3"), ("bin", bytes(range(256)))]) == 4
    # A delete of a missing key, and two keys given twice in one call: the last one wins.
    changes = [("b", None), ("never", None), ("c", b"x"), ("c", None), ("a", b"old"), ("a", b"new")]
    assert store.write(ns, 1, changes) == 6
    got = store.read(ns, 1, ["c", "a", "b", "never", "bin", "a"])
    assert got == [None, b"new", None, None, bytes(range(256)), b"new"]
    assert store.count(ns, 1) == 2


def test_large_write_crosses_batches(store, ns):
    store.new_version(ns, meta(1))
    items = [(f"k{i}", i.to_bytes(2, "big")) for i in range(2500)]
    assert store.write(ns, 1, iter(items)) == 2500
    assert store.count(ns, 1) == 2500
    assert store.read(ns, 1, [k for k, _ in items]) == [v for _, v in items]


def test_drop_version_removes_data_meta_and_listing(store, ns):
    for v in (1, 2):
        store.new_version(ns, meta(v))
        store.write(ns, v, [("a", b"1")])
    store.drop_version(ns, 1)
    assert store.versions(ns) == [2]
    assert store.meta(ns, 1) is None and store.meta(ns, 2) == meta(2)
    assert store.count(ns, 1) == 0
    if isinstance(store, DynamoStore):  # its table is gone: the keys are unknown, not absent
        with pytest.raises(VersionDataMissing):
            store.read(ns, 1, ["a"])
    else:  # a Redis version without data looks empty; the reader checks its metadata (below)
        assert store.read(ns, 1, ["a"]) == [None]
    assert store.read(ns, 2, ["a"]) == [b"1"]


def test_put_meta_refuses_a_stale_expected(store, ns):
    store.new_version(ns, meta(1))
    done = meta(1, "complete").model_copy(update={"count": 3})
    store.put_meta(ns, meta(1), done)
    for stale in (None, meta(1)):
        with pytest.raises(AliasMoved):
            store.put_meta(ns, stale, meta(1).model_copy(update={"count": 9}))
    assert store.meta(ns, 1) == done


def test_resolve_returns_complete_current_then_previous(store, ns):
    assert store.resolve(ns) == []
    for v in (1, 2):
        store.new_version(ns, meta(v))
    store.put_meta(ns, meta(1), meta(1, "complete"))
    store.switch_alias(ns, None, Alias(current=2, previous=1))
    assert store.resolve(ns) == [meta(1, "complete")]  # the current one is still writing
    store.put_meta(ns, meta(2), meta(2, "complete"))
    assert store.resolve(ns) == [meta(2, "complete"), meta(1, "complete")]


def test_a_reused_version_number_starts_empty(store, ns):
    store.new_version(ns, meta(1))
    store.write(ns, 1, [("a", b"1"), ("b", b"2")])
    store.drop_version(ns, 1)
    store.new_version(ns, meta(1))
    assert store.count(ns, 1) == 0 and store.read(ns, 1, ["a"]) == [None]
    # A number whose metadata exists is claimed by another run: refused, its data untouched.
    store.write(ns, 1, [("c", b"3")])
    with pytest.raises(AliasMoved):
        store.new_version(ns, meta(1))
    assert store.count(ns, 1) == 1 and store.versions(ns) == [1]


GEN = json.dumps({"type": "record", "name": "value", "fields": [{"name": "gen", "type": "long"}]})


def _published(store, ns: str, version: int, gen: int) -> None:
    """A complete version holding keys 1 and 2, each {"gen": gen}."""
    m = meta(version).model_copy(update={"value_schema": GEN})
    store.new_version(ns, m)
    store.write(ns, version, [(key_string([k]), encoder(GEN)({"gen": gen})) for k in (1, 2)])
    store.put_meta(ns, m, m.model_copy(update={"state": "complete"}))


def test_a_version_dropped_between_resolve_and_read_is_never_read_as_absent(store, ns, monkeypatch):
    """The reader resolved version 1; before its read, an export switches the alias to 2 and the
    retention drops 1. Both keys exist in every version: the answer is version 2's values, never
    "absent". A version whose data is gone under complete metadata raises (DynamoDB can tell)."""
    _published(store, ns, 1, gen=1)
    store.switch_alias(ns, None, Alias(current=1))
    _published(store, ns, 2, gen=2)
    real = store.read

    def switched_and_dropped_first(ns_, version, keys):
        if version == 1:
            store.switch_alias(ns, store.alias(ns), Alias(current=2))
            store.drop_version(ns, 1)
        return real(ns_, version, keys)

    monkeypatch.setattr(store, "read", switched_and_dropped_first)
    assert Reader(store, ns).get_many([[1], [2]]) == (2, [{"gen": 2}, {"gen": 2}])
    if isinstance(store, DynamoStore):
        store.client.delete_table(TableName=store.data_table(ns, 2))
        with pytest.raises(VersionDataMissing, match="version 2 is complete in its metadata but its data is gone"):
            Reader(store, ns).get(1)


def test_a_redis_that_evicts_keys_is_refused(redis_server):
    store = RedisStore(redis_server.uri)
    try:
        store.check()  # the local server: noeviction
        store.client.config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(RuntimeError, match="maxmemory-policy allkeys-lru"):
            store.check()
    finally:
        store.client.config_set("maxmemory-policy", "noeviction")
        store.close()


def test_a_malformed_dynamodb_uri_does_not_echo_its_secret():
    with pytest.raises(ValueError) as err:
        parse_dynamodb_uri("dynamodb://AKIAX:zq9/wv@127.0.0.1:5000/?region=us-east-1")  # `/` not encoded
    assert "zq9" not in str(err.value) and "percent-encode" in str(err.value)
    kw = parse_dynamodb_uri(
        "dynamodb://AKIAX:se%2Fc%2Bret@127.0.0.1:5000/?region=eu-west-1&scheme=http&session_token=a+b%3D"
    )
    assert kw == {
        "region_name": "eu-west-1",
        "endpoint_url": "http://127.0.0.1:5000",
        "aws_access_key_id": "AKIAX",
        "aws_secret_access_key": "se/c+ret",
        "aws_session_token": "a+b=",
    }
