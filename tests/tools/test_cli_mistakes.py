"""The command line on a careless user's mistakes: one line on stderr and exit code 2, found before any
training step, and a trained model never thrown away by a save that fails at the end.

Each case runs ``hf_pipeline.cli.main`` in this process (the port-in-use case in a fresh one, as a user
would), and checks the whole line it prints.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import tiny
import transformers

from hf_pipeline import cli
from hf_pipeline.tools.default_model import default_model_path

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _one_line(capsys, argv: list[str]) -> str:
    """Run the CLI on ``argv``; it must end with exit code 2 and one ``hf-pipeline: error:`` line, no traceback."""
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-pipeline: error: "), (argv, err)
    assert "Traceback" not in err
    return lines[0].removeprefix("hf-pipeline: error: ")


@pytest.fixture
def notes(tmp_path) -> pathlib.Path:
    path = tmp_path / "notes.txt"
    path.write_text("Return the sum of the items.\nOpen the file for reading.\n" * 20, encoding="utf-8")
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the model is loaded: the mistakes below must be found before that (and any step)."""
    from hf_pipeline import model

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(model, "load_pipelined", load)


# ------------------------------------------------------------------------------------------ train: before step 1
def test_train_arguments_are_checked_before_the_model_loads(tmp_path, notes, capsys, no_load):
    a_file = tmp_path / "a-file"
    a_file.write_text("x", encoding="utf-8")
    train = ["train", "--data", str(notes), "--steps", "1"]
    out = ["--output-dir", str(tmp_path / "out")]
    assert _one_line(capsys, [*train, *out, "--max-shard-size", "2XB"]) == (
        "argument --max-shard-size: cannot read the size '2XB' (--max-shard-size); write e.g. '500MB', '2GB' or a "
        "number of bytes (see `hf-pipeline train --help`)"
    )
    assert _one_line(capsys, [*train, "--output-dir", str(a_file)]) == (
        f"--output-dir {a_file} is a file; pass a folder path (it is created if missing)"
    )
    assert _one_line(capsys, [*train, "--output-dir", str(a_file / "sub")]) == (
        f"--output-dir {a_file / 'sub'} cannot be made: {a_file} is a file, not a folder; pass another path"
    )
    assert _one_line(capsys, [*train, *out, "--log-file", str(tmp_path)]) == (
        f"--log-file {tmp_path} is a folder; pass a file path (it is created if missing)"
    )
    assert _one_line(capsys, [*train, *out, "--warmup-steps", "-1"]) == (
        "argument --warmup-steps: must be >= 0, got -1 (see `hf-pipeline train --help`)"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_train_output_dir_that_cannot_be_written_is_found_before_the_model_loads(tmp_path, notes, capsys, no_load):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        message = _one_line(capsys, ["train", "--data", str(notes), "--output-dir", str(locked / "out")])
    finally:
        locked.chmod(0o700)
    assert message == (
        f"--output-dir {locked / 'out'} cannot be made: {locked} is not writable; pass a folder you can write"
    )


def test_empty_or_malformed_data_file_is_one_line(tmp_path, capsys, no_load):
    empty, broken = tmp_path / "empty.txt", tmp_path / "broken.json"
    empty.write_text("", encoding="utf-8")
    broken.write_text("{[not json", encoding="utf-8")
    train = ["train", "--output-dir", str(tmp_path / "out"), "--data"]
    assert _one_line(capsys, [*train, str(empty)]) == (
        f"{empty} is empty: nothing to train on; pass a file with text in it (--data)"
    )
    message = _one_line(capsys, [*train, str(broken)])
    assert message.startswith(f"{broken} cannot be read as a json file (JSON parse error: ") and message.endswith(
        "); fix the file or its suffix"
    ), message
    missing = "no-such-folder/data.txt"  # looks like a hub id to the parser: the data loader says it
    assert _one_line(capsys, [*train, missing]) == f"{missing} is not a file; pass the data file (--data)"


@pytest.mark.equiv
def test_a_save_that_fails_at_the_end_keeps_the_trained_model_and_says_where(tmp_path, notes, capsys, monkeypatch):
    from hf_pipeline.model import PipelinedModel

    out = tmp_path / "out"
    real = PipelinedModel.save_pretrained
    tried = []

    def save(self, directory, **kwargs):
        tried.append(pathlib.Path(directory))
        if pathlib.Path(directory) == out:
            raise OSError(28, "No space left on device")
        return real(self, directory, **kwargs)

    monkeypatch.setattr(PipelinedModel, "save_pretrained", save)
    argv = ["train", "--data", str(notes), "--output-dir", str(out), "--steps", "2", "--batch-size", "2",
            "--block-size", "8", "--no-progress", "--device", "cpu"]
    message = _one_line(capsys, argv)
    kept = tried[1]
    assert kept.parent == tmp_path and kept.name.startswith("out.unsaved-"), tried
    assert message == (
        f"could not save into --output-dir {out} ([Errno 28] No space left on device); the trained model is in "
        f"{kept} instead: move it where you want it"
    )
    trained = transformers.AutoModelForCausalLM.from_pretrained(kept)  # a whole checkpoint, tokenizer too
    original = transformers.AutoModelForCausalLM.from_pretrained(default_model_path())
    assert any(not a.equal(b) for a, b in zip(trained.state_dict().values(), original.state_dict().values()))
    assert (kept / "tokenizer.json").is_file()


# ------------------------------------------------------------------------------------------ config, plan, device
def test_malformed_or_mistyped_config_is_one_line(tmp_path, capsys):
    ckpt = tiny.make_checkpoint(tmp_path / "llama", "llama", shards=1)
    capsys.readouterr()
    bad, typed = tmp_path / "bad", tmp_path / "typed"
    bad.mkdir()
    (bad / "config.json").write_text("{not json", encoding="utf-8")
    typed.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "two"}), encoding="utf-8")

    # Read through hf_pipeline.checked_files: the file named, with what is wrong with it.
    damaged = (
        f"{bad / 'config.json'} (the model config) is not valid JSON (Expecting property name enclosed in double "
        "quotes, line 1 column 2): it is truncated or was not written by hf_pipeline / transformers; re-save or "
        "re-download it"
    )
    assert _one_line(capsys, ["plan", str(bad)]) == damaged
    assert _one_line(capsys, ["plan", str(bad / "config.json")]) == damaged
    message = _one_line(capsys, ["plan", str(typed)])
    assert message.startswith(f"cannot read the config of {typed}: ") and message.endswith("; fix its config.json")
    assert "'num_hidden_layers' expected int, got str (value: 'two')" in message, message
    assert _one_line(capsys, ["generate", "--model", str(typed)]) == message  # the same check for every command


def test_plan_seq_beyond_the_models_positions_is_one_line(tmp_path, capsys):
    ckpt = tiny.make_checkpoint(tmp_path / "llama", "llama", shards=1)
    capsys.readouterr()
    limit = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    assert _one_line(capsys, ["plan", str(ckpt), "--seq", str(limit + 1)]) == (
        f"--seq {limit + 1} is longer than the {limit} positions the model has (config.max_position_embeddings); "
        f"pass --seq {limit} or less"
    )
    assert cli.main(["plan", str(ckpt), "--seq", str(limit)]) == 0


def test_unknown_device_is_one_line(capsys):
    assert _one_line(capsys, ["generate", "--device", "tpu"]) == (
        "argument --device: 'tpu' is not a torch device type; use e.g. cpu, cuda, cuda:1, mps or xpu "
        "(see `hf-pipeline generate --help`)"
    )


# ------------------------------------------------------------------------------------------ generate's inputs
def test_prompts_file_that_is_a_folder_binary_or_empty_is_one_line(tmp_path, capsys, no_load):
    binary, empty, blank = tmp_path / "b.bin", tmp_path / "e.txt", tmp_path / "blank.txt"
    binary.write_bytes(b"\xff\xfe\x00\x01\x80" * 10)
    empty.write_text("", encoding="utf-8")
    blank.write_text("\n  \n", encoding="utf-8")
    generate = ["generate", "--prompts-file"]
    assert _one_line(capsys, [*generate, str(tmp_path)]) == (
        f"--prompts-file {tmp_path} is not a file; pass a text file with one prompt per line"
    )
    assert _one_line(capsys, [*generate, str(binary)]) == (
        f"--prompts-file {binary} is not UTF-8 text; pass a text file with one prompt per line"
    )
    for path in (empty, blank):
        assert _one_line(capsys, [*generate, str(path)]) == (
            f"--prompts-file {path} has no prompts (it is empty or blank); write one prompt per line"
        )


def test_a_tokenizer_error_keeps_its_whole_message(tmp_path, capsys):
    ckpt = tiny.make_checkpoint(tmp_path / "llama", "llama", shards=1)  # weights and config, no tokenizer
    capsys.readouterr()
    message = _one_line(capsys, ["generate", "--model", str(ckpt)])
    assert message.startswith(f"cannot load the tokenizer of --model {ckpt}: "), message
    # transformers wraps this message over five lines; every sentence of it is kept
    assert "from one of: (1) a `tokenizers` library serialization file, (2)" in message, message
    assert message.endswith(
        "to convert a slow tokenizer to a fast one; save the model's tokenizer into that directory"
    ), message


def test_a_library_message_wrapped_mid_sentence_is_kept_to_the_sentences_end():
    wrapped = "Couldn't do it from one of: \n(1) a file, \n(2) a class.\nYou need X.\n\nMore."
    assert cli._one_line(wrapped) == "Couldn't do it from one of: (1) a file, (2) a class."
    assert cli._one_line("first line\nsecond line") == "first line"  # a whole first line stays as it was


# ------------------------------------------------------------------------------------------ launching
def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m hf_pipeline.cli ARGS`` in a fresh process, outside any launched job."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_PIPELINE_THREADS="1", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "hf_pipeline.cli", *args], env=env, capture_output=True, text=True,
                          timeout=240, cwd=ROOT)


@pytest.mark.dist
def test_a_bad_log_file_in_launched_processes_is_one_line_from_every_rank(tmp_path, notes):
    # Each of the 2 processes checks its arguments before loading; rank 0 prints, the launcher exits 2.
    proc = _cli("train", "--num-processes", "2", "--data", str(notes), "--output-dir", str(tmp_path / "out"),
                "--log-file", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"hf-pipeline: error: --log-file {tmp_path} is a folder; pass a file path (it is created if missing)"
    ], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.dist
def test_a_port_in_use_is_one_line_before_any_process_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _cli("generate", "--num-processes", "2", "--main-process-port", str(port), "--max-new-tokens", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"hf-pipeline: error: --main-process-port {port} is already in use on this machine ("
    ), proc.stderr
    assert lines[0].endswith("); pass a free port, or leave the option out on one machine to use any free port")
