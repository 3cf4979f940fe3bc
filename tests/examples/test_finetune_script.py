"""scripts/finetune.py at tiny size under torchrun: Trainer checkpoints and a model transformers loads.

A tiny LLaMA with a word-level tokenizer over a small text file; 4 steps with checkpoints every 2.
(Resuming, ``--resume``, is the Trainer's ``resume_from_checkpoint=True``: tests/trainer.)
"""

from __future__ import annotations

import json

import pytest
import tiny
import transformers
from test_train_script import ROOT, _run, _torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCRIPT = ROOT / "scripts" / "finetune.py"


def _losses(checkpoint) -> dict[int, float]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {e["step"]: e["loss"] for e in history if "loss" in e}


def test_torchrun_finetune_checkpoints_and_final_model(tmp_path):
    text = tiny.text_file(tmp_path / "train.txt")
    model = tiny.make_checkpoint(tmp_path / "llama", "llama")
    tiny.word_tokenizer(text).save_pretrained(model)
    out = tmp_path / "out"
    common = ["--model", str(model), "--data", str(text), "--output-dir", str(out), "--steps", "4",
              "--save-every", "2", "--log-every", "1", "--batch-size", "4", "--n-microbatches", "2",
              "--grad-accum", "2", "--warmup-steps", "1", "--lr", "1e-2", "--max-length", "16"]
    cmd = _torchrun(*common)
    cmd[cmd.index(str(ROOT / "scripts" / "train.py"))] = str(SCRIPT)
    log = _run(cmd)
    assert "trained 4 steps on 2 rank(s)" in log, log[-2000:]
    first = _losses(out / "checkpoint-4")
    assert sorted(first) == [1, 2, 3, 4] and all(v > 0 for v in first.values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    tok = transformers.AutoTokenizer.from_pretrained(out / "final")
    assert hf(**tok(["the quick brown fox"], return_tensors="pt")).logits.shape == (1, 4, tiny.VOCAB)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
