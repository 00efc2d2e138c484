"""`quarantine replay T` refuses, before starting Spark, a table with no valid config: the replay
validates against the table's current config, so it names the table, where it looked and the fix."""

from __future__ import annotations

from cdc_lakehouse import cli


def test_replay_of_a_table_without_a_valid_config_names_it_and_the_fix(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken.yaml").write_text("name: broken\nprimary_key: [id]\n")  # no source: invalid
    monkeypatch.setenv("CDC_TABLES_DIR", str(tmp_path))
    from cdc_lakehouse.runtime import session

    def no_spark(*a, **k):
        raise AssertionError("Spark started for a table without a valid config")

    monkeypatch.setattr(session, "get_spark", no_spark)
    assert cli.main(["quarantine", "replay", "broken"]) == 1
    err = capsys.readouterr().err
    assert "no valid table config named 'broken'" in err and str(tmp_path) in err
    assert "cdc_lakehouse.cli validate" in err and "broken.yaml" in err  # the config's own error follows
