"""PipelineTrainer's set-up is agreed between ranks: a bad ``output_dir`` is one named error on every rank.

transformers' Trainer creates ``output_dir`` on the main process only, so an ``output_dir`` that is a file
raised a raw ``FileExistsError`` on rank 0 while rank 1 went on to train (and then blamed a crash). Each case
below builds the Trainer on 2 ranks; every rank must raise, naming the path (the rank that found it raises
``CheckpointExistsError``, a ``FileExistsError``; a rank whose own path is fine raises ``RankError`` quoting
it), and the model must still build a Trainer with a good ``output_dir`` and run a forward, equal on both ranks.
"""

from __future__ import annotations

import os

import pytest
import tiny
import torch
from harness import expect_errors

pytest.importorskip("datasets")


def _args(out):
    import transformers

    return transformers.TrainingArguments(str(out), per_device_train_batch_size=4, max_steps=1, report_to=[],
                                          use_cpu=True, disable_tqdm=True)


def _setup_case(dirs, case):
    import hf_pipeline

    rank = int(os.environ["RANK"])
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(dirs["base"], pipeline=True, device="cpu")
    out = {"file": dirs["file"], "under_file": dirs["file"] / "run", "file_on_rank0": dirs["file"] if rank == 0
           else dirs["tmp"] / "rank1-out"}[case]
    try:
        hf_pipeline.PipelineTrainer(model=model, args=_args(out))
    except Exception as e:  # noqa: BLE001 - compared below
        error = e
    else:
        raise AssertionError(f"rank {rank}: a Trainer was built with output_dir={out}")
    hf_pipeline.PipelineTrainer(model=model, args=_args(dirs["tmp"] / f"ok-{rank}"))  # the next set-up works
    with torch.no_grad():
        logits = model(**tiny.sample_inputs("llama")).logits
    raise RuntimeError(f"{type(error).__name__}|{isinstance(error, FileExistsError)}|{error}|{logits.sum().item()!r}")


@pytest.mark.dist
@pytest.mark.parametrize("case", ["file", "under_file", "file_on_rank0"])
def test_output_dir_that_is_a_file_is_one_error_on_every_rank(tmp_path, case):
    base = tiny.make_checkpoint(tmp_path / "llama", "llama")
    (tmp_path / "a-file").write_text("the user's notes\n")
    dirs = {"base": base, "file": tmp_path / "a-file", "tmp": tmp_path}
    errors = expect_errors(_setup_case, 2, dirs, case, timeout=300)
    seen = []
    for rank, error in enumerate(errors):
        assert str(error).count("|") >= 3, f"rank {rank}: {errors}"
        name, is_file_exists, message, logits = str(error).split("|")[-4:]
        name = name.split(": ")[-1].strip()
        if case == "file_on_rank0" and rank == 1:
            assert name == "RankError" and "rank 0" in message, f"rank {rank}: {name}: {message}"
        else:
            assert name == "CheckpointExistsError" and is_file_exists == "True", f"rank {rank}: {name}: {message}"
        assert "output_dir" in message and "a-file" in message and "not a directory" in message, message
        seen.append(float(logits))
    assert seen[0] == seen[1]
    assert (tmp_path / "a-file").read_text() == "the user's notes\n", "the user's file was changed"
