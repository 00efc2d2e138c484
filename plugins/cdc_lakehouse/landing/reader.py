"""landing.reader: the landing zone as the ingest reads it (Spark driver): the manifests of an
endpoint in capture order (parsed into `Manifest`s as they are read), the plan of pending runs for
a table (gaps, coverage, server identity, missing files) and its new watermark, and its files read
from Python (pyarrow)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from cdc_lakehouse.config import TableConfig
from cdc_lakehouse.landing.errors import CoverageError, NotBootstrapped, SourceIdentityChanged
from cdc_lakehouse.landing.format import MANIFEST_DIR, LandedColumn, Manifest, SchemaChange, parse_manifest
from cdc_lakehouse.source.publication import identity_mismatch
from cdc_lakehouse.watermark import ServerIdentity

if TYPE_CHECKING:
    from pyarrow import fs as pafs
    from pyspark.sql import SparkSession

    from cdc_lakehouse.watermark import ShardPosition, Watermark


class ManifestStore(Protocol):
    """What manifests are read through: a landing store (landing.stores) or SparkLanding."""

    def list_names(self, rel: str) -> list[str]: ...

    def read_json(self, rel: str) -> Any: ...


def list_manifests(store: ManifestStore, endpoint: str) -> list[Manifest]:
    """Every manifest of an endpoint, in capture order (by the slot position they start at)."""
    names = [n for n in store.list_names(f"{endpoint}/{MANIFEST_DIR}") if n.endswith(".json")]
    manifests = [parse_manifest(store.read_json(f"{endpoint}/{MANIFEST_DIR}/{n}")) for n in names]
    return sorted(manifests, key=lambda m: (m.end_lsn, m.run_id))


@dataclass(frozen=True)
class EndpointSchemaChange:
    """A schema change a run of `endpoint` announced (its table is `schema.table`, the schema the
    shard's on that endpoint)."""

    endpoint: str
    change: SchemaChange


@dataclass
class Plan:
    """The batch an ingest applies: the capture runs (in slot order), the table's files in them,
    the watermark once they are applied, the landing problems met and the schema changes announced.
    A Debezium-fed table's runs are its sink objects and heartbeats (landing.debezium)."""

    manifests: list[Manifest]
    files: list[str]
    new_watermark: Watermark
    problems: list[str] = field(default_factory=list)
    schema_changes: list[EndpointSchemaChange] = field(default_factory=list)
    # file URI -> its images' columns, for the typed files (format 2); the others hold text (format 1)
    typed: dict[str, list[LandedColumn]] = field(default_factory=dict)
    # file URI -> its rows, as its run's manifest lists them
    rows: dict[str, int] = field(default_factory=dict)

    def file_columns(self) -> dict[str, list[LandedColumn] | None]:
        """Every file of the batch with its images' columns (None: a text file, format 1)."""
        return {f: self.typed.get(f) for f in self.files}

    def landed_rows(self) -> int | None:
        """The rows in the batch's files, None where a file's are not known."""
        if any(f not in self.rows for f in self.files):
            return None
        return sum(self.rows[f] for f in self.files)


def shard_endpoints(cfg: TableConfig) -> dict[str, list[tuple[str, str]]]:
    """endpoint id -> [(schema, shard name)]"""
    out: dict[str, list[tuple[str, str]]] = {}
    for g, schema, shard in cfg.shards():
        out.setdefault(g.endpoint_id, []).append((schema, shard))
    return out


def plan_landing(
    landing: SparkLanding, cfg: TableConfig, watermark: Watermark, upto_run: str | None, check_files: bool = True
) -> Plan:
    """Pending capture runs for this table, in slot order, stopping before any gap."""
    shards_wm = watermark.shards
    new_wm = watermark.model_copy(deep=True)
    new_wm.runs = dict(new_wm.runs)  # set: the new watermark always lists the runs applied
    selected: list[Manifest] = []
    files: list[str] = []
    typed: dict[str, list[LandedColumn]] = {}
    rows: dict[str, int] = {}
    problems: list[str] = []
    changes: list[EndpointSchemaChange] = []
    for endpoint, shards in sorted(shard_endpoints(cfg).items()):
        missing = [shard for _, shard in shards if shard not in shards_wm]
        if missing:
            raise NotBootstrapped(
                f"{cfg.name}: shard(s) {missing} have no watermark, so they were never bootstrapped; trigger "
                f'cdc_bootstrap__{cfg.name} (conf {{"shards": {missing}}}) before ingesting them'
            )
        manifests = same_source_manifests(cfg, endpoint, shards, shards_wm, list_manifests(landing, endpoint))
        floor = min(shards_wm[shard].lsn for _, shard in shards)
        pending = [m for m in manifests if m.end_lsn > floor]
        reached = floor
        last = None
        for m in pending:
            if upto_run is not None and m.run_id > upto_run:
                break  # a later interval's capture; never skip over it to reach an older-named run
            start = m.start_lsn
            if start is not None and start > reached:
                problems.append(
                    f"{cfg.name}: landing gap on endpoint {endpoint}: changes between LSN {reached} and {start} are "
                    f"in no manifest (run {m.run_id} starts after the table's position): a landing run was lost or "
                    "deleted before this table applied it, or the endpoint's slot was lost and replaced. Either way "
                    f"those changes are gone: re-bootstrap the table's shards on the endpoint (cdc_recover__{endpoint} "
                    f'for every table on it, or cdc_bootstrap__{cfg.name} with {{"endpoint": "{endpoint}"}})'
                )
            check_coverage(cfg, endpoint, shards, shards_wm, m)
            files += _run_files(landing, cfg, m, check_files, problems, typed, rows)
            for ch in m.schema_changes:
                if ch.table.split(".", 1)[-1] == cfg.source.table:
                    changes.append(EndpointSchemaChange(endpoint, ch))
            selected.append(m)
            reached = max(reached, m.end_lsn)
            last = m
        if last is not None:
            _advance(new_wm, endpoint, shards, shards_wm, last)
    return Plan(selected, files, new_wm, problems, changes, typed, rows)


def _run_files(
    landing: SparkLanding,
    cfg: TableConfig,
    m: Manifest,
    check_files: bool,
    problems: list[str],
    typed: dict[str, list[LandedColumn]],
    rows: dict[str, int],
) -> list[str]:
    """URIs of the table's files in run m; a listed file that is missing or truncated is a problem
    (and left out) when check_files. The typed files' columns go to `typed`, every file's rows to
    `rows`."""
    out = []
    for _table, rel, info in m.files({cfg.source.table}):
        uri = landing.file_uri(rel)
        if check_files:
            size = landing.fs.size(uri)
            if size is None or ("bytes" in info.model_fields_set and size != info.bytes):
                state = "missing" if size is None else f"truncated ({size} of {info.bytes} bytes)"
                problems.append(f"{cfg.name}: landing file {uri} listed by run {m.run_id} is {state}")
                continue
        if info.columns is not None:
            typed[uri] = list(info.columns)
        rows[uri] = info.rows
        out.append(uri)
    return out


def _advance(
    new_wm: Watermark,
    endpoint: str,
    shards: list[tuple[str, str]],
    shards_wm: dict[str, ShardPosition],
    last: Manifest,
) -> None:
    """Move the endpoint's shards in new_wm to the end of `last`, the last run applied."""
    for schema, shard in shards:
        hb = last.heartbeats.get(schema)
        prev = shards_wm[shard]
        if last.end_lsn > prev.lsn:
            # Keep what else the position records. The server identity becomes the run's (runs
            # get here only if same_source_manifests compared them): after a failover the
            # position is on the promoted server's timeline, and later runs compare with that.
            moved = {
                "lsn": last.end_lsn,
                "endpoint": endpoint,
                "source": last.source_identity or prev.source,
                "ts": hb.commit_ts if hb else _last_commit_ts(last, prev.ts),
            }
            new_wm.set_shard(shard, prev.model_copy(deep=True, update=moved))
    new_wm.set_run(endpoint, last.run_id)


def _last_commit_ts(m: Manifest, default: str | None) -> str | None:
    """The run's last commit time; `default` for a manifest written without the key (one that
    says null, a run with no commit, keeps it)."""
    return m.last_commit_ts if "last_commit_ts" in m.model_fields_set else default


def same_source_manifests(
    cfg: TableConfig,
    endpoint: str,
    shards: list[tuple[str, str]],
    shards_wm: dict[str, ShardPosition],
    manifests: list[Manifest],
) -> list[Manifest]:
    """The endpoint's runs whose LSNs may be compared with the shards' positions.

    A position is only meaningful on the server (system, timeline, database) and endpoint that
    produced it. A shard whose config now points at another endpoint, or whose endpoint now
    delivers runs from another server, stops with the fix instead of comparing foreign LSNs
    (which would drop changes as "already applied"). Runs of an older identity that finished
    before the shard's position was taken (history from before a re-bootstrap) are skipped."""
    fix = f're-bootstrap the shard: trigger cdc_bootstrap__{cfg.name} with conf {{"shards": [...]}}'
    for _, shard in shards:
        was = shards_wm[shard].endpoint
        if was is not None and was != endpoint:
            raise SourceIdentityChanged(
                f"{cfg.name}: shard {shard} is now read through endpoint {endpoint} but its lake position was taken "
                f"on endpoint {was}; positions of two endpoints do not compare, so nothing was applied. Fix: "
                + fix.replace("[...]", f'["{shard}"]')
            )
    out = []
    # Per shard, how far the WAL this batch reads on the position's own timeline reaches: a run
    # of a later timeline (a promoted standby) compares only if its history left that timeline
    # at or after it, not merely after the position (#52: runs of the old primary past the switch
    # point, not yet ingested, would otherwise be applied beside the new primary's).
    reach = {shard: shards_wm[shard].lsn for _, shard in shards}
    for m in manifests:
        seen = m.source_identity
        foreign = False
        for _, shard in shards:
            rec = shards_wm[shard]
            why = _why_foreign(rec.source, seen, reach[shard], m.end_lsn)
            if why is None:
                if not seen or not rec.source or seen.get("timeline") == rec.source.get("timeline"):
                    reach[shard] = max(reach[shard], m.end_lsn)
                continue
            foreign = True
            if _after(m.finished_at, rec.ts):
                raise SourceIdentityChanged(
                    f"{cfg.name}: shard {shard}: landing run {m.run_id} on endpoint {endpoint} comes from another "
                    f"source server than the shard's lake position ({why}); after a move or a failover LSNs of the "
                    "two servers do not compare, so nothing was applied. Fix: " + fix.replace("[...]", f'["{shard}"]')
                )
        if not foreign:
            out.append(m)
    return out


def _why_foreign(recorded: ServerIdentity | None, seen: ServerIdentity | None, reach: int, run_end: int) -> str | None:
    """Why a run's positions do not compare with a shard position's server, or None. A run of a
    later timeline compares up to where its history left the position's timeline (`reach`: the
    position, or the end of a run of that timeline in the same batch); a run of an earlier
    timeline compares when it lies wholly below where the position's history left that timeline
    (the floor then drops its events as applied)."""
    if recorded and seen and int(seen.get("timeline") or 0) < int(recorded.get("timeline") or 0):
        return identity_mismatch(seen, recorded, run_end)
    return identity_mismatch(recorded, seen, reach)


def _after(a: str | None, b: str | None) -> bool:
    """ISO time a is later than b (unknown times count as later: refuse rather than guess)."""
    if not a or not b:
        return True
    return datetime.fromisoformat(a) > datetime.fromisoformat(b)


def check_coverage(
    cfg: TableConfig,
    endpoint: str,
    shards: list[tuple[str, str]],
    shards_wm: dict[str, ShardPosition],
    m: Manifest,
) -> None:
    """A run counts for a shard only if the shard's table was published for the whole run.

    Runs written before manifests listed their publication (format 1) are trusted."""
    if "published" not in m.model_fields_set:
        return
    published = set(m.published or [])
    at_start = set(m.published_at_start or []) if "published_at_start" in m.model_fields_set else published
    for schema, shard in shards:
        name = f"{schema}.{cfg.source.table}"
        if m.end_lsn <= shards_wm[shard].lsn:
            continue
        # Added during the run is fine when the shard's position (its bootstrap) came after the add.
        covered = name in published and (name in at_start or shards_wm[shard].lsn >= (m.start_lsn or 0))
        if not covered:
            raise CoverageError(
                f"{cfg.name}: landing run {m.run_id} on endpoint {endpoint} did not capture shard {shard}: "
                f"{name} was not in publication {m.publication} for the whole run, so its changes in that "
                f"window were never read and the shard's position cannot move past it. Fix: make sure the table "
                f"stays in the publication, then re-bootstrap the shard: trigger cdc_bootstrap__{cfg.name} with conf "
                f'{{"shards": ["{shard}"]}}'
            )


# --- files, read from Python (local paths and s3:// alike) --------------------------------------


def spark_uri(uri: str) -> str:
    """The URI Spark reads a landing file by: s3:// through Hadoop's S3A."""
    return "s3a://" + uri[len("s3://") :] if uri.startswith("s3://") else uri


# The landing's S3 settings, as the session holds them (runtime.session.lake_conf): the same
# endpoint and keys Spark's S3A reads the files with, whichever way the session was made.
_S3A_KEYS = {
    "endpoint": "fs.s3a.endpoint",
    "region": "fs.s3a.endpoint.region",
    "access_key": "fs.s3a.access.key",
    "secret_key": "fs.s3a.secret.key",
    "session_token": "fs.s3a.session.token",
    "ssl": "fs.s3a.connection.ssl.enabled",
}


def _session_s3(spark: SparkSession) -> dict[str, str]:
    out = {}
    for name, key in _S3A_KEYS.items():
        v = spark.conf.get(key, None) or spark.conf.get(f"spark.hadoop.{key}", None)
        if v:
            out[name] = v
    return out


class LandingFS:
    """Landing files seen from this process (the ingest's driver, a Spark Connect client), through
    pyarrow's file systems: the manifests, listings and small files the driver reads itself. Spark
    reads the event files. No JVM: the same code runs on a Spark Connect client and under
    spark-submit."""

    def __init__(self, spark: SparkSession):
        self._spark = spark  # its S3 settings are read on the first s3:// path (12 requests on Connect)
        self._s3fs: pafs.S3FileSystem | None = None

    def _fs(self, uri: str) -> tuple[pafs.FileSystem, str]:
        from urllib.parse import urlsplit

        from pyarrow import fs as pafs

        u = urlsplit(uri)
        if u.scheme in ("s3", "s3a"):
            if self._s3fs is None:
                s3 = _session_s3(self._spark)
                endpoint = s3.get("endpoint")
                scheme = "https" if s3.get("ssl", "true").lower() == "true" else "http"
                if endpoint and "://" in endpoint:
                    scheme, endpoint = endpoint.split("://", 1)
                self._s3fs = pafs.S3FileSystem(
                    access_key=s3.get("access_key"),
                    secret_key=s3.get("secret_key"),
                    session_token=s3.get("session_token"),
                    region=s3.get("region"),
                    endpoint_override=endpoint,
                    scheme=scheme,
                )
            return self._s3fs, f"{u.netloc}{u.path}"
        return pafs.LocalFileSystem(), u.path if u.scheme == "file" else uri

    def _info(self, uri: str) -> tuple[pafs.FileSystem, str, pafs.FileInfo]:
        fs, path = self._fs(uri)
        return fs, path, fs.get_file_info(path)

    def exists(self, uri: str) -> bool:
        from pyarrow import fs as pafs

        return bool(self._info(uri)[2].type != pafs.FileType.NotFound)

    def size(self, uri: str) -> int | None:
        from pyarrow import fs as pafs

        info = self._info(uri)[2]
        return None if info.type != pafs.FileType.File else int(info.size)

    def list_names(self, uri: str) -> list[str]:
        from pyarrow import fs as pafs

        fs, path = self._fs(uri)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except NotADirectoryError:
            return []
        return sorted(i.base_name for i in infos)

    def read_bytes(self, uri: str) -> bytes:
        fs, path = self._fs(uri)
        with fs.open_input_stream(path) as f:
            data: bytes = f.read()
        return data

    def read_text(self, uri: str) -> str:
        return self.read_bytes(uri).decode("utf-8")

    def write_bytes(self, uri: str, data: bytes) -> None:
        """The file at uri, replaced by data (a local file's folders made first)."""
        from pyarrow import fs as pafs

        fs, path = self._fs(uri)
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as f:
            f.write(data)

    def delete(self, uri: str, recursive: bool = True) -> bool:
        from pyarrow import fs as pafs

        fs, path, info = self._info(uri)
        if info.type == pafs.FileType.NotFound:
            return False
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(path)
        else:
            fs.delete_file(path)
        return True


class SparkLanding:
    """Read-only view of the landing zone for Spark jobs (manifests + file URIs)."""

    def __init__(self, spark: SparkSession, uri: str):
        self.fs = LandingFS(spark)
        self.uri = spark_uri(uri.rstrip("/"))

    def file_uri(self, rel: str) -> str:
        return f"{self.uri}/{rel}"

    def list_names(self, rel: str) -> list[str]:
        return self.fs.list_names(self.file_uri(rel))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.fs.read_text(self.file_uri(rel)))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.file_uri(rel))
