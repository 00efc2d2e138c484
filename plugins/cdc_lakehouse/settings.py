"""Where the lake lives: catalog, warehouse and landing zone.

The same code runs against the embedded local stack (Iceberg JDBC catalog in a local
PostgreSQL, warehouse and landing on the filesystem) and a real deployment (REST/Glue
catalog, S3 warehouse and landing): only these settings change. Secrets (the catalog
password) are never part of the repr, the Spark command line or config files: what is secret
is decided by cdc_lakehouse.secrecy (by origin; names only as a safety net).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from cdc_lakehouse.secrecy import Secret, is_secret_name, reveal_all

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ENV_PREFIX = "CDC_"
# Secret catalog properties travel as secrets, in this variable (JSON), never in CDC_LAKE_SETTINGS.
SECRET_PROPERTIES_ENV = f"{ENV_PREFIX}CATALOG_SECRET_PROPERTIES"
# The lake connection's extra key of the catalog properties the user marks secret.
SECRET_PROPERTIES_EXTRA = "secret_catalog_properties"


def libpq_quote(value: object) -> str:
    """A libpq connection-string value: single-quoted, backslash and single quote backslash-escaped."""
    text = str(value)
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def libpq_dsn(**params: object) -> str:
    """key='value' pairs for libpq (psycopg2.connect); None and empty values are left out."""
    return " ".join(f"{k}={libpq_quote(v)}" for k, v in params.items() if v is not None and v != "")


@dataclass(frozen=True)
class S3Credentials:
    """Explicit AWS keys. None in LakeSettings = the SDKs' default chain (instance profile, IRSA)."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

    def to_env(self) -> dict[str, str]:
        values = (self.access_key_id, self.secret_access_key, self.session_token)
        return {k: v for k, v in zip(self.ENV, values, strict=True) if v}

    @classmethod
    def from_env(cls, env: Any) -> S3Credentials | None:
        key, secret, token = (env.get(k) or None for k in cls.ENV)
        return cls(key, secret, token) if key and secret else None

    def secrets(self) -> tuple[Secret, Secret, Secret | None]:
        """(access key id, secret key, session token): all secret by origin, the AWS connection."""
        token = Secret(self.session_token, "the lake's AWS session token") if self.session_token else None
        return (
            Secret(self.access_key_id, "the lake's AWS access key id"),
            Secret(self.secret_access_key, "the lake's AWS secret key"),
            token,
        )


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
    # Public catalog properties. A property named like a credential (secrecy.is_secret_name)
    # given here is moved to secret_catalog_properties: the name rule is a safety net.
    catalog_properties: dict[str, str] = field(default_factory=dict)
    # Secret by origin: the catalog properties the user marked secret (the lake connection's
    # extra `secret_catalog_properties`, CDC_CATALOG_SECRET_PROPERTIES). __repr__ shows their names.
    secret_catalog_properties: dict[str, str] = field(default_factory=dict)
    catalog_password: str | None = field(default=None, repr=False)
    # Object storage (s3:// warehouse or landing). Endpoint and region are public settings (from
    # the lake connection's extra, else from the AWS connection); the credentials are secrets,
    # resolved from the AWS connection by the Airflow task and handed to the job out of band.
    s3_conn_id: str | None = None  # AWS connection; default: landing_conn_id, then aws_default
    s3_endpoint: str | None = None  # e.g. http://127.0.0.1:5000 (MinIO, moto); None = AWS
    s3_region: str | None = None
    s3_path_style: bool = False  # True for most S3-compatible servers
    s3_credentials: S3Credentials | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        both = sorted(set(self.catalog_properties) & set(self.secret_catalog_properties))
        if both:
            raise ValueError(
                f"catalog properties {both} are given both as public catalog_properties and as "
                f"{SECRET_PROPERTIES_EXTRA}: keep each in {SECRET_PROPERTIES_EXTRA} only"
            )
        if urlsplit(self.catalog_uri).password:
            raise ValueError(
                "catalog_uri holds a password, and catalog_uri is public (it travels in CDC_LAKE_SETTINGS): "
                "put the password in the lake connection's password field (CDC_CATALOG_PASSWORD)"
            )
        named = {k: v for k, v in self.catalog_properties.items() if is_secret_name(k)}
        if named:  # frozen: the constructor's own normalisation
            object.__setattr__(
                self, "catalog_properties", {k: v for k, v in self.catalog_properties.items() if k not in named}
            )
            object.__setattr__(self, "secret_catalog_properties", {**self.secret_catalog_properties, **named})
        self.secrets()  # each Secret is remembered, for redact() and Airflow's log masker

    def secrets(self) -> list[Secret]:
        """Every secret of these settings, each with its origin."""
        found = [Secret(self.catalog_password, "the lake catalog's password")] if self.catalog_password else []
        found += [s for s in (self.s3_credentials.secrets() if self.s3_credentials else ()) if s]
        found += [Secret(v, f"catalog property {k}") for k, v in self.secret_catalog_properties.items()]
        return found

    # --- catalog addresses ----------------------------------------------------
    def _pg_parts(self) -> tuple[str, str | None, int, str]:
        u = urlsplit(self.catalog_uri)
        if u.scheme not in ("postgresql", "postgres"):
            raise ValueError(f"jdbc catalog_uri must be postgresql://user@host:port/db, got {self.catalog_uri!r}")
        return unquote(u.username or "postgres"), u.hostname, u.port or 5432, u.path.lstrip("/")

    def jdbc_url(self) -> str:
        _, host, port, db = self._pg_parts()
        return f"jdbc:postgresql://{host}:{port}/{db}"

    def spark_catalog_conf(self, include_secret: bool = True) -> dict[str, str | Secret]:
        """The catalog as Spark settings; secret values are Secrets (runtime.session sets them
        into the running session, never onto a command line)."""
        p = f"spark.sql.catalog.{self.catalog_name}"
        conf: dict[str, str | Secret] = {p: "org.apache.iceberg.spark.SparkCatalog", f"{p}.warehouse": self.warehouse}
        if self.catalog_type == "jdbc":
            user, *_ = self._pg_parts()
            conf.update(
                {
                    f"{p}.type": "jdbc",
                    f"{p}.uri": self.jdbc_url(),
                    f"{p}.jdbc.user": user,
                    # V1 schema: the JDBC catalog then stores views too (latest-per-key views).
                    f"{p}.jdbc.schema-version": "V1",
                }
            )
            if include_secret and self.catalog_password:
                conf[f"{p}.jdbc.password"] = Secret(self.catalog_password, "the lake catalog's password")
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
            conf.update({f"{p}.{k}": v for k, v in self.s3_fileio_properties(include_secret).items()})
        for k, v in self.catalog_properties.items():
            conf[f"{p}.{k}"] = v
        if include_secret:
            for k, v in self.secret_catalog_properties.items():
                conf[f"{p}.{k}"] = Secret(v, f"catalog property {k}")
        return conf

    # --- object storage --------------------------------------------------------------
    @property
    def uses_s3(self) -> bool:
        return any(u.startswith(("s3://", "s3a://")) for u in (self.warehouse, self.landing_uri))

    @property
    def aws_conn_id(self) -> str:
        return self.s3_conn_id or self.landing_conn_id or "aws_default"

    def s3_fileio_properties(self, include_secret: bool = True) -> dict[str, str | Secret]:
        """Iceberg S3FileIO catalog properties (the same keys pyiceberg reads). The keys travel with
        the serialized FileIO to executors, so clusters without instance roles work too."""
        props: dict[str, str | Secret] = {}
        if self.s3_endpoint:
            props["s3.endpoint"] = self.s3_endpoint
        if self.s3_region:
            props["client.region"] = self.s3_region
        if self.s3_path_style:
            props["s3.path-style-access"] = "true"
        if include_secret and self.s3_credentials:
            key_id, secret_key, token = self.s3_credentials.secrets()
            props["s3.access-key-id"] = key_id
            props["s3.secret-access-key"] = secret_key
            if token:
                props["s3.session-token"] = token
        return props

    def hadoop_s3_conf(self, include_secret: bool = True) -> dict[str, str | Secret]:
        """Hadoop S3A settings (Spark reads landing Parquet and lists manifests through Hadoop's
        FileSystem); `s3://` is mapped to S3A so both spellings work. Keys without the
        `spark.hadoop.` prefix: the caller adds it for a SparkConf."""
        if not self.uses_s3:
            return {}
        conf: dict[str, str | Secret] = {"fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem"}  # s3a:// is S3A
        if self.s3_endpoint:
            conf["fs.s3a.endpoint"] = self.s3_endpoint
            conf["fs.s3a.connection.ssl.enabled"] = str(self.s3_endpoint.startswith("https")).lower()
        if self.s3_region:
            conf["fs.s3a.endpoint.region"] = self.s3_region
        if self.s3_path_style:
            conf["fs.s3a.path.style.access"] = "true"
        if include_secret and self.s3_credentials:
            key_id, secret_key, token = self.s3_credentials.secrets()
            conf["fs.s3a.access.key"] = key_id
            conf["fs.s3a.secret.key"] = secret_key
            if token:
                conf["fs.s3a.session.token"] = token
                conf["fs.s3a.aws.credentials.provider"] = "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
            else:
                conf["fs.s3a.aws.credentials.provider"] = "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
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
        if self.warehouse.startswith("s3"):
            props.update(reveal_all(self.s3_fileio_properties()))
            if self.s3_region:  # pyiceberg's spelling of the region key
                props["s3.region"] = self.s3_region
        props.update(self.catalog_properties)
        props.update(self.secret_catalog_properties)
        return props

    def catalog_dsn(self) -> str:
        """libpq DSN of the JDBC catalog database (locks, tests); values quoted per libpq rules."""
        user, host, port, db = self._pg_parts()
        return libpq_dsn(host=host, port=port, dbname=db, user=user, password=self.catalog_password)

    def qualified(self, table: str) -> str:
        """namespace.table -> catalog.namespace.table (for Spark SQL)."""
        return f"{self.catalog_name}.{table}"

    def meta_table(self, name: str) -> str:
        return f"{self.meta_namespace}.{name}"

    # --- transport ---------------------------------------------------------------
    def public_env(self) -> dict[str, str]:
        """The settings as JSON without any secret (catalog password, S3 keys, secret catalog
        properties): fit for a command line, a Spark conf or a log."""
        public = asdict(self)
        for name in _SECRET_FIELDS:
            public.pop(name)
        return {f"{ENV_PREFIX}LAKE_SETTINGS": json.dumps(public)}

    def secret_env(self) -> dict[str, str]:
        """The secrets of these settings by variable name; job_secrets delivers them to a job."""
        env: dict[str, str] = {}
        if self.catalog_password:
            env[f"{ENV_PREFIX}CATALOG_PASSWORD"] = self.catalog_password
        if self.s3_credentials:
            env.update(self.s3_credentials.to_env())
        if self.secret_catalog_properties:
            env[SECRET_PROPERTIES_ENV] = json.dumps(self.secret_catalog_properties)
        return env

    def to_env(self) -> dict[str, str]:
        """Everything from_env needs: public_env() and secret_env() together."""
        return {**self.public_env(), **self.secret_env()}

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            if not f.repr:
                continue
            value = getattr(self, f.name)
            if f.name == "secret_catalog_properties":
                value = dict.fromkeys(value, "***")
            shown.append(f"{f.name}={value!r}")
        return f"LakeSettings({', '.join(shown)})"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> LakeSettings:
        env = os.environ if environ is None else environ
        raw = env.get(f"{ENV_PREFIX}LAKE_SETTINGS")
        if raw:
            data: dict[str, Any] = _public_settings(json.loads(raw))
        else:
            data = {
                "catalog_type": env.get(f"{ENV_PREFIX}CATALOG_TYPE", "jdbc"),
                "catalog_uri": env.get(f"{ENV_PREFIX}CATALOG_URI", ""),
                "warehouse": env.get(f"{ENV_PREFIX}WAREHOUSE", ""),
                "landing_uri": env.get(f"{ENV_PREFIX}LANDING_URI", ""),
                "landing_conn_id": env.get(f"{ENV_PREFIX}LANDING_CONN_ID") or None,
                "s3_endpoint": env.get(f"{ENV_PREFIX}S3_ENDPOINT") or None,
                "s3_region": env.get(f"{ENV_PREFIX}S3_REGION") or None,
                "s3_path_style": env.get(f"{ENV_PREFIX}S3_PATH_STYLE", "").lower() in ("1", "true", "yes"),
            }
        data["catalog_password"] = env.get(f"{ENV_PREFIX}CATALOG_PASSWORD") or None
        # Secret by origin, whatever their names: they came through the secrets' channel.
        data["secret_catalog_properties"] = json.loads(env.get(SECRET_PROPERTIES_ENV) or "{}")
        data["s3_credentials"] = S3Credentials.from_env(env)
        settings = cls(**data)
        if not settings.warehouse or not settings.landing_uri:
            raise ValueError(
                "lake settings are incomplete: set the Airflow connection 'cdc_lake' "
                "(or CDC_CATALOG_URI, CDC_WAREHOUSE and CDC_LANDING_URI); see docs/configuration.md, 'Connections and environment'"
            )
        return settings

    @classmethod
    def from_airflow_connection(cls, conn: Any) -> LakeSettings:
        """Airflow connection: host/port/schema/login/password = the JDBC catalog database;
        extra = {catalog_type, warehouse, landing_uri, landing_conn_id, catalog_uri, catalog_properties,
        secret_catalog_properties, s3_conn_id, s3_endpoint, s3_region, s3_path_style}. Secret: the
        password and every value of secret_catalog_properties (docs/secrets.md).

        Or a connection of the Iceberg provider's type `iceberg` (_from_iceberg_connection)."""
        extra = conn.extra_dejson if hasattr(conn, "extra_dejson") else {}
        if getattr(conn, "conn_type", None) == ICEBERG_CONN_TYPE:
            return cls._from_iceberg_connection(conn, extra)
        ctype = extra.get("catalog_type", "jdbc")
        uri = extra.get("catalog_uri") or (
            f"postgresql://{quote(conn.login or 'postgres')}@{conn.host}:{conn.port or 5432}/{conn.schema}"
            if ctype == "jdbc"
            else ""
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
            secret_catalog_properties={k: str(v) for k, v in (extra.get(SECRET_PROPERTIES_EXTRA) or {}).items()},
            catalog_password=conn.password or None,
            s3_conn_id=extra.get("s3_conn_id"),
            s3_endpoint=extra.get("s3_endpoint"),
            s3_region=extra.get("s3_region"),
            s3_path_style=bool(extra.get("s3_path_style", False)),
        )

    @classmethod
    def _from_iceberg_connection(cls, conn: Any, given: Mapping[str, Any]) -> LakeSettings:
        """The form of apache-airflow-providers-apache-iceberg (IcebergHook): host = the catalog
        URI, login/password = OAuth2 client id and secret (REST's `credential`), extra = pyiceberg
        catalog properties (`type`: rest, the default, or glue; `warehouse`; `s3.*` ...) plus
        this project's own keys (landing_uri, landing_conn_id, catalog_name, meta_namespace,
        s3_conn_id, s3_endpoint, s3_region, s3_path_style). Spark gets the same properties."""
        extra = dict(given)  # the connection's extra, a wire format: what is left are pyiceberg's properties
        own = {k: extra.pop(k) for k in _OWN_ICEBERG_EXTRA if k in extra}
        kind = str(extra.pop("type", "rest"))
        if kind not in _ICEBERG_TYPES:
            raise ValueError(
                f"lake connection {getattr(conn, 'conn_id', '?')} (type iceberg): catalog type {kind!r} is not "
                f"supported in this form (only {sorted(_ICEBERG_TYPES)}); for the JDBC catalog use the generic "
                "form with catalog_type: jdbc (docs/production.md)"
            )
        secret = {"credential": f"{conn.login}:{conn.password}"} if conn.login and conn.password else {}
        return cls(
            catalog_type=_ICEBERG_TYPES[kind],
            catalog_uri=(conn.host or "").rstrip("/"),
            warehouse=str(extra.pop("warehouse", "")),
            landing_uri=own.get("landing_uri", ""),
            landing_conn_id=own.get("landing_conn_id"),
            catalog_name=own.get("catalog_name", "lake"),
            meta_namespace=own.get("meta_namespace", "cdc_meta"),
            catalog_properties={k: str(v) for k, v in extra.items()},
            secret_catalog_properties=secret,
            s3_conn_id=own.get("s3_conn_id"),
            s3_endpoint=own.get("s3_endpoint"),
            s3_region=own.get("s3_region"),
            s3_path_style=bool(own.get("s3_path_style", False)),
        )

    def with_(self, **kw: Any) -> LakeSettings:
        return replace(self, **kw)


# apache-airflow-providers-apache-iceberg's connection type: pyiceberg catalog type -> ours.
ICEBERG_CONN_TYPE = "iceberg"
_ICEBERG_TYPES = {"rest": "rest", "glue": "glue"}
_OWN_ICEBERG_EXTRA = (
    "landing_uri",
    "landing_conn_id",
    "catalog_name",
    "meta_namespace",
    "s3_conn_id",
    "s3_endpoint",
    "s3_region",
    "s3_path_style",
)

# The fields of LakeSettings that hold secrets: never in CDC_LAKE_SETTINGS.
_SECRET_FIELDS = ("catalog_password", "s3_credentials", "secret_catalog_properties")


def _public_settings(data: dict[str, Any]) -> dict[str, Any]:
    """CDC_LAKE_SETTINGS as given: public, so it must hold no secret (public_env never puts one
    there; a hand-written one might, and it would then be on command lines already)."""
    secret = [k for k in _SECRET_FIELDS if data.get(k)]
    secret += [f"catalog_properties.{k}" for k in data.get("catalog_properties") or {} if is_secret_name(k)]
    if secret:
        raise ValueError(
            f"{ENV_PREFIX}LAKE_SETTINGS is public (it travels on command lines) but holds {secret}: give the "
            f"catalog password in {ENV_PREFIX}CATALOG_PASSWORD, secret catalog properties as JSON in "
            f"{SECRET_PROPERTIES_ENV}, S3 keys in AWS_*; see docs/secrets.md"
        )
    return {k: v for k, v in data.items() if k not in _SECRET_FIELDS}


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


def derived_dir(root: Path = PROJECT_ROOT) -> Path:
    """The derived tables' configs (docs/derived-trees.md); absent = no derived tables.

    Default: `derived/` next to the tables dir, i.e. include/derived. Next to it rather than under
    PROJECT_ROOT because a Spark job imports this module from the --py-files zip, where
    PROJECT_ROOT is the build dir, and CDC_TABLES_DIR (set wherever jobs run) still points home."""
    env = os.environ.get("CDC_DERIVED_DIR")
    return Path(env) if env else tables_dir(root).parent / "derived"


def exports_dir(root: Path = PROJECT_ROOT) -> Path:
    """The serving exports' configs (docs/serving-export.md): include/exports, beside the tables dir."""
    env = os.environ.get("CDC_EXPORTS_DIR")
    return Path(env) if env else tables_dir(root).parent / "exports"


# --- source connections ------------------------------------------------------------------------


def _env_key(conn_id: str) -> str:
    import re

    return re.sub(r"[^A-Z0-9]", "_", conn_id.upper())


def source_uri_env(conn_id: str) -> str:
    return f"{ENV_PREFIX}SOURCE_URI__{_env_key(conn_id)}"


def _host_list(text: str, default_port: int = 5432) -> list[tuple[str, int]]:
    """`host[:port][,host[:port]...]` (a URI's netloc after its user part, or a connection's
    host field); a host without a port takes default_port. An IPv6 address has its brackets
    when a port follows ([::1]:5432); without them the whole part is the address."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if part.startswith("["):
            host, _, rest = part[1:].partition("]")
            port = rest.lstrip(":")
        elif part.count(":") == 1:
            host, port = part.split(":")
        else:
            host, port = part, ""
        out.append((host or "localhost", int(port) if port else default_port))
    return out


def _netloc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def connection_uri(
    host: str | None, port: int | str | None, login: str | None, password: str | None, schema: str | None
) -> str:
    """postgresql:// URI of a connection's fields; a host field listing several servers (libpq's
    `host:port,host:port`) becomes the URI's host list, each host with its own port or `port`."""
    auth = quote(login or "", safe="")
    if password:
        auth += ":" + quote(password, safe="")
    hosts = _host_list(host or "localhost", int(port or 5432))
    netloc = ",".join(f"{_netloc_host(h)}:{p}" for h, p in hosts)
    return f"postgresql://{auth}@{netloc}/{schema or ''}"


def source_uri(conn_id: str, environ: dict[str, str] | None = None) -> str:
    """postgresql:// URI of a source connection, from CDC_SOURCE_URI__<ID> (set by the Airflow task
    for Spark jobs) or Airflow's own AIRFLOW_CONN_<ID> environment variable."""
    env = os.environ if environ is None else environ
    for key in (source_uri_env(conn_id), f"AIRFLOW_CONN_{_env_key(conn_id)}"):
        value = env.get(key)
        if value:
            if value.lstrip().startswith("{"):
                c = json.loads(value)
                return connection_uri(c.get("host"), c.get("port"), c.get("login"), c.get("password"), c.get("schema"))
            return value
    raise ValueError(
        f"source connection {conn_id!r} is not defined: create the Airflow connection {conn_id!r} "
        f"(or export {source_uri_env(conn_id)}=postgresql://user:password@host:port/database)"
    )


@dataclass(frozen=True)
class SourceEndpoint:
    """Connection details of one source database, derived from a URI; the password stays out of repr.

    A host list (libpq's `host1:port1,host2:port2`, an Airflow connection's host field) names a
    primary and its standbys: every connection goes to whichever of them takes writes
    (target_session_attrs=read-write; JDBC targetServerType=primary), so after a failover the
    endpoint reaches the promoted server with no change of configuration (#52). Connections of
    one bootstrap must reach one server (an exported snapshot is imported by its readers): only
    one of the hosts takes writes at a time."""

    host: str
    port: int
    database: str
    user: str
    password: str | None = field(default=None, repr=False)
    other_hosts: tuple[tuple[str, int], ...] = ()  # after (host, port), in the order libpq tries them

    def __post_init__(self) -> None:
        if self.password:  # a connection's password: secret by origin, known to redact() from now on
            Secret(self.password, f"password of source {self.host}:{self.port}")

    @classmethod
    def from_uri(cls, uri: str, database: str | None = None) -> SourceEndpoint:
        u = urlsplit(uri.replace("postgres://", "postgresql://", 1))
        hosts = _host_list(unquote(u.netloc.rpartition("@")[2]))  # Airflow's get_uri quotes ':' and ','
        user, password = u.username, u.password
        (host, port), *others = hosts or [("localhost", 5432)]
        return cls(
            host,
            port,
            database or u.path.lstrip("/") or "postgres",
            unquote(user or "postgres"),
            unquote(password) if password else None,
            tuple(others),
        )

    @property
    def hosts(self) -> tuple[tuple[str, int], ...]:
        return ((self.host, self.port), *self.other_hosts)

    def dsn(self) -> str:
        if not self.other_hosts:
            return libpq_dsn(
                host=self.host, port=self.port, dbname=self.database, user=self.user, password=self.password
            )
        return libpq_dsn(
            host=",".join(h for h, _ in self.hosts),
            port=",".join(str(p) for _, p in self.hosts),
            dbname=self.database,
            user=self.user,
            password=self.password,
            target_session_attrs="read-write",
        )

    def jdbc_url(self) -> str:
        hosts = ",".join(f"{_netloc_host(h)}:{p}" for h, p in self.hosts)
        return f"jdbc:postgresql://{hosts}/{self.database}" + ("?targetServerType=primary" if self.other_hosts else "")

    @property
    def label(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.hosts) + f"/{self.database}"
