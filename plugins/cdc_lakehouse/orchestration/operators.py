"""The Spark operator of this project: a job (jobs.registry: its spark_jobs/<job>.py file) with the lake and source settings
resolved at run time (never at DAG parse time), sent where the task's Spark connection says:

- a Spark Connect connection (conn type `spark_connect`, the Apache Spark provider's; the local
  stack's default): the task's own process is the job's driver, a client of the long-lived
  server; the job's Spark work runs there. Settings and secrets stay in this process and reach
  the server over the Connect channel, per session (runtime.session.get_spark).
- a Spark connection (conn type `spark`: YARN, Kubernetes, a local master): spark-submit, the
  provider's operator. Public settings travel in env_vars; secrets never do: job_secrets hands
  them to the driver by reference (a 0600 file on the worker, a YARN-localized file, or a
  Kubernetes secret), per master type.

See docs/secrets.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseOperator

from cdc_lakehouse.jobs.registry import job as registered_job


class CdcSparkSubmitOperator(SparkSubmitOperator):
    ui_color = "#f4a261"

    def __init__(
        self,
        *,
        job: str,
        job_args: list[str],
        source_conn_ids: list[str],
        store_conns: Sequence[tuple[str, str]] = (),
        application: str | None = None,
        **kwargs: Any,
    ) -> None:
        """`job` names an entry of jobs.registry, whose file is the application; `application`
        runs another file instead (a test's own job)."""
        kwargs.setdefault("name", f"cdc-{job}")
        kwargs.setdefault("verbose", False)
        super().__init__(application=application or str(registered_job(job).file), application_args=job_args, **kwargs)
        self.job = job
        self.source_conn_ids = list(source_conn_ids)
        self.store_conns = [(kind, conn_id) for kind, conn_id in store_conns]  # serving stores (lists from JSON too)
        self._secrets_cleanup: Any = None

    def _spark_conn_extra(self) -> dict[str, Any]:
        from airflow.sdk import BaseHook

        try:
            return dict(BaseHook.get_connection(self._conn_id).extra_dejson)
        except Exception:  # noqa: BLE001 - the provider then defaults to yarn; so do we
            return {}

    def _connect_url(self) -> str | None:
        """The sc:// URL when the task's Spark connection is a Spark Connect one."""
        from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
        from airflow.sdk import BaseHook

        try:
            conn = BaseHook.get_connection(self._conn_id)
        except Exception:  # noqa: BLE001 - no such connection: the provider's spark-submit defaults
            return None
        return SparkConnectHook(self._conn_id).get_connection_url() if conn.conn_type == "spark_connect" else None

    def execute(self, context: Any) -> None:
        url = self._connect_url()
        if url is not None:
            return self._run_on_connect(url)
        return self._spark_submit(context)

    def _run_on_connect(self, url: str) -> None:
        """The job's application file (spark_jobs/<job>.py) run in this process as spark-submit
        would run it (same arguments, same settings), a Spark Connect client of `url`. The
        environment it reads its settings from is this task's own process's (one task per process
        in Airflow 3), set for the job and restored after."""
        import json
        import os

        from airflow.exceptions import AirflowException

        from cdc_lakehouse.orchestration.tasks import spark_job_env
        from cdc_lakehouse.runtime.session import REMOTE_ENV, SESSION_CONF_ENV

        public, secrets = spark_job_env(self.source_conn_ids, self.store_conns)
        env = {**public, **secrets, REMOTE_ENV: url}
        if self.conf:  # the task's own settings, per session (what a running server can take)
            env[SESSION_CONF_ENV] = json.dumps(self.conf)
        saved = {k: os.environ.get(k) for k in env}
        self.log.info("running %s on Spark Connect at %s", self.job, url.split(";", maxsplit=1)[0])
        if self._driver_memory:  # the driver is the server's: its memory was set when it started
            self.log.warning("%s: driver_memory=%s does not apply on Spark Connect", self.job, self._driver_memory)
        try:
            os.environ.update(env)
            rc = run_application(self.application, [str(a) for a in self.application_args or []])
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        if rc != 0:
            raise AirflowException(f"{self.job} failed with exit code {rc} (its output is above)")

    def _spark_submit(self, context: Any) -> None:
        import os

        from cdc_lakehouse.orchestration.tasks import spark_jars, spark_job_env
        from cdc_lakehouse.runtime.packaging import pyfiles_zip
        from cdc_lakehouse.runtime.secrets import K8S_MOUNT_EXTRA, K8S_SECRET_EXTRA, transport_for
        from cdc_lakehouse.runtime.session import base_conf

        self.py_files = str(pyfiles_zip())
        self.jars = ",".join(spark_jars()) or None
        self._driver_memory = self._driver_memory or os.environ.get("CDC_SPARK_DRIVER_MEMORY", "4g")
        public, secrets = spark_job_env(self.source_conn_ids, self.store_conns)
        # The master and deploy mode exactly as the provider's hook resolves them.
        probe = self._get_hook()
        master, deploy_mode = probe._connection["master"], probe._connection["deploy_mode"]
        extra = self._spark_conn_extra()
        transport = transport_for(
            master, deploy_mode, secrets, k8s_secret=extra.get(K8S_SECRET_EXTRA), k8s_mount=extra.get(K8S_MOUNT_EXTRA)
        )
        self._secrets_cleanup = transport.cleanup
        self._yarn_tracking(master, deploy_mode, extra)
        saved_env: dict[str, str | None] = {}
        try:
            self.conf = conf = self._with_lineage_transport(
                {**base_conf(), **(self.conf or {}), **transport.conf}, context
            )
            self.files = ",".join([f for f in (self.files or "").split(",") if f] + transport.files) or None
            self.env_vars = env_vars = {**(self.env_vars or {}), **public, **transport.env}
            self._refuse_secrets(secrets, transport, conf, env_vars)
            if transport.process_env:  # the driver is the spark-submit process itself (k8s client mode)
                saved_env = {k: os.environ.get(k) for k in env_vars}
                os.environ.update(env_vars)
            self._hook = None
            super().execute(context)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self._remove_secrets()

    def _with_lineage_transport(self, conf: dict[str, Any], context: Any) -> dict[str, Any]:
        """The provider's OpenLineage transport injection (`[openlineage] spark_inject_transport_info`),
        made here instead of in its execute(), which ran it after the secret check (#51): the
        transport's credentials (its API key, credential-named headers) are left out and named in
        a warning, since a --conf sits on the command line and in the task log; the rest (type,
        URL, endpoint, timeout) still reaches the job."""
        if not getattr(self, "_openlineage_inject_transport_info", False):
            return conf
        from airflow.providers.common.compat.openlineage.utils.spark import (
            inject_transport_information_into_spark_properties,
        )

        from cdc_lakehouse.secrecy import is_secret_name

        self._openlineage_inject_transport_info = False  # the provider's execute() would inject it again
        injected = inject_transport_information_into_spark_properties(dict(conf), context)
        added = [k for k in injected if k not in conf]
        auth = [k for k in added if ".auth." in k or is_secret_name(k)]
        if auth:
            self.log.warning(
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
            self._yarn_track_via_rm_api = True
        else:
            self.log.info("YARN cluster mode without yarn_resourcemanager_webapp_address: not durable")
            self.durable = False

    def _refuse_secrets(
        self, secrets: dict[str, str], transport: Any, conf: dict[str, Any], env_vars: dict[str, Any]
    ) -> None:
        """The last-line check: no secret value (cdc_lakehouse.secrecy: by origin, inner ones and
        encoded forms included) in what becomes spark-submit's command line, and no setting named like a credential there (the safety net). The transport's
        own settings hold a path or a mount, never a value."""
        from cdc_lakehouse.secrecy import find_secrets, secret_named, secrets_of_env

        texts = [*conf.values(), *env_vars.values(), *map(str, self.application_args or [])]
        leaked = find_secrets([*texts, self.files or "", self.name or ""], secrets_of_env(secrets))
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

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """What the job read and wrote, for Airflow's OpenLineage provider (orchestration.lineage)."""
        from cdc_lakehouse.orchestration.lineage import spark_job_lineage

        try:
            params = registered_job(self.job).params.from_argv([str(a) for a in self.application_args or []])
        except SystemExit:  # argparse's way to refuse (a test's own application file): no datasets
            return None
        return spark_job_lineage(self.job, params)

    def _remove_secrets(self) -> None:
        cleanup, self._secrets_cleanup = self._secrets_cleanup, None
        if cleanup:
            cleanup()

    def on_kill(self) -> None:
        from cdc_lakehouse.runtime.session import interrupt_all

        try:
            interrupt_all()  # a job on Spark Connect: its running Spark work stops on the server
            super().on_kill()
        finally:
            self._remove_secrets()


class CdcCaptureOperator(BaseOperator):
    """capture__<endpoint>: one bounded capture run of the endpoint's replication slot into the
    landing zone (orchestration.tasks.capture_endpoint); its XCom is the run's figures."""

    ui_color = "#8ecae6"

    def __init__(self, *, endpoint_id: str, **kwargs: Any) -> None:
        # As the @task it replaces: each figure is its own XCom too (run_id, events, end_lsn...).
        kwargs.setdefault("multiple_outputs", True)
        super().__init__(**kwargs)
        self.endpoint_id = endpoint_id
        self._result: dict[str, Any] = {}

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        from cdc_lakehouse.orchestration.tasks import capture_endpoint
        from cdc_lakehouse.source.errors import SlotLostError

        try:
            self._result = capture_endpoint(self.endpoint_id, context["data_interval_end"], context=context)
        except SlotLostError as exc:
            # No retry brings a lost slot back: fail now, so the alert names the endpoint and
            # cdc_recover__<endpoint> at once rather than after the retries' backoff (#52).
            raise AirflowFailException(str(exc)) from exc
        return self._result

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Source tables -> landing, with the run's WAL range (orchestration.lineage)."""
        from cdc_lakehouse.orchestration.lineage import capture_lineage

        return capture_lineage(self.endpoint_id, self._result)


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
