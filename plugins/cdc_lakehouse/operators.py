"""The Spark submit operator of this project: the Apache Spark provider's, plus the lake
and source settings delivered through the environment at run time (never on the command
line, never at DAG parse time)."""

from __future__ import annotations

from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

from .settings import PROJECT_ROOT


class CdcSparkSubmitOperator(SparkSubmitOperator):
    ui_color = "#f4a261"

    def __init__(self, *, job: str, job_args: list[str], source_conn_ids: list[str], **kwargs: Any) -> None:
        kwargs.setdefault("name", f"cdc-{job}")
        kwargs.setdefault("verbose", False)
        super().__init__(application=str(PROJECT_ROOT / "spark_jobs" / f"{job}.py"), application_args=job_args,
                         **kwargs)
        self.job = job
        self.source_conn_ids = list(source_conn_ids)

    def execute(self, context: Any) -> None:
        import os

        from .packaging import pyfiles_zip
        from .spark_session import base_conf
        from .tasks import spark_env, spark_jars

        self.py_files = str(pyfiles_zip())
        self.jars = ",".join(spark_jars()) or None
        self.conf = {**base_conf(), **(self.conf or {})}
        self._driver_memory = self._driver_memory or os.environ.get("CDC_SPARK_DRIVER_MEMORY", "4g")
        self.env_vars = {**(self.env_vars or {}), **spark_env(self.source_conn_ids)}
        self._hook = None
        super().execute(context)
