"""Serving exports: lake tables copied into online key-value stores (docs/serving-export.md).

Netflix's Bulldozer, plus an incremental mode: versioned namespaces behind an alias switched
atomically, and hourly runs that write only the keys whose rows changed.

  config    export YAML (include/exports/*.yaml) validated into ExportConfig (pure Python)
  encoding  key strings and Avro values; the schema is stored with each version
  stores    the Store interface, Redis (local default) and the documents both stores share
  dynamodb  DynamoDB through boto3 (a table per version, documents in one control table)
  export    one export run on the Spark driver: pin, plan, full or incremental, validate, switch
  reader    get(namespace, key) through the alias, as an online service reads
"""
