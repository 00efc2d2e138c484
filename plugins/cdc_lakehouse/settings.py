"""Where the lake lives: catalog, warehouse and landing zone.

The same code runs against the embedded local stack (Iceberg JDBC catalog in a local
PostgreSQL, warehouse and landing on the filesystem) and a real deployment (REST/Glue
catalog, S3 warehouse and landing): only these settings change. Secrets (the catalog
password) are never part of the repr, the Spark command line or config files.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ENV_PREFIX = "CDC_"


@dataclass(frozen=True)
class LakeSettings:
    catalog_type: str = "jdbc"  # jdbc | rest | glue | hadoop
    # jdbc: postgresql://user@host:port/database ; rest: http(s)://... ; glue: unused
    catalog_uri: str = ""
    warehouse: str = ""  # file:///path or s3://bucket/prefix
    landing_uri: str = ""  # file:///path or s3://bucket/prefix
    landing_conn_id: str | None = None  # Airflow AWS connection for an s3:// landing zone
    catalog_name: str = "lake"
    meta_namespace: str = "cdc_meta"
    catalog_properties: dict[str, str] = field(default_factory=dict)
    catalog_password: str | None = field(default=None, repr=False)

    # --- catalog addresses ----------------------------------------------------
    def _pg_parts(self) -> tuple[str, str | None, int, str]:
        u = urlsplit(self.catalog_uri)
        if u.scheme not in ("postgresql", "postgres"):
            raise ValueError(f"jdbc catalog_uri must be postgresql://user@host:port/db, got {self.catalog_uri!r}")
        return unquote(u.username or "postgres"), u.hostname, u.port or 5432, u.path.lstrip("/")

    def jdbc_url(self) -> str:
        _, host, port, db = self._pg_parts()
        return f"jdbc:postgresql://{host}:{port}/{db}"

    def spark_catalog_conf(self, include_secret: bool = True) -> dict[str, str]:
        p = f"spark.sql.catalog.{self.catalog_name}"
        conf = {p: "org.apache.iceberg.spark.SparkCatalog", f"{p}.warehouse": self.warehouse}
        if self.catalog_type == "jdbc":
            user, *_ = self._pg_parts()
            conf.update({
                f"{p}.type": "jdbc",
                f"{p}.uri": self.jdbc_url(),
                f"{p}.jdbc.user": user,
                # V1 schema: the JDBC catalog then stores views too (latest-per-key views).
                f"{p}.jdbc.schema-version": "V1",
            })
            if include_secret and self.catalog_password:
                conf[f"{p}.jdbc.password"] = self.catalog_password
        elif self.catalog_type == "rest":
            conf.update({f"{p}.type": "rest", f"{p}.uri": self.catalog_uri})
        elif self.catalog_type == "glue":
            conf.update({f"{p}.type": "glue"})
        elif self.catalog_type == "hadoop":
            conf.update({f"{p}.type": "hadoop"})
        else:
            raise ValueError(f"unknown catalog_type {self.catalog_type!r}: use jdbc, rest, glue or hadoop")
        if self.warehouse.startswith("s3"):
            conf[f"{p}.io-impl"] = "org.apache.iceberg.aws.s3.S3FileIO"
        for k, v in self.catalog_properties.items():
            conf[f"{p}.{k}"] = v
        return conf

    def pyiceberg_properties(self) -> dict[str, str]:
        """Properties for pyiceberg.catalog.load_catalog: the same catalog Spark sees."""
        props: dict[str, str] = {"warehouse": self.warehouse}
        if self.catalog_type == "jdbc":
            user, host, port, db = self._pg_parts()
            pw = f":{quote(self.catalog_password, safe='')}" if self.catalog_password else ""
            props.update({"type": "sql", "uri": f"postgresql+psycopg2://{quote(user)}{pw}@{host}:{port}/{db}"})
        elif self.catalog_type == "rest":
            props.update({"type": "rest", "uri": self.catalog_uri})
        elif self.catalog_type == "glue":
            props.update({"type": "glue"})
        else:
            raise ValueError(f"pyiceberg has no {self.catalog_type!r} catalog here")
        props.update(self.catalog_properties)
        return props

    def catalog_dsn(self) -> str:
        """libpq DSN of the JDBC catalog database (locks, tests)."""
        user, host, port, db = self._pg_parts()
        dsn = f"host={host} port={port} dbname={db} user={user}"
        return dsn + (f" password={self.catalog_password}" if self.catalog_password else "")

    def qualified(self, table: str) -> str:
        """namespace.table -> catalog.namespace.table (for Spark SQL)."""
        return f"{self.catalog_name}.{table}"

    def meta_table(self, name: str) -> str:
        return f"{self.meta_namespace}.{name}"

    # --- transport ---------------------------------------------------------------
    def to_env(self) -> dict[str, str]:
        """Environment for a Spark job: settings as JSON, the secret in its own variable."""
        public = asdict(self)
        secret = public.pop("catalog_password")
        env = {f"{ENV_PREFIX}LAKE_SETTINGS": json.dumps(public)}
        if secret:
            env[f"{ENV_PREFIX}CATALOG_PASSWORD"] = secret
        return env

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> LakeSettings:
        env = os.environ if environ is None else environ
        raw = env.get(f"{ENV_PREFIX}LAKE_SETTINGS")
        if raw:
            data: dict[str, Any] = json.loads(raw)
        else:
            data = {
                "catalog_type": env.get(f"{ENV_PREFIX}CATALOG_TYPE", "jdbc"),
                "catalog_uri": env.get(f"{ENV_PREFIX}CATALOG_URI", ""),
                "warehouse": env.get(f"{ENV_PREFIX}WAREHOUSE", ""),
                "landing_uri": env.get(f"{ENV_PREFIX}LANDING_URI", ""),
                "landing_conn_id": env.get(f"{ENV_PREFIX}LANDING_CONN_ID") or None,
            }
        data["catalog_password"] = env.get(f"{ENV_PREFIX}CATALOG_PASSWORD") or None
        settings = cls(**data)
        if not settings.warehouse or not settings.landing_uri:
            raise ValueError(
                "lake settings are incomplete: set the Airflow connection 'cdc_lake' "
                "(or CDC_CATALOG_URI, CDC_WAREHOUSE and CDC_LANDING_URI); see README 'Configuration'"
            )
        return settings

    @classmethod
    def from_airflow_connection(cls, conn: Any) -> LakeSettings:
        """Airflow connection: host/port/schema/login/password = the JDBC catalog database;
        extra = {catalog_type, warehouse, landing_uri, landing_conn_id, catalog_uri, catalog_properties}."""
        extra = conn.extra_dejson if hasattr(conn, "extra_dejson") else {}
        ctype = extra.get("catalog_type", "jdbc")
        uri = extra.get("catalog_uri") or (
            f"postgresql://{quote(conn.login or 'postgres')}@{conn.host}:{conn.port or 5432}/{conn.schema}"
            if ctype == "jdbc" else ""
        )
        return cls(
            catalog_type=ctype,
            catalog_uri=uri,
            warehouse=extra.get("warehouse", ""),
            landing_uri=extra.get("landing_uri", ""),
            landing_conn_id=extra.get("landing_conn_id"),
            catalog_name=extra.get("catalog_name", "lake"),
            meta_namespace=extra.get("meta_namespace", "cdc_meta"),
            catalog_properties=dict(extra.get("catalog_properties", {})),
            catalog_password=conn.password or None,
        )

    def with_(self, **kw: Any) -> LakeSettings:
        return replace(self, **kw)


def local_paths(root: Path = PROJECT_ROOT) -> dict[str, Path]:
    """The embedded local stack's folders (all git-ignored)."""
    local = Path(os.environ.get("CDC_LOCAL_DIR", root / ".local"))
    return {
        "local": local,
        "pgdata": local / "pg",
        "airflow_home": local / "airflow",
        "warehouse": local / "warehouse",
        "landing": local / "landing",
        "jars": Path(os.environ.get("CDC_JARS_DIR", root / ".cache" / "jars")),
        "build": root / "build",
    }


def tables_dir(root: Path = PROJECT_ROOT) -> Path:
    return Path(os.environ.get("CDC_TABLES_DIR", root / "include" / "tables"))


# --- source connections ------------------------------------------------------------------------

def _env_key(conn_id: str) -> str:
    import re

    return re.sub(r"[^A-Z0-9]", "_", conn_id.upper())


def source_uri_env(conn_id: str) -> str:
    return f"{ENV_PREFIX}SOURCE_URI__{_env_key(conn_id)}"


def source_uri(conn_id: str, environ: dict[str, str] | None = None) -> str:
    """postgresql:// URI of a source connection, from CDC_SOURCE_URI__<ID> (set by the Airflow task
    for Spark jobs) or Airflow's own AIRFLOW_CONN_<ID> environment variable."""
    env = os.environ if environ is None else environ
    for key in (source_uri_env(conn_id), f"AIRFLOW_CONN_{_env_key(conn_id)}"):
        value = env.get(key)
        if value:
            if value.lstrip().startswith("{"):
                c = json.loads(value)
                auth = quote(c.get("login") or "", safe="")
                if c.get("password"):
                    auth += ":" + quote(c["password"], safe="")
                return f"postgresql://{auth}@{c.get('host')}:{c.get('port') or 5432}/{c.get('schema') or ''}"
            return value
    raise ValueError(
        f"source connection {conn_id!r} is not defined: create the Airflow connection {conn_id!r} "
        f"(or export {source_uri_env(conn_id)}=postgresql://user:password@host:port/database)"
    )


@dataclass(frozen=True)
class SourceEndpoint:
    """Connection details of one source database, derived from a URI; the password stays out of repr."""

    host: str
    port: int
    database: str
    user: str
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_uri(cls, uri: str, database: str | None = None) -> SourceEndpoint:
        u = urlsplit(uri.replace("postgres://", "postgresql://", 1))
        return cls(u.hostname or "localhost", u.port or 5432, database or u.path.lstrip("/") or "postgres",
                   unquote(u.username or "postgres"), unquote(u.password) if u.password else None)

    def dsn(self) -> str:
        dsn = f"host={self.host} port={self.port} dbname={self.database} user={self.user}"
        return dsn + (f" password={self.password}" if self.password else "")

    def jdbc_url(self) -> str:
        return f"jdbc:postgresql://{self.host}:{self.port}/{self.database}"

    @property
    def label(self) -> str:
        return f"{self.host}:{self.port}/{self.database}"
