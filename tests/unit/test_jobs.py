"""The Spark jobs' one definition of their parameters (cdc_lakehouse.jobs.params) and their one
registry (jobs.registry): parameters survive their command line, and the registry and spark_jobs/
agree."""

from __future__ import annotations

import ast

import pytest
from cdc_lakehouse.config import OutputMaintenanceConfig
from cdc_lakehouse.jobs.audit import AuditParams
from cdc_lakehouse.jobs.bootstrap import BootstrapParams
from cdc_lakehouse.jobs.derive import DeriveParams
from cdc_lakehouse.jobs.export import ExportParams
from cdc_lakehouse.jobs.feed import FeedConsumerParams
from cdc_lakehouse.jobs.feed_block_counts import BlockCountsParams
from cdc_lakehouse.jobs.ingest import IngestParams
from cdc_lakehouse.jobs.maintenance import MaintenanceParams
from cdc_lakehouse.jobs.params import JobParams
from cdc_lakehouse.jobs.registry import JOBS, JOBS_DIR

# Per parameters class: its defaults, and every field away from its default (or templated in a DAG).
SAMPLES: list[JobParams] = [
    IngestParams(tables=("t",)),
    IngestParams(
        tables=("a", "b"),
        upto_run="20260301T010000Z",
        ingest_run="scheduled__2026-03-01T00:00:00+00:00",
        interval_end="2026-03-01T01:00:00+00:00",
        config_dir="/conf/tables",
        app_name="app",
    ),
    BootstrapParams(tables=("t",)),
    BootstrapParams(tables=("t",), shards=("s1", "s2"), run_id="20260301T000000", pause_after_chunks=3),
    MaintenanceParams(tables=("a", "b"), run_id="r"),
    MaintenanceParams(derived=("tree",), derived_dir="/conf/derived"),
    MaintenanceParams(feed_output="feed.out", consumer="c", settings=OutputMaintenanceConfig(target_file_size_mb=64)),
    AuditParams(tables=("t",)),
    AuditParams(tables=("t",), audit_run="scheduled__x"),
    DeriveParams(derived=("tree",)),
    DeriveParams(derived=("a", "b"), derived_dir="/d", mode="full"),
    ExportParams(exports=("e",)),
    ExportParams(exports=("e",), derived_dir="/d", exports_dir="/x", mode="rollback"),
    FeedConsumerParams(tables=("t",), consumer="c", output="ns.out"),
    FeedConsumerParams(tables=("t",), consumer="c", output="ns.out", mode="full", max_lag_hours=5, upto=42),
    BlockCountsParams(tables=("block",)),
]


@pytest.mark.parametrize("params", SAMPLES, ids=lambda p: type(p).__name__)
def test_parameters_survive_their_command_line(params):
    assert type(params).from_argv(params.to_argv()) == params


def test_every_job_has_samples():
    assert {j.params for j in JOBS.values()} <= {type(p) for p in SAMPLES}


def test_a_template_takes_its_fields_place_and_an_unknown_name_is_refused():
    argv = BootstrapParams(tables=("t",)).to_argv(pause_after_chunks="{{ params.n }}", run_id="{{ ts_nodash }}")
    assert argv == ["--tables", "t", "--run-id", "{{ ts_nodash }}", "--pause-after-chunks", "{{ params.n }}"]
    with pytest.raises(ValueError, match="no field"):
        BootstrapParams(tables=("t",)).to_argv(nope="x")


def test_bad_command_lines_stop_with_a_usage_message(capsys):
    for params, argv in (
        (IngestParams, []),  # --tables is required
        (DeriveParams, ["--derived", "d", "--mode", "sideways"]),
        (BootstrapParams, ["--tables", "t", "--pause-after-chunks", "many"]),
        (MaintenanceParams, ["--tables", "t", "--derived", "d"]),  # one target only
        (MaintenanceParams, ["--run-id", "r"]),  # and one is required
    ):
        with pytest.raises(SystemExit) as exc:
            params.from_argv(argv)
        assert exc.value.code == 2, argv
    with pytest.raises(ValueError, match="exactly one of"):
        MaintenanceParams()


def test_an_empty_snapshot_id_reads_as_none():
    # What FEED_UPTO renders without a triggering event, and Jinja's rendering of None.
    for upto in ("", "None"):
        assert BlockCountsParams.from_argv(["--tables", "block", "--upto", upto]).upto is None


# --- one registry ----------------------------------------------------------------------------------


def test_the_registry_and_the_spark_jobs_files_agree():
    files = {p.stem: p for p in JOBS_DIR.glob("*.py")}
    assert sorted(files) == sorted(JOBS), "every job has its spark_jobs/<name>.py and every file is a job"
    for name, job in JOBS.items():
        assert job.name == name and job.file == files[name]
        calls = [
            n
            for n in ast.walk(ast.parse(files[name].read_text()))
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "run_job"
        ]
        assert [ast.literal_eval(c.args[0]) for c in calls] == [name], f"{files[name]} must run_job({name!r})"


def test_every_job_answers_help_without_spark(capsys):
    from cdc_lakehouse.jobs.registry import run_job

    for name, job in JOBS.items():
        with pytest.raises(SystemExit) as exc:
            run_job(name, ["--help"])
        assert exc.value.code == 0
        assert job.params.description in capsys.readouterr().out
