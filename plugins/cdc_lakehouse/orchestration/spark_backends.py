"""How a CdcSparkSubmitOperator runs its job, one backend per kind of Spark connection, as the
Apache Spark provider keeps its submit backends apart:

- ConnectBackend, for a Spark Connect connection (conn type `spark_connect`, the provider's; the
  local stack's default): the task's own process is the job's driver, a client of the
  long-lived server; the job's Spark work runs there. Settings and secrets stay in this process
  and reach the server over the Connect channel, per session (runtime.session.get_spark).
- SubmitBackend, for a Spark connection (conn type `spark`: YARN, Kubernetes, a local master):
  spark-submit, the provider's operator. Public settings travel in env_vars; secrets never do:
  job_secrets hands them to the driver by reference (a 0600 file on the worker, a YARN-localized
  file, or a Kubernetes secret), per master type.

See docs/secrets.md."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol


class JobOperator(Protocol):
    """What a backend reads from and sets on its operator (operators.CdcSparkSubmitOperator); the
    provider's SparkSubmitOperator declares the attributes typed Any here."""

    job: str
    source_conn_ids: list[str]
    store_conns: list[tuple[str, str]]
    log: Any
    _conn_id: Any
    conf: Any
    files: Any
    py_files: Any
    jars: Any
    env_vars: Any
    name: Any
    application: Any
    application_args: Any
    durable: Any
    _driver_memory: Any
    _openlineage_inject_transport_info: Any
    _yarn_track_via_rm_api: Any

    def _get_hook(self) -> Any: ...

    def submit(self, context: Any) -> None:
        """The provider's spark-submit of the prepared operator."""


class SparkBackend(Protocol):
    def run(self, context: Any) -> None: ...

    def cleanup(self) -> None:
        """What the run left on the worker for its driver (secret files), removed; also on kill."""


def backend_for(op: JobOperator) -> SparkBackend:
    """ConnectBackend when the task's Spark connection is a Spark Connect one, else SubmitBackend
    (no such connection: the provider's spark-submit defaults)."""
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(op._conn_id)
    except Exception:  # noqa: BLE001 - see the docstring
        return SubmitBackend(op)
    if conn.conn_type == "spark_connect":
        return ConnectBackend(op, SparkConnectHook(op._conn_id).get_connection_url())
    return SubmitBackend(op)


class ConnectBackend:
    """The job's application file (spark_jobs/<job>.py) run in this process as spark-submit would
    run it (same arguments, same settings), a Spark Connect client of `url`. The environment it
    reads its settings from is this task's own process's (one task per process in Airflow 3), set
    for the job and restored after."""

    def __init__(self, op: JobOperator, url: str) -> None:
        self.op, self.url = op, url

    def run(self, context: Any) -> None:
        from airflow.exceptions import AirflowException

        from cdc_lakehouse.orchestration.tasks import spark_job_env
        from cdc_lakehouse.runtime.session import REMOTE_ENV, SESSION_CONF_ENV

        op = self.op
        public, secrets = spark_job_env(op.source_conn_ids, op.store_conns)
        env = {**public, **secrets, REMOTE_ENV: self.url}
        if op.conf:  # the task's own settings, per session (what a running server can take)
            env[SESSION_CONF_ENV] = json.dumps(op.conf)
        op.log.info("running %s on Spark Connect at %s", op.job, self.url.split(";", maxsplit=1)[0])
        if op._driver_memory:  # the driver is the server's: its memory was set when it started
            op.log.warning("%s: driver_memory=%s does not apply on Spark Connect", op.job, op._driver_memory)
        with _environment(env):
            rc = run_application(op.application, [str(a) for a in op.application_args or []])
        if rc != 0:
            raise AirflowException(f"{op.job} failed with exit code {rc} (its output is above)")

    def cleanup(self) -> None:
        """Nothing: the secrets stayed in this process's environment, restored after the run."""


class SubmitBackend:
    """spark-submit through the provider's operator, once this backend has set its py-files,
    jars, settings and the secrets' transport for the connection's master and deploy mode."""

    def __init__(self, op: JobOperator) -> None:
        self.op = op
        self._cleanup: Any = None

    def run(self, context: Any) -> None:
        from cdc_lakehouse.orchestration.tasks import spark_jars, spark_job_env
        from cdc_lakehouse.runtime.packaging import pyfiles_zip
        from cdc_lakehouse.runtime.secrets import K8S_MOUNT_EXTRA, K8S_SECRET_EXTRA, transport_for
        from cdc_lakehouse.runtime.session import base_conf

        op = self.op
        op.py_files = str(pyfiles_zip())
        op.jars = ",".join(spark_jars()) or None
        op._driver_memory = op._driver_memory or os.environ.get("CDC_SPARK_DRIVER_MEMORY", "4g")
        public, secrets = spark_job_env(op.source_conn_ids, op.store_conns)
        # The master and deploy mode exactly as the provider's hook resolves them.
        probe = op._get_hook()
        master, deploy_mode = probe._connection["master"], probe._connection["deploy_mode"]
        extra = self._conn_extra()
        transport = transport_for(
            master, deploy_mode, secrets, k8s_secret=extra.get(K8S_SECRET_EXTRA), k8s_mount=extra.get(K8S_MOUNT_EXTRA)
        )
        self._cleanup = transport.cleanup
        self._yarn_tracking(master, deploy_mode, extra)
        try:
            op.conf = conf = self._with_lineage_transport({**base_conf(), **(op.conf or {}), **transport.conf}, context)
            op.files = ",".join([f for f in (op.files or "").split(",") if f] + transport.files) or None
            op.env_vars = env_vars = {**(op.env_vars or {}), **public, **transport.env}
            self._refuse_secrets(secrets, transport, conf, env_vars)
            # The driver is the spark-submit process itself (k8s client mode): its environment.
            with _environment(env_vars if transport.process_env else {}):
                op.submit(context)
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        cleanup, self._cleanup = self._cleanup, None
        if cleanup:
            cleanup()

    def _conn_extra(self) -> dict[str, Any]:
        from airflow.sdk import BaseHook

        try:
            return dict(BaseHook.get_connection(self.op._conn_id).extra_dejson)
        except Exception:  # noqa: BLE001 - the provider then defaults to yarn; so do we
            return {}

    def _with_lineage_transport(self, conf: dict[str, Any], context: Any) -> dict[str, Any]:
        """The provider's OpenLineage transport injection (`[openlineage] spark_inject_transport_info`),
        made here instead of in its execute(), which ran it after the secret check (#51): the
        transport's credentials (its API key, credential-named headers) are left out and named in
        a warning, since a --conf sits on the command line and in the task log; the rest (type,
        URL, endpoint, timeout) still reaches the job."""
        op = self.op
        if not getattr(op, "_openlineage_inject_transport_info", False):
            return conf
        from airflow.providers.common.compat.openlineage.utils.spark import (
            inject_transport_information_into_spark_properties,
        )

        from cdc_lakehouse.secrecy import is_secret_name

        op._openlineage_inject_transport_info = False  # the provider's execute() would inject it again
        injected = inject_transport_information_into_spark_properties(dict(conf), context)
        added = [k for k in injected if k not in conf]
        auth = [k for k in added if ".auth." in k or is_secret_name(k)]
        if auth:
            op.log.warning(
                "OpenLineage transport setting(s) %s not passed to the Spark job: a --conf is on spark-submit's "
                "command line and in this log. Give the job's OpenLineage listener its credentials on the cluster "
                "(spark-defaults.conf readable by the Spark processes only); see docs/secrets.md",
                auth,
            )
        return {k: v for k, v in injected.items() if k not in auth}

    def _yarn_tracking(self, master: str, deploy_mode: str | None, extra: dict[str, Any]) -> None:
        """YARN cluster mode: the provider (6.x) keeps a task durable across retries only by polling
        the ResourceManager's REST API, which needs its address in the connection's extra. Without
        it the task holds spark-submit until the application ends (durable off), as before."""
        if not (master.startswith("yarn") and deploy_mode == "cluster"):
            return
        if extra.get("yarn_resourcemanager_webapp_address"):
            self.op._yarn_track_via_rm_api = True
        else:
            self.op.log.info("YARN cluster mode without yarn_resourcemanager_webapp_address: not durable")
            self.op.durable = False

    def _refuse_secrets(
        self, secrets: dict[str, str], transport: Any, conf: dict[str, Any], env_vars: dict[str, Any]
    ) -> None:
        """The last-line check: no secret value (cdc_lakehouse.secrecy: by origin, inner ones and
        encoded forms included) in what becomes spark-submit's command line, and no setting named
        like a credential there (the safety net). The transport's own settings hold a path or a
        mount, never a value."""
        from cdc_lakehouse.secrecy import find_secrets, secret_named, secrets_of_env

        op = self.op
        texts = [*conf.values(), *env_vars.values(), *map(str, op.application_args or [])]
        leaked = find_secrets([*texts, op.files or "", op.name or ""], secrets_of_env(secrets))
        if leaked:
            raise ValueError(f"secret(s) {leaked} would appear in the spark-submit command; refusing")
        named = secret_named([k for k in conf if k not in transport.conf])
        named += secret_named([k for k in env_vars if k not in transport.env])
        if named:
            raise ValueError(
                f"{named} are named like credentials and would be on the spark-submit command line (a --conf; "
                "env_vars are one on YARN and Kubernetes): give a secret through a connection, and a catalog "
                "property through the lake connection's secret_catalog_properties; see docs/secrets.md"
            )


@contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `env` set inside the block, restored after (a key it did not have: removed)."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_application(path: str, args: list[str]) -> int:
    """A spark_jobs/ file run as its `__main__`, with `args` as its command line: its exit code."""
    import runpy
    import sys

    argv = sys.argv
    sys.argv = [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = argv
    return 0
