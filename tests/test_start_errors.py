"""Errors a user causes at start, after the config checks: each is one console line
`error: <message>` and exit 1, never a Python traceback; the trace goes to the log file. Before,
a second `make run` over the first run's checkpoints ended in a 20-line traceback. Run through
`cli.main` with the pipeline's start replaced by the real code that raises each one (no Ray)."""
import os

import pytest

import pipelines
from roll_gspo import cli
from roll_gspo.lifecycle.checkpoint import COMPLETE_MARKER, resolve_resume

from tests.test_pipeline_e2e import write_config


def checkpoints_exist(cfg):
    """A second run into a first run's output_dir (what a second `make run` does)."""
    folder = os.path.join(cfg.output_dir, "checkpoints", "step_4")
    os.makedirs(folder)
    open(os.path.join(folder, COMPLETE_MARKER), "w").close()
    resolve_resume(cfg.output_dir, None)


def not_a_checkpoint(cfg):
    resolve_resume(cfg.output_dir, os.path.join(cfg.output_dir, "nowhere"))


def data_that_does_not_fit(cfg):
    raise ValueError("data rows have domains ['code'] that no `rewards` block scores")


def unwritable_folder(cfg):
    raise PermissionError(13, "Permission denied", os.path.join(cfg.output_dir, "final_model"))


@pytest.mark.parametrize("start", [checkpoints_exist, not_a_checkpoint, data_that_does_not_fit, unwritable_folder])
def test_a_start_error_is_one_line_and_exit_1(start, tmp_path, tiny_model, monkeypatch, capsys):
    from omegaconf import OmegaConf

    write_config(tmp_path, tiny_model, max_steps=1)
    config = OmegaConf.load(tmp_path / "config.yaml")
    config.actor_infer.strategy_args = {"strategy_name": "hf_infer"}  # its preflight imports no vLLM
    OmegaConf.save(config, tmp_path / "config.yaml")
    monkeypatch.setattr(pipelines, "run_pipeline_from_config", start)
    assert cli.main(["--config", str(tmp_path / "config.yaml")]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    assert len(lines[-1]) > len("error: ") + 20


def test_a_programming_error_keeps_its_traceback(tmp_path, tiny_model, monkeypatch):
    """Only what a user causes is cut to one line: a bug's trace stays in front of whoever reports it."""
    from omegaconf import OmegaConf

    write_config(tmp_path, tiny_model, max_steps=1)
    config = OmegaConf.load(tmp_path / "config.yaml")
    config.actor_infer.strategy_args = {"strategy_name": "hf_infer"}
    OmegaConf.save(config, tmp_path / "config.yaml")

    def bug(cfg):
        raise KeyError("response_ids")

    monkeypatch.setattr(pipelines, "run_pipeline_from_config", bug)
    with pytest.raises(KeyError):
        cli.main(["--config", str(tmp_path / "config.yaml")])
