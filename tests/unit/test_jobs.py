"""The Spark jobs' one definition of their parameters (cdc_lakehouse.jobs.params) and their one
registry (jobs.registry): parameters survive their command line, the DAG factory's tasks pass
command lines their jobs parse into the parameters meant, and the registry and spark_jobs/ agree."""

from __future__ import annotations

import ast
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from cdc_lakehouse.config import OutputMaintenanceConfig
from cdc_lakehouse.jobs.audit import AuditParams
from cdc_lakehouse.jobs.bootstrap import BootstrapParams
from cdc_lakehouse.jobs.derive import DeriveParams
from cdc_lakehouse.jobs.export import ExportParams
from cdc_lakehouse.jobs.feed import FeedConsumerParams
from cdc_lakehouse.jobs.feed_block_counts import BlockCountsParams
from cdc_lakehouse.jobs.history import HistoryParams
from cdc_lakehouse.jobs.ingest import IngestParams
from cdc_lakehouse.jobs.maintenance import MaintenanceParams
from cdc_lakehouse.jobs.params import JobParams
from cdc_lakehouse.jobs.registry import JOBS, JOBS_DIR
from cdc_lakehouse.jobs.replay import ReplayParams

from tests.dag_files import dags_of, tables_keeping_a_history

ROOT = Path(__file__).resolve().parents[2]

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
    BootstrapParams(tables=("a", "b"), endpoints=("pg_a",), run_id="20260301T000000"),
    MaintenanceParams(tables=("a", "b"), run_id="r"),
    MaintenanceParams(derived=("tree",), derived_dir="/conf/derived"),
    MaintenanceParams(feed_output="feed.out", consumer="c", settings=OutputMaintenanceConfig(target_file_size_mb=64)),
    AuditParams(tables=("t",)),
    AuditParams(tables=("t",), audit_run="scheduled__x"),
    AuditParams(tables=("t",), audit_run="scheduled__x__repair", repair="approved"),
    ReplayParams(tables=("t",)),
    ReplayParams(tables=("t",), replay_run="manual__x"),
    HistoryParams(tables=("t",)),
    HistoryParams(tables=("a", "b"), mode="rebuild"),
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


# --- the DAG side ----------------------------------------------------------------------------------

END = datetime(2026, 3, 1, 1, tzinfo=UTC)
RUN_ID = "scheduled__2026-03-01T00:00:00+00:00"


def _context(dag, **params) -> dict:
    """What Airflow renders a task's templates with, for one run of `dag`."""
    event = SimpleNamespace(extra={"snapshot_id": 42})
    return {
        "run_id": RUN_ID,
        "ts_nodash": "20260301T000000",
        "data_interval_end": END,
        "params": {**dag.params.dump(), **params},
        "triggering_asset_events": {"lake.t": [event]},
    }


def _parsed(dag, task_id: str, **params) -> JobParams:
    """The task's command line, rendered as Airflow renders it, parsed as its job parses it."""
    task = dag.get_task(task_id)
    argv = [task.render_template(a, _context(dag, **params)) for a in task.application_args]
    return JOBS[task.job].params.from_argv(argv)


def test_the_dag_files_tasks_pass_what_their_jobs_parse(tmp_path):
    for name, group in (("t", ""), ("u", "ingest: {group: g, parallel_tables: 6}\n"), ("v", "ingest: {group: g}\n")):
        (tmp_path / f"{name}.yaml").write_text(
            textwrap.dedent(f"""
            name: {name}
            source: {{table: {name}, shards: [{{conn_id: pg_a, schemas: [s0]}}, {{conn_id: pg_b, schemas: [s1]}}]}}
            primary_key: [id]
            """)
            + group
        )
    dags = dags_of(tmp_path, tmp_path / "no-derived")
    # undecided_drop=ask: a dropped column waits for the DAG's keep/drop question (#53).
    window = {
        "upto_run": "20260301T010000Z",
        "ingest_run": RUN_ID,
        "interval_end": END.isoformat(),
        "undecided_drop": "ask",
    }
    assert _parsed(dags["cdc_ingest__t"], "ingest") == IngestParams(tables=("t",), **window)
    # A group runs as many tables at once as the largest parallel_tables of its tables.
    assert _parsed(dags["cdc_ingest_group__g"], "ingest") == IngestParams(tables=("u", "v"), parallel=6, **window)
    assert _parsed(dags["cdc_bootstrap__t"], "bootstrap") == BootstrapParams(tables=("t",), run_id="20260301T000000")
    assert _parsed(dags["cdc_bootstrap__t"], "bootstrap", shards=["pg_a", "pg_b"], pause_after_chunks=3) == (
        BootstrapParams(tables=("t",), shards=("pg_a", "pg_b"), run_id="20260301T000000", pause_after_chunks=3)
    )
    # After a lost slot: one table's shards of one endpoint, or every table's (cdc_recover__<endpoint>).
    assert _parsed(dags["cdc_bootstrap__t"], "bootstrap", endpoint="pg_b") == BootstrapParams(
        tables=("t",), endpoints=("pg_b",), run_id="20260301T000000"
    )
    recover = dags["cdc_recover__pg_a"]
    assert [t.task_id for t in recover.tasks] == ["bootstrap__t", "bootstrap__u", "bootstrap__v"]
    assert _parsed(recover, "bootstrap__u") == BootstrapParams(
        tables=("u",), endpoints=("pg_a",), run_id="20260301T000000"
    )
    assert {t.pool for t in recover.tasks} == {"cdc_table__t", "cdc_group__g"}  # each table's writer pool
    assert sorted(d for d in dags if d.startswith("cdc_recover__")) == ["cdc_recover__pg_a", "cdc_recover__pg_b"]
    assert _parsed(dags["cdc_maintenance__t"], "maintenance") == MaintenanceParams(
        tables=("t",), run_id="20260301T000000"
    )
    assert _parsed(dags["cdc_audit__t"], "audit") == AuditParams(tables=("t",), audit_run=RUN_ID)
    assert _parsed(dags["cdc_audit__t"], "repair") == AuditParams(
        tables=("t",), audit_run=f"{RUN_ID}__repair", repair="approved"
    )
    assert _parsed(dags["cdc_replay__t"], "replay") == ReplayParams(tables=("t",), replay_run=RUN_ID)


def test_a_bootstrap_of_an_endpoint_takes_exactly_its_shards():
    from cdc_lakehouse.jobs.bootstrap import selected_shards

    from tests.conftest import make_config

    cfg = make_config(
        "t",
        [],
        source={
            "table": "t",
            "shards": [
                {"conn_id": "pg_a", "schemas": ["s0", "s1"]},
                {"conn_id": "pg_b", "schemas": ["s2"]},
                {"conn_id": "pg_a", "database": "other", "schemas": ["s3"]},
            ],
        },
    )
    by = {g.endpoint_id: [shard for gg, _, shard in cfg.shards() if gg is g] for g in cfg.source.shards}
    assert (
        selected_shards(cfg, BootstrapParams(tables=("t",), endpoints=("pg_a",))) == by["pg_a"] and len(by["pg_a"]) == 2
    )
    assert selected_shards(cfg, BootstrapParams(tables=("t",), endpoints=("pg_a__other",))) == by["pg_a__other"]
    assert selected_shards(cfg, BootstrapParams(tables=("t",), shards=("x",))) == ["x"]
    assert selected_shards(cfg, BootstrapParams(tables=("t",))) is None
    with pytest.raises(ValueError, match=r"no shard is read through endpoint\(s\) \['pg_c'\].*pg_a__other"):
        selected_shards(cfg, BootstrapParams(tables=("t",), endpoints=("pg_c",)))
    with pytest.raises(ValueError, match="either shards or endpoints"):
        selected_shards(cfg, BootstrapParams(tables=("t",), endpoints=("pg_a",), shards=("x",)))


def test_the_repositorys_dags_pass_what_their_jobs_parse(monkeypatch, tmp_path):
    """Every Spark task of the repository's DAGs (the derived, export and feed ones too, and the
    history rebuild of a table that keeps a history)."""
    from cdc_lakehouse.orchestration.dag_parts import feed_consumer_dag
    from cdc_lakehouse.orchestration.operators import CdcSparkSubmitOperator

    tables = tables_keeping_a_history(tmp_path)
    monkeypatch.setenv("CDC_TABLES_DIR", str(tables))
    dags = dags_of(tables, ROOT / "include" / "derived", ROOT / "include" / "exports")
    feed = feed_consumer_dag("block", "block_counts", "feed_block_counts", "feed.block_counts", "about")
    dags[feed.dag_id] = feed
    tasks = [(d, t) for d in dags.values() for t in d.tasks if isinstance(t, CdcSparkSubmitOperator)]
    assert {t.job for _, t in tasks} == set(JOBS)
    for dag, task in tasks:
        assert isinstance(_parsed(dag, task.task_id), JOBS[task.job].params), (dag.dag_id, task.task_id)
    assert _parsed(dags["cdc_derived__block_tree"], "derive", mode="full") == DeriveParams(
        derived=("block_tree",), mode="full"
    )
    assert _parsed(dags["cdc_export__block_tree_serving"], "export") == ExportParams(exports=("block_tree_serving",))
    assert _parsed(dags["cdc_history__block"], "rebuild") == HistoryParams(tables=("block",), mode="rebuild")
    assert _parsed(feed, "consume", mode="full") == BlockCountsParams(tables=("block",), mode="full", upto=42)
    maintenance = _parsed(feed, "maintenance")
    assert maintenance == MaintenanceParams(
        feed_output="feed.block_counts", consumer="block_counts", settings=OutputMaintenanceConfig(), run_id=RUN_ID
    )


def test_a_dag_gives_a_job_only_its_own_parameters():
    from cdc_lakehouse.orchestration.dag_parts import spark_task

    with pytest.raises(TypeError, match="job feed_block_counts takes BlockCountsParams, not IngestParams"):
        spark_task("t", "feed_block_counts", IngestParams(tables=("t",)), [], "default_pool")
    with pytest.raises(ValueError, match="no Spark job 'nope'"):
        spark_task("t", "nope", IngestParams(tables=("t",)), [], "default_pool")
