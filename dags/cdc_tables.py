"""Airflow DAGs of the CDC lakehouse, generated from include/tables/*.yaml (see cdc_lakehouse.orchestration.dag_factory)."""

from cdc_lakehouse.orchestration.dag_factory import build_dags

globals().update(build_dags())
