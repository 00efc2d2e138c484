"""The DynamoDB store (docs/serving-export.md).

    {prefix}cdc_serving      the control table: one item per document (the alias, a version's
                             metadata, the version list), hash key `pk`, the JSON in `doc`;
                             compare-and-set is a conditional PutItem / DeleteItem.
    {prefix}{ns}.v{N}        one table per version: hash key `k` (the key string), value `v` (binary).

A table per version, not one shared data table keyed by version: dropping a version is one
DeleteTable, not a scan and a delete per key, and a reused number starts from an empty table.
Counting is a Scan with Select=COUNT because DescribeTable's ItemCount is refreshed only about
every six hours. Tables are on-demand (PAY_PER_REQUEST): a version table is written hard once,
then read, and needs no capacity planning.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from cdc_lakehouse.serving.stores import Item, Store, VersionDataMissing, parse_dynamodb_uri

CONTROL_TABLE = "cdc_serving"
WRITE_BATCH = 25  # BatchWriteItem's limit
READ_BATCH = 100  # BatchGetItem's limit
TABLE_NAME = re.compile(r"[A-Za-z0-9_.-]{3,255}")
TABLE_WAIT = {"Delay": 1, "MaxAttempts": 600}  # a table is ACTIVE in seconds; the default polls every 20 s
RETRY_ATTEMPTS = 40  # unprocessed items / keys: with the capped backoff, a few minutes of throttling


class DynamoStore(Store):
    def __init__(self, uri: str, table_prefix: str = ""):
        import boto3
        from botocore.config import Config

        if table_prefix and not re.fullmatch(r"[A-Za-z0-9_.-]*", table_prefix):
            raise ValueError(f"DynamoDB table_prefix {table_prefix!r}: use only letters, digits, '_', '.' and '-'")
        self.prefix = table_prefix
        self.control = f"{table_prefix}{CONTROL_TABLE}"
        # Standard retry mode backs off on throttling and transient errors of every call.
        cfg = Config(retries={"mode": "standard", "max_attempts": 10})
        self.client = boto3.client("dynamodb", config=cfg, **parse_dynamodb_uri(uri))
        self.errors = self.client.exceptions
        self._control_ready = False

    # --- tables -------------------------------------------------------------------------------
    def data_table(self, ns: str, version: int) -> str:
        name = f"{self.prefix}{ns}.v{version}"
        if not TABLE_NAME.fullmatch(name):
            raise ValueError(
                f"namespace {ns!r} cannot name a DynamoDB table ({name!r}): use only letters, digits, "
                "'_', '.' and '-', and keep table_prefix + namespace + '.vN' between 3 and 255 characters"
            )
        return name

    def _create_table(self, name: str, key: str) -> None:
        try:
            self.client.create_table(
                TableName=name,
                AttributeDefinitions=[{"AttributeName": key, "AttributeType": "S"}],
                KeySchema=[{"AttributeName": key, "KeyType": "HASH"}],
                BillingMode="PAY_PER_REQUEST",
            )
        except self.errors.ResourceInUseException:
            pass  # another process created it first (two exports starting at once): use theirs
        self.client.get_waiter("table_exists").wait(TableName=name, WaiterConfig=TABLE_WAIT)

    def _drop_table(self, name: str) -> None:
        for _ in range(TABLE_WAIT["MaxAttempts"]):
            try:
                self.client.delete_table(TableName=name)
            except self.errors.ResourceNotFoundException:
                return
            except self.errors.ResourceInUseException:
                time.sleep(TABLE_WAIT["Delay"])  # CREATING or UPDATING: it can be deleted once ACTIVE
                continue
            # The name is taken until the deletion ends: a CreateTable right after would fail.
            self.client.get_waiter("table_not_exists").wait(TableName=name, WaiterConfig=TABLE_WAIT)
            return
        raise TimeoutError(f"DynamoDB table {name!r} did not become deletable")

    def _ensure_control(self) -> None:
        if self._control_ready:
            return
        try:
            active = self.client.describe_table(TableName=self.control)["Table"]["TableStatus"] == "ACTIVE"
        except self.errors.ResourceNotFoundException:
            active = False
        if not active:
            self._create_table(self.control, "pk")
        self._control_ready = True

    # --- documents ----------------------------------------------------------------------------
    def get_doc(self, key: str) -> str | None:
        self._ensure_control()
        # Consistent: a compare-and-set must start from the value just written, not a stale replica.
        item = self.client.get_item(TableName=self.control, Key={"pk": {"S": key}}, ConsistentRead=True).get("Item")
        return item["doc"]["S"] if item else None

    def cas_doc(self, key: str, expected: str | None, new: str | None) -> bool:
        self._ensure_control()
        cond: dict[str, Any] = {"ConditionExpression": "attribute_not_exists(pk)"}
        if expected is not None:
            cond = {"ConditionExpression": "doc = :e", "ExpressionAttributeValues": {":e": {"S": expected}}}
        try:
            if new is None:
                self.client.delete_item(TableName=self.control, Key={"pk": {"S": key}}, **cond)
            else:
                item = {"pk": {"S": key}, "doc": {"S": new}}
                self.client.put_item(TableName=self.control, Item=item, **cond)
        except self.errors.ConditionalCheckFailedException:
            return False
        return True

    # --- data ---------------------------------------------------------------------------------
    def create_data(self, ns: str, version: int) -> None:
        name = self.data_table(ns, version)
        self._drop_table(name)  # a number reused after a failed run starts empty
        self._create_table(name, "k")

    def drop_data(self, ns: str, version: int) -> None:
        self._drop_table(self.data_table(ns, version))

    def write(self, ns: str, version: int, items: Iterable[Item]) -> int:
        table = self.data_table(ns, version)
        batch: dict[str, bytes | None] = {}
        n = 0
        for key, value in items:
            # BatchWriteItem refuses two requests on one key; applied in order the last one wins anyway.
            batch[key] = value
            n += 1
            if len(batch) == WRITE_BATCH:
                self._write_batch(table, batch)
                batch = {}
        if batch:
            self._write_batch(table, batch)
        return n  # items given, superseded ones included: as if each had been applied in order

    def _write_batch(self, table: str, batch: dict[str, bytes | None]) -> None:
        requests = [
            {"DeleteRequest": {"Key": {"k": {"S": k}}}}
            if v is None
            else {"PutRequest": {"Item": {"k": {"S": k}, "v": {"B": v}}}}
            for k, v in batch.items()
        ]
        todo: dict[str, Any] = {table: requests}
        for attempt in range(RETRY_ATTEMPTS):
            # A throttled partition hands back what it did not apply, without an error: resend it.
            todo = self.client.batch_write_item(RequestItems=todo).get("UnprocessedItems") or {}
            if not todo:
                return
            _backoff(attempt)
        raise RuntimeError(f"DynamoDB table {table!r}: writes still unprocessed after {RETRY_ATTEMPTS} attempts")

    def read(self, ns: str, version: int, keys: list[str]) -> list[bytes | None]:
        table = self.data_table(ns, version)
        unique = list(dict.fromkeys(keys))  # BatchGetItem refuses a key listed twice
        found: dict[str, bytes] = {}
        try:
            for i in range(0, len(unique), READ_BATCH):
                found.update(self._read_batch(table, unique[i : i + READ_BATCH]))
        except self.errors.ResourceNotFoundException:
            # Not "every key absent": a reader that resolved this version before it was dropped
            # must resolve again (serving.reader), and a lost table must not read as an empty one.
            raise VersionDataMissing(
                f"DynamoDB table {table!r} of namespace {ns!r} version {version} is gone"
            ) from None
        return [found.get(k) for k in keys]

    def _read_batch(self, table: str, keys: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        todo: dict[str, Any] = {table: {"Keys": [{"k": {"S": k}} for k in keys], "ConsistentRead": True}}
        for attempt in range(RETRY_ATTEMPTS):
            resp = self.client.batch_get_item(RequestItems=todo)
            found.update((it["k"]["S"], it["v"]["B"]) for it in resp["Responses"].get(table, []))
            todo = resp.get("UnprocessedKeys") or {}
            if not todo:
                return found
            _backoff(attempt)
        raise RuntimeError(f"DynamoDB table {table!r}: reads still unprocessed after {RETRY_ATTEMPTS} attempts")

    def count(self, ns: str, version: int) -> int:
        pages = self.client.get_paginator("scan").paginate(
            TableName=self.data_table(ns, version), Select="COUNT", ConsistentRead=True
        )
        try:
            return sum(page["Count"] for page in pages)
        except self.errors.ResourceNotFoundException:
            return 0

    def close(self) -> None:
        self.client.close()


def _backoff(attempt: int) -> None:
    time.sleep(min(0.05 * 2**attempt, 5.0))
