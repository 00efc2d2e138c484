# The single entry point. `make demo` runs the pipeline end to end on the embedded local
# stack; `make test` runs the tests; both set up whatever is missing first.
SHELL := /bin/bash
ENV := source scripts/env.sh &&

.PHONY: setup pg-start pg-stop pg-status airflow-init demo airflow test test-fast lint format bench bench-tree clean

setup:
	@scripts/setup.sh

pg-start: setup
	@$(ENV) python -m cdc_lakehouse.dev.localstack start

pg-stop:
	@$(ENV) python -m cdc_lakehouse.dev.localstack stop

pg-status:
	@$(ENV) python -m cdc_lakehouse.dev.localstack status

airflow-init: pg-start
	@$(ENV) scripts/airflow_init.sh

demo: airflow-init
	@$(ENV) python -m cdc_lakehouse.dev.demo run $(DEMO_ARGS)

airflow: airflow-init
	@$(ENV) python -m cdc_lakehouse.dev.demo prepare && $(ENV) scripts/airflow_ui.sh

test: setup
	@$(ENV) python -m pytest $(PYTEST_ARGS)

test-fast: setup
	@$(ENV) python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	@$(ENV) ruff check . && ruff format --check .

format: setup
	@$(ENV) ruff format . && ruff check --fix .

bench: pg-start
	@$(ENV) python bench/run.py $(BENCH_ARGS)

# Derived trees (#17): ours full and incremental vs a naive level loop, per size in TREE_BLOCKS
# (no PostgreSQL; about 25 min on 2 cores for both sizes). BENCHMARKS.md, "Derived trees".
TREE_BLOCKS ?= 1000000 10000000
bench-tree: setup
	@$(ENV) for n in $(TREE_BLOCKS); do python bench/tree_bench.py --blocks $$n $(BENCH_TREE_ARGS) || exit 1; done

clean:
	@$(ENV) python -m cdc_lakehouse.dev.localstack stop || true
	rm -rf .local build
