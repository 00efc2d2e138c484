"""The project's operators: CdcSparkSubmitOperator, a job (jobs.registry: its spark_jobs/<job>.py
file) with the lake and source settings resolved at run time (never at DAG parse time), run by
the backend its Spark connection picks (orchestration.spark_backends: Spark Connect in this
process, or spark-submit); CdcCaptureOperator, one capture run of an endpoint.

See docs/secrets.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk import BaseOperator

from cdc_lakehouse.jobs.registry import job as registered_job
from cdc_lakehouse.orchestration.spark_backends import SparkBackend, backend_for


class CdcSparkSubmitOperator(SparkSubmitOperator):
    """A job of jobs.registry run by the backend its Spark connection's type picks
    (orchestration.spark_backends): in this process on Spark Connect, or through spark-submit."""

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
        self._job_backend: SparkBackend | None = None

    def execute(self, context: Any) -> None:
        self._job_backend = backend_for(self)
        self._job_backend.run(context)

    def submit(self, context: Any) -> None:
        """The provider's spark-submit, once the submit backend has prepared this operator."""
        self._hook = None
        super().execute(context)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """What the job read and wrote, for Airflow's OpenLineage provider (orchestration.lineage)."""
        from cdc_lakehouse.orchestration.lineage import spark_job_lineage

        try:
            params = registered_job(self.job).params.from_argv([str(a) for a in self.application_args or []])
        except SystemExit:  # argparse's way to refuse (a test's own application file): no datasets
            return None
        return spark_job_lineage(self.job, params)

    def on_kill(self) -> None:
        from cdc_lakehouse.runtime.session import interrupt_all

        try:
            interrupt_all()  # a job on Spark Connect: its running Spark work stops on the server
            super().on_kill()
        finally:
            if self._job_backend is not None:
                self._job_backend.cleanup()


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
