"""The Spark submit operator of this project: the Apache Spark provider's, plus the lake and
source settings resolved at run time (never at DAG parse time). Public settings travel in
env_vars; secrets never do: job_secrets hands them to the driver by reference (a 0600 file
on the worker, a YARN-localized file, or a Kubernetes secret), per master type. See
docs/secrets.md."""

from __future__ import annotations

from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from cdc_lakehouse.settings import PROJECT_ROOT


class CdcSparkSubmitOperator(SparkSubmitOperator):
    ui_color = "#f4a261"

    def __init__(
        self,
        *,
        job: str,
        job_args: list[str],
        source_conn_ids: list[str],
        store_conns: list[tuple[str, str]] = (),
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("name", f"cdc-{job}")
        kwargs.setdefault("verbose", False)
        super().__init__(
            application=str(PROJECT_ROOT / "spark_jobs" / f"{job}.py"), application_args=job_args, **kwargs
        )
        self.job = job
        # The Spark settings given to this task itself, default_args included (execute fills in
        # the defaults later): the job server runs every job with its own, so such a task goes by
        # spark-submit.
        self._own_settings = sorted(self.conf or {}) + (["driver_memory"] if self._driver_memory else [])
        self.source_conn_ids = list(source_conn_ids)
        self.store_conns = [tuple(c) for c in store_conns]  # (kind, conn_id) of serving stores
        self._secrets_cleanup: Any = None

    def _spark_conn_extra(self) -> dict[str, Any]:
        from airflow.sdk import BaseHook

        try:
            return dict(BaseHook.get_connection(self._conn_id).extra_dejson)
        except Exception:  # noqa: BLE001 - the provider then defaults to yarn; so do we
            return {}

    def execute(self, context: Any) -> None:
        import os

        from cdc_lakehouse.orchestration.tasks import spark_jars, spark_job_env
        from cdc_lakehouse.runtime.packaging import pyfiles_zip
        from cdc_lakehouse.runtime.secrets import K8S_MOUNT_EXTRA, K8S_SECRET_EXTRA, transport_for
        from cdc_lakehouse.runtime.server import SERVER_ENV, status
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
        saved_env: dict[str, str | None] = {}
        try:
            self.conf = {**base_conf(), **(self.conf or {}), **transport.conf}
            self.files = ",".join([f for f in (self.files or "").split(",") if f] + transport.files) or None
            self.env_vars = {**(self.env_vars or {}), **public, **transport.env}
            self._refuse_secrets(secrets, transport)
            server = os.environ.get(SERVER_ENV) if master.startswith("local") else None
            if server and self._own_settings:
                # The server's context is already started with its own settings: applying only
                # some of the task's would run it with settings it did not ask for.
                self.log.info("this task sets %s, which the job server cannot apply: spark-submit", self._own_settings)
            elif server:
                st = status(server)  # None: not running, and _run_on_server says so
                if st is None or self.job in st.get("jobs", ()):  # else a job of its own: spark-submit
                    return self._run_on_server(server)
            if transport.process_env:  # the driver is the spark-submit process itself (k8s client mode)
                saved_env = {k: os.environ.get(k) for k in self.env_vars}
                os.environ.update(self.env_vars)
            self._hook = None
            super().execute(context)
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self._remove_secrets()

    def _refuse_secrets(self, secrets: dict[str, str], transport: Any) -> None:
        """The last-line check: no secret value (cdc_lakehouse.secrecy: by origin, inner ones and
        encoded forms included) in what becomes spark-submit's command line or the job server's
        request, and no setting named like a credential there (the safety net). The transport's
        own settings hold a path or a mount, never a value."""
        from cdc_lakehouse.secrecy import find_secrets, secret_named, secrets_of_env

        texts = [*self.conf.values(), *self.env_vars.values(), *map(str, self.application_args or [])]
        leaked = find_secrets([*texts, self.files or "", self.name or ""], secrets_of_env(secrets))
        if leaked:
            raise ValueError(f"secret(s) {leaked} would appear in the spark-submit command; refusing")
        named = secret_named([k for k in self.conf if k not in transport.conf])
        named += secret_named([k for k in self.env_vars if k not in transport.env])
        if named:
            raise ValueError(
                f"{named} are named like credentials and would be on the spark-submit command line (a --conf; "
                "env_vars are one on YARN and Kubernetes): give a secret through a connection, and a catalog "
                "property through the lake connection's secret_catalog_properties; see docs/secrets.md"
            )

    def _run_on_server(self, sock: str) -> None:
        """The job on the long-lived job server (runtime.server) instead of a new spark-submit:
        same job, arguments and environment (secrets by file reference); its output in this log."""
        from airflow.exceptions import AirflowException

        from cdc_lakehouse.runtime.server import submit

        self.log.info("running %s on the job server at %s (CDC_SPARK_SERVER)", self.job, sock)
        rc = submit(sock, self.job, [str(a) for a in self.application_args or []], self.env_vars, self.log.info)
        if rc != 0:
            raise AirflowException(f"{self.job} failed on the job server with exit code {rc} (its output is above)")

    def _remove_secrets(self) -> None:
        cleanup, self._secrets_cleanup = self._secrets_cleanup, None
        if cleanup:
            cleanup()

    def on_kill(self) -> None:
        try:
            super().on_kill()
        finally:
            self._remove_secrets()
