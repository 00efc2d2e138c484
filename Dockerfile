# Airflow 3 with this project, Java 17 for Spark, and Spark's jars (S3 included) from Maven Central.
#   docker build -t cdc-lakehouse .
# DAGs, plugins, Spark jobs and table configs go where the image's Airflow looks for them.
# Connections (sources, spark_default, cdc_lake) come from AIRFLOW_CONN_* or a secrets backend:
# nothing secret is baked in.
FROM apache/airflow:3.3.2-python3.11

USER root
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends openjdk-17-jre-headless curl \
 && rm -rf /var/lib/apt/lists/*
ENV JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64

# Iceberg's Spark runtime, the PostgreSQL JDBC driver, and S3: iceberg-aws-bundle (AWS SDK v2 for
# Iceberg's S3FileIO, the warehouse) and hadoop-aws + the AWS SDK v1 bundle (Hadoop S3A, which
# Spark uses to read landing Parquet on s3://). hadoop-aws must match pyspark 3.5's Hadoop (3.3.4).
ARG ICEBERG_VERSION=1.10.2
ARG PG_JDBC_VERSION=42.7.4
ARG HADOOP_VERSION=3.3.4
ARG AWS_SDK_V1_VERSION=1.12.262
ARG MAVEN=https://repo1.maven.org/maven2
RUN mkdir -p /opt/spark-jars && cd /opt/spark-jars \
 && curl -fsSLO ${MAVEN}/org/apache/iceberg/iceberg-spark-runtime-3.5_2.12/${ICEBERG_VERSION}/iceberg-spark-runtime-3.5_2.12-${ICEBERG_VERSION}.jar \
 && curl -fsSLO ${MAVEN}/org/postgresql/postgresql/${PG_JDBC_VERSION}/postgresql-${PG_JDBC_VERSION}.jar \
 && curl -fsSLO ${MAVEN}/org/apache/iceberg/iceberg-aws-bundle/${ICEBERG_VERSION}/iceberg-aws-bundle-${ICEBERG_VERSION}.jar \
 && curl -fsSLO ${MAVEN}/org/apache/hadoop/hadoop-aws/${HADOOP_VERSION}/hadoop-aws-${HADOOP_VERSION}.jar \
 && curl -fsSLO ${MAVEN}/com/amazonaws/aws-java-sdk-bundle/${AWS_SDK_V1_VERSION}/aws-java-sdk-bundle-${AWS_SDK_V1_VERSION}.jar
ENV CDC_SPARK_JARS=/opt/spark-jars/iceberg-spark-runtime-3.5_2.12-${ICEBERG_VERSION}.jar,/opt/spark-jars/postgresql-${PG_JDBC_VERSION}.jar,/opt/spark-jars/iceberg-aws-bundle-${ICEBERG_VERSION}.jar,/opt/spark-jars/hadoop-aws-${HADOOP_VERSION}.jar,/opt/spark-jars/aws-java-sdk-bundle-${AWS_SDK_V1_VERSION}.jar

USER airflow
COPY --chown=airflow:root requirements.txt requirements.lock /opt/cdc/
# The lock pins Airflow itself to the image's version, so nothing of Airflow's is replaced.
RUN pip install --no-cache-dir -r /opt/cdc/requirements.txt -c /opt/cdc/requirements.lock

COPY --chown=airflow:root dags/ /opt/airflow/dags/
COPY --chown=airflow:root plugins/ /opt/airflow/plugins/
COPY --chown=airflow:root spark_jobs/ /opt/airflow/spark_jobs/
COPY --chown=airflow:root include/ /opt/airflow/include/
ENV PYTHONPATH=/opt/airflow/plugins \
    CDC_TABLES_DIR=/opt/airflow/include/tables
