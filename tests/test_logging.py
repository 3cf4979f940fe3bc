"""Log messages follow transformers' verbosity; progress bars follow its switch and HF_HUB_DISABLE_PROGRESS_BARS.

In process: the library logger shown / hidden by ``transformers.logging.set_verbosity_*`` at the
time of each message, the bar switches, and :class:`~hf_pipeline.log.StepProgress` (bar with ETA
and the loss, a line every ``log_every`` steps, the final bar state once). Then ``hf-pipeline
train`` in a fresh process with and without ``--no-progress``: the loss lines print either way,
the bar only without it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import pytest
import transformers
from transformers.utils import logging as hf_logging

from hf_pipeline.log import StepProgress, get_logger, progress_bar, progress_enabled

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def verbosity():
    before = hf_logging.get_verbosity()
    yield
    hf_logging.set_verbosity(before)


@pytest.fixture
def bars():
    before = hf_logging.is_progress_bar_enabled()
    yield
    (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


def test_library_logger_follows_transformers_verbosity_when_each_message_is_logged(capsys, verbosity):
    logger = get_logger("hf_pipeline.some_module")
    hf_logging.set_verbosity_warning()
    logger.info("info at warning")
    logger.warning("warning at warning")
    transformers.logging.set_verbosity_info()  # after the logger exists: still followed
    logger.info("info at info")
    transformers.logging.set_verbosity_error()
    logger.warning("warning at error")
    logger.error("error at error")
    err = capsys.readouterr().err
    assert "warning at warning" in err and "info at info" in err and "error at error" in err, err
    assert "info at warning" not in err and "warning at error" not in err, err


def test_library_messages_do_not_reach_the_root_logger_twice(capsys, verbosity):
    root = logging.getLogger()
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    root.addHandler(handler)
    try:
        hf_logging.set_verbosity_warning()
        get_logger("hf_pipeline.x").warning("once")
    finally:
        root.removeHandler(handler)
    assert seen == [] and capsys.readouterr().err.count("once") == 1


def test_informational_messages_are_log_records_not_python_warnings(tmp_path, monkeypatch, capsys, verbosity):
    import warnings

    from hf_pipeline.tools import default_model

    monkeypatch.setattr(default_model, "BUNDLED_MODEL_DIR", tmp_path / "missing")
    monkeypatch.setattr(default_model, "random_model_path", lambda: tmp_path / "random")
    hf_logging.set_verbosity_warning()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warnings.warn would raise here
        assert default_model.default_model_path() == tmp_path / "random"
    assert "bundled default model is missing" in capsys.readouterr().err
    hf_logging.set_verbosity_error()
    default_model.default_model_path()
    assert "bundled default model" not in capsys.readouterr().err


def test_progress_bars_respect_transformers_switch_and_the_hub_variable(monkeypatch, bars):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    assert progress_enabled() and not progress_enabled(False)
    assert not progress_bar(total=1).disable
    hf_logging.disable_progress_bar()
    assert not progress_enabled() and progress_bar(total=1).disable
    hf_logging.enable_progress_bar()
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when the bar is made, not at import
    assert not progress_enabled() and progress_bar(total=1).disable


def test_weight_loading_bar_is_hidden_by_transformers_switch(tmp_path, capsys, bars):
    import tiny
    import torch

    from hf_pipeline.loading.checkpoint_files import CheckpointIndex
    from hf_pipeline.loading.weights import load_tensors

    index = CheckpointIndex.from_directory(tiny.make_checkpoint(tmp_path / "ckpt", "llama"))
    wanted = {k: (tuple(h["shape"]), torch.float32) for k, h in _headers(index, sorted(index.keys())[:2]).items()}
    hf_logging.enable_progress_bar()
    load_tensors(index, wanted, progress=True)
    assert "Loading weights" in capsys.readouterr().err
    hf_logging.disable_progress_bar()
    load_tensors(index, wanted, progress=True)
    assert "Loading weights" not in capsys.readouterr().err


def _headers(index, keys):
    from hf_pipeline.loading.safetensors_header import read_header

    out = {}
    for shard, names in index.shards_for(keys).items():
        header = read_header(index.directory / shard)
        out.update({n: header[n] for n in names})
    return out


def test_step_progress_prints_lines_with_eta_and_the_final_bar_once(capsys, bars):
    hf_logging.enable_progress_bar()
    with StepProgress(25, log_every=10) as progress:
        for step in range(25):
            progress.step(step + 1, loss=2.0 - step / 100, lr=3e-4)
        progress.write("saved out")
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [int(line.split()[1]) for line in lines if line.startswith("step")] == [1, 10, 20, 25], out
    assert all("eta" in line for line in lines[:3]) and "loss 1.7600" in lines[3] and lines[-1] == "saved out", out
    assert err.count("25/25") == 1, repr(err)  # the final state, once
    assert "loss=1.7600" in err and "<" in err  # the postfix, and tqdm's elapsed<remaining


def test_step_progress_without_bar_still_prints_the_loss_and_off_main_rank_nothing(capsys):
    with StepProgress(3, log_every=1, bar=False) as progress:
        for step in range(3):
            progress.step(step + 1, loss=1.5)
    out, err = capsys.readouterr()
    assert [line.split()[:4] for line in out.splitlines()] == [["step", str(s), "loss", "1.5000"] for s in (1, 2, 3)]
    assert err == ""
    with StepProgress(3, log_every=1, enabled=False) as progress:
        progress.step(1, loss=1.5)
        progress.write("x")
    assert capsys.readouterr() == ("", "")


def test_step_progress_resumed_measures_eta_from_the_resumed_step(capsys):
    with StepProgress(10, initial=4, log_every=5, bar=False) as progress:
        for step in range(4, 10):
            progress.step(step + 1, loss=1.0)
    steps = [int(line.split()[1]) for line in capsys.readouterr().out.splitlines()]
    assert steps == [5, 10]


# ------------------------------------------------------------------------------------------ hf-pipeline train
def _train(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    data = tmp_path / "data.txt"
    data.write_text("\n".join(["Return the sum of the items.", "Open the file for reading."] * 8), encoding="utf-8")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        HF_PIPELINE_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "HF_HUB_DISABLE_PROGRESS_BARS"):
        env.pop(key, None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_pipeline.cli",
            "train",
            "--data",
            str(data),
            "--output-dir",
            str(tmp_path / "out"),
            "--steps",
            "4",
            "--batch-size",
            "2",
            "--block-size",
            "8",
            "--device",
            "cpu",
            "--log-every",
            "2",
            *extra,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.mark.dist
@pytest.mark.parametrize("no_progress", [False, True], ids=["bar", "no-progress"])
def test_cli_train_prints_loss_lines_with_or_without_the_bar(tmp_path, no_progress):
    proc = _train(tmp_path, *(["--no-progress"] if no_progress else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert steps == [1, 2, 4], proc.stdout
    assert "eta" in proc.stdout
    if no_progress:
        assert "train:" not in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.stderr.count("4/4") == 1 and "loss=" in proc.stderr, proc.stderr[-2000:]
