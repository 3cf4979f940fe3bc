"""The bundled T5 and BERT: they load in plain transformers, write what their cards say, and make sense.

The LLaMA default model's card and install checks are in test_cli.py. Here the two models of
notebooks 03 and 04 are checked on text they never saw in training; random weights fail every
"makes sense" assertion below (a random BERT's top 5 are arbitrary WordPiece pieces, a random T5
writes no words of the docstring). The script that trains them runs at tiny size for each
architecture, as ``devtools.make_default_model --tiny`` under torchrun.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import transformers

from hf_pipeline.tools import default_model
from hf_pipeline.tools.default_model import bundled_model_path, default_model_path

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Made up for this test (not in the standard library): (docstring, its first sentence).
HELD_OUT_DOCSTRINGS = [
    ("Return the number of items in the queue. The count is only approximate while other threads add or remove items.",
     "Return the number of items in the queue."),
    ("Close the connection to the server. Any data that was not sent yet is discarded.",
     "Close the connection to the server."),
]
# Masked docstring sentences and words a reader would accept in the gap (any one in the top 5).
FILL_MASK = [
    ("Return the [MASK] of the file.",
     {"name", "size", "path", "contents", "length", "mode", "type", "end", "encoding", "number"}),
    ("Close the [MASK] and release its resources.",
     {"file", "connection", "socket", "stream", "object", "process", "handle", "server"}),
]


def _words(text: str) -> list[str]:
    return [w.strip(".,:;()`'\"").lower() for w in text.split()]


def _card_stats(path: pathlib.Path) -> dict:
    stats = json.loads((path / "training_stats.json").read_text())
    card = (path / "README.md").read_text()
    assert f"**{stats['final_train_loss']:.3f}**" in card and f"**{stats['eval_loss']:.3f}**" in card
    assert "devtools.make_default_model" in stats["command"] and "model.train_step" in card
    return stats


def _t5_summaries(model, tok, sources: list[str]) -> list[str]:
    enc = tok(sources, return_tensors="pt", padding=True, truncation=True)
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=32, do_sample=False)
    return tok.batch_decode(ids, skip_special_tokens=True)


def _bundled(arch: str, auto: str):
    """(card stats, tokenizer, transformers model) of a bundled model, checked against its card."""
    path = bundled_model_path(arch)
    assert path is not None and default_model_path(arch) == path
    stats = _card_stats(path)
    model = getattr(transformers, auto).from_pretrained(path, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == stats["params"]
    return stats, transformers.AutoTokenizer.from_pretrained(path), model


@pytest.mark.equiv
def test_bundled_t5_writes_a_docstrings_first_sentence():
    stats, tok, model = _bundled("t5", "AutoModelForSeq2SeqLM")
    assert _t5_summaries(model, tok, list(stats["samples"])) == [v["summary"] for v in stats["samples"].values()]
    got = _t5_summaries(model, tok, ["summarize: " + doc for doc, _ in HELD_OUT_DOCSTRINGS])
    for (_, first), summary in zip(HELD_OUT_DOCSTRINGS, got):
        want = _words(first)
        shared = sum(w in _words(summary) for w in want) / len(want)
        assert shared >= 0.6 and len(_words(summary)) <= 2 * len(want), (first, summary)


def test_bundled_bert_fills_masks_with_sensible_words():
    stats, tok, model = _bundled("bert", "AutoModelForMaskedLM")

    def top5(texts: list[str]) -> list[list[str]]:
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            logits = model(**enc).logits  # (B, T, V)
        top = logits[enc["input_ids"] == tok.mask_token_id].topk(5, dim=-1).indices  # one mask per text: (B, 5)
        return [[tok.decode([t]) for t in row] for row in top.tolist()]

    assert top5(list(stats["samples"])) == list(stats["samples"].values())  # the card shows what the model says
    for (text, accepted), words in zip(FILL_MASK, top5([t for t, _ in FILL_MASK])):
        assert accepted & set(words), (text, words)


def test_missing_bundled_models_fall_back_to_random_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "_ASSETS", tmp_path / "no-assets")
    monkeypatch.setenv("HF_PIPELINE_CACHE", str(tmp_path / "cache"))
    path = default_model_path("bert")
    assert path == tmp_path / "cache" / "default-bert-v1"
    assert transformers.AutoTokenizer.from_pretrained(path).mask_token == "[MASK]"
    assert type(transformers.AutoModelForMaskedLM.from_pretrained(path)).__name__ == "BertForMaskedLM"
    with pytest.raises(ValueError, match="'llama', 't5', 'bert'"):
        default_model_path("gpt2")


@pytest.mark.dist
@pytest.mark.parametrize("arch", ["t5", "bert"])
def test_make_default_model_script_runs_at_tiny_size(arch, tmp_path):
    from harness import free_port

    out = tmp_path / "model"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "devtools.make_default_model", "--arch", arch,
           "--out", str(out), "--tiny", "--steps", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_PIPELINE_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stats = _card_stats(out)
    assert stats["steps"] == 3 and stats["world_size"] == 2
    assert stats["num_stages"] == 4 and stats["args"]["arch"] == arch
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.vocab_size == len(transformers.AutoTokenizer.from_pretrained(out))
    assert not (out / "rng").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
