# An Airflow + Spark + Iceberg image with this project, for a worker or a local trial.
#   docker build -t cdc-lakehouse .
#   docker run --rm -it cdc-lakehouse make test      # or: make demo
# Production deployments mount their own include/tables and set connections through env vars
# (AIRFLOW_CONN_*) or a secrets backend; nothing secret is baked into the image.
FROM python:3.11-slim-bookworm

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends openjdk-17-jre-headless postgresql-15 libjarjar-java \
      libpostgresql-jdbc-java unzip curl zip make sudo procps \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cdc-lakehouse
# Dependencies first, so code changes do not reinstall them.
COPY requirements.txt requirements-dev.txt requirements.lock ./
COPY scripts/ scripts/
COPY plugins/ plugins/
RUN CDC_SKIP_APT=1 CDC_WITH_BROWSER=0 scripts/setup.sh
COPY . .
RUN CDC_SKIP_APT=1 CDC_WITH_BROWSER=0 scripts/setup.sh

ENV PATH=/opt/cdc-lakehouse/.venv/bin:$PATH \
    PYTHONPATH=/opt/cdc-lakehouse/plugins \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/cdc-lakehouse/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/cdc-lakehouse/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False
CMD ["make", "demo"]
