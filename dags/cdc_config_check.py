"""Airflow DAG file that surfaces broken table configs as its own import error.

The other DAGs still load; each line of the error names the file, the field and the fix.
"""

from cdc_lakehouse.orchestration.dag_parts import config_errors

_errors = config_errors()
if _errors:
    raise ValueError("invalid table or derived config(s):\n" + "\n".join(_errors))
