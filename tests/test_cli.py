"""The `rollplex` command (rollplex.cli.main): its subcommands train, export and plot, and what it says when it
gets no command, an unknown one, or a folder that is not a run's to export."""

import runpy
import sys
from pathlib import Path

import pytest

from rollplex.cli import main
from rollplex.metrics import MetricsLogger

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rollplex COMMAND [ARGS...]")
    for command in ("train", "export", "plot"):
        assert f"\n  {command} " in out


@pytest.mark.parametrize("argv, problem", [([], "no command given"), (["fit"], "unknown command 'fit'")])
def test_no_command_or_an_unknown_one_exits_2_with_the_usage(argv, problem, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rollplex COMMAND") and err.endswith(f"rollplex: {problem}\n")


def test_train_takes_the_training_options(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0 and "--trainer.total_steps" in capsys.readouterr().out


@pytest.mark.parametrize("files, expected", [
    ((), "is not a run's folder: it holds no config.yaml and no checkpoints/ (a run's trainer.output_dir holds "
         "config.yaml and checkpoints/)"),
    (("config.yaml",), "holds no checkpoints/: the run saved no checkpoint (trainer.save_every 0, or it stopped "
                       "before its first save)"),
])
def test_export_of_a_folder_that_is_not_a_run_says_what_it_looked_for_and_exits_2(tmp_path, capsys, files, expected):
    for name in files:
        (tmp_path / name).write_text("")
    with pytest.raises(SystemExit) as done:
        main(["export", str(tmp_path), "--out", str(tmp_path / "out")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rollplex export") and f"rollplex export: error: {tmp_path} {expected}" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as done:
        main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    assert done.value.code == 2 and f"{tmp_path / 'nowhere'} is not a folder" in capsys.readouterr().err


def test_plot_writes_a_runs_curves(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with MetricsLogger(tmp_path, console=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"critic/score/mean": step / 3, "timing_s/step": 1.0})
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out == f"wrote {tmp_path / 'curves.png'} (3 steps)\n"


# runpy warns that this module imported rollplex.cli already: run again as __main__, it holds nothing that differs.
@pytest.mark.filterwarnings("ignore:'rollplex.cli' found in sys.modules")
def test_the_installed_command_and_python_m_rollplex_cli_run_main(monkeypatch, capsys):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"rollplex": "rollplex.cli:main"}
    monkeypatch.setattr(sys, "argv", ["rollplex", "export", "--help"])
    with pytest.raises(SystemExit) as done:  # in this process: a new one would spend seconds importing torch
        runpy.run_module("rollplex.cli", run_name="__main__")
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: rollplex export")
