"""scripts/finetune.py at tiny size under torchrun: LoRA (the default) and full fine-tuning.

A tiny LLaMA with a word-level tokenizer over a small text file; 4 steps with checkpoints every 2.
LoRA (on every projection, with activation checkpointing and ``--merge``): the checkpoints hold the
adapter, not the base weights; the final adapter loads with ``PeftModel.from_pretrained`` on one
process, is trained (``lora_B`` starts at zero), and gives the logits of the merged model the script
wrote from the pipelined one (within 1e-5: merging only reorders fp32 sums), which differ from the
base model's. ``--full``: checkpoints and a final model plain transformers loads. (Resuming,
``--resume``, is the Trainer's ``resume_from_checkpoint=True``: tests/integrations/.)
"""

from __future__ import annotations

import json

import pytest
import tiny
import torch
import transformers
from test_train_script import ROOT, _run, _torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SCRIPT = ROOT / "scripts" / "finetune.py"


def _losses(checkpoint) -> dict[int, float]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {e["step"]: e["loss"] for e in history if "loss" in e}


def _finetune(tmp_path, *extra: str):
    text = tiny.text_file(tmp_path / "train.txt")
    model = tiny.make_checkpoint(tmp_path / "llama", "llama")
    tiny.word_tokenizer(text).save_pretrained(model)
    out = tmp_path / "out"
    common = ["--model", str(model), "--data", str(text), "--output-dir", str(out), "--steps", "4",
              "--save-every", "2", "--log-every", "1", "--batch-size", "4", "--n-microbatches", "2",
              "--grad-accum", "2", "--warmup-steps", "1", "--lr", "1e-2", "--max-length", "16", *extra]
    cmd = _torchrun(*common)
    cmd[cmd.index(str(ROOT / "scripts" / "train.py"))] = str(SCRIPT)
    log = _run(cmd)
    assert "trained 4 steps on 2 rank(s)" in log, log[-2000:]
    first = _losses(out / "checkpoint-4")
    assert sorted(first) == [1, 2, 3, 4] and all(v > 0 for v in first.values())
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    return model, out


def test_torchrun_lora_finetune_saves_an_adapter_peft_loads(tmp_path):
    peft = pytest.importorskip("peft")
    base_dir, out = _finetune(tmp_path, "--lora-targets", "all-linear", "--activation-checkpointing", "--merge")
    for checkpoint in ("checkpoint-2", "checkpoint-4", "final"):
        files = {p.name for p in (out / checkpoint).iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files, files
        assert "model.safetensors.index.json" not in files, f"{checkpoint}: the frozen base model was saved"
    tok = transformers.AutoTokenizer.from_pretrained(out / "final")
    ids = tok(["the quick brown fox jumps"], return_tensors="pt")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(**ids).logits
        adapted = peft.PeftModel.from_pretrained(base, out / "final").eval()
        lora_b = [p for n, p in adapted.named_parameters() if "lora_B" in n]
        assert len(lora_b) == 7 * 4 and all(p.abs().max() > 0 for p in lora_b), "the adapter was not trained"
        got = adapted(**ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
        want = merged(**ids).logits
    # fp32 logits, adapter merged vs unmerged: summation order ~1e-6; a lost adapter moves them > 1e-3 (checked
    # below).
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - before).abs().max() > 1e-3, "the adapter does not change the logits"


def test_torchrun_full_finetune_checkpoints_and_final_model(tmp_path):
    _, out = _finetune(tmp_path, "--full")
    assert (out / "checkpoint-2" / "model.safetensors.index.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    tok = transformers.AutoTokenizer.from_pretrained(out / "final")
    assert hf(**tok(["the quick brown fox"], return_tensors="pt")).logits.shape == (1, 4, tiny.VOCAB)
