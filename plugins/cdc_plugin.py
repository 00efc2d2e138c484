"""Airflow plugin of the CDC lakehouse: registers the project's operator for the UI and docs.

The package itself (plugins/cdc_lakehouse) is a library, skipped by the plugin loader via
plugins/.airflowignore; DAGs import it because Airflow puts this folder on sys.path.
"""

from airflow.plugins_manager import AirflowPlugin


class CdcLakehousePlugin(AirflowPlugin):
    name = "cdc_lakehouse"
