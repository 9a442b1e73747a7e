from optpipe.cli.main import main


def test_compare_runs_on_every_instance(instance, tmp_path):
    from optpipe.solvers.compare import compare

    entries = compare(instance)
    assert any(e.applicable for e in entries)


def test_cli_reports_missing_file(capsys):
    assert main(["check" if False else "compare", "/nonexistent.toml"]) == 1
    assert "no such problem file" in capsys.readouterr().err
