# Airflow 3 with this project, Java 17 for Spark 4.1, and Spark's jars resolved from Maven Central
# by the same script and list the tests use (scripts/fetch_jars.sh, requirements-jvm.txt).
#   docker build -t cdc-lakehouse .
# DAGs, plugins, Spark jobs and table configs go where the image's Airflow looks for them.
# Connections (sources, spark_default, cdc_lake) come from AIRFLOW_CONN_* or a secrets backend:
# nothing secret is baked in. spark_default is a Spark Connect connection to your Spark Connect
# server (which needs the same jars, e.g. this image's /opt/spark-jars), or a Spark connection for
# spark-submit on YARN or Kubernetes.

# --- the jars: Maven's own client, the one list -------------------------------------------------
FROM maven:3.9-eclipse-temurin-17 AS jars
COPY requirements-jvm.txt /src/requirements-jvm.txt
COPY scripts/fetch_jars.sh /src/scripts/fetch_jars.sh
RUN CDC_JARS_DIR=/opt/spark-jars CDC_JVM_REQUIREMENTS=/src/requirements-jvm.txt bash /src/scripts/fetch_jars.sh

# --- Airflow -----------------------------------------------------------------------------------
FROM apache/airflow:3.3.2-python3.11

USER root
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/*
ENV JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64
COPY --from=jars /opt/spark-jars /opt/spark-jars
ENV CDC_JARS_DIR=/opt/spark-jars

USER airflow
COPY --chown=airflow:root requirements.txt requirements.lock /opt/cdc/
# The lock pins Airflow itself to the image's version, so nothing of Airflow's is replaced.
RUN pip install --no-cache-dir -r /opt/cdc/requirements.txt -c /opt/cdc/requirements.lock

# What Airflow and the Spark jobs run, nothing more: the development stack (devstack/), the
# benchmarks and the tests stay out of the image.
COPY --chown=airflow:root dags/ /opt/airflow/dags/
COPY --chown=airflow:root plugins/ /opt/airflow/plugins/
COPY --chown=airflow:root spark_jobs/ /opt/airflow/spark_jobs/
COPY --chown=airflow:root include/ /opt/airflow/include/
ENV PYTHONPATH=/opt/airflow/plugins \
    CDC_TABLES_DIR=/opt/airflow/include/tables
