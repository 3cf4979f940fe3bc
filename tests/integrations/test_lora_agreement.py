"""Adapter loading and injection are agreed between ranks: a failure or a difference on one rank is one error on all.

Each case is loaded with ``PeftModel.from_pretrained`` on 2 ranks (LLaMA, 1F1B, two stages), a fresh
model per case:

* a one-process adapter whose layer-0 ``lora_A`` has a wrong shape (only the rank holding layer 0 reads it);
* the same in the last layer (only the last stage's rank reads it);
* a different adapter folder on each rank (same config and shapes, other values);
* a LoRA adapter with ``lora_bias=True`` on a model loaded with ``tp_size=2`` (refused by name; an adapter without it
  loads: tests/integrations/test_lora_tensor_parallel.py).

Every rank must raise the same library error naming the cause (``AdapterError``, or ``InputError`` for a
refusal), and the model must still run a forward after it, with the same logits on both ranks.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from harness import expect_errors, run_distributed

peft = pytest.importorskip("peft")


def _config(**kw):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM", **kw)


def _adapter(base_dir, out, seed, *, edit=None, **kw):
    """A one-process adapter with non-zero lora_B, saved in ``out`` (its tensors passed through ``edit``)."""
    from safetensors.torch import load_file, save_file

    base = tiny.reference(base_dir, "AutoModelForCausalLM")
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(base, _config(**kw))
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    adapted.save_pretrained(out)
    if edit is not None:
        path = out / "adapter_model.safetensors"
        save_file(edit(load_file(path)), path, metadata={"format": "pt"})
    return out


def _wrong_shape(tensors, layer="0"):
    key = next(k for k in tensors if f"layers.{layer}." in k and "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    return tensors


def _last_layer_wrong_shape(tensors):
    last = max(int(k.split("layers.")[1].split(".")[0]) for k in tensors if "layers." in k)
    return _wrong_shape(tensors, str(last))


def _load_case(dirs, case):
    import os

    import hf_pipeline

    rank = int(os.environ["RANK"])
    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(dirs["base"], pipeline=True, device="cpu",
                                                             schedule="1f1b", n_microbatches=2)
    folder = dirs[case] if case != "per_rank" else dirs[f"rank{rank}"]
    error = None
    try:
        peft.PeftModel.from_pretrained(model, folder)
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        error = e
    with torch.no_grad():
        logits = model(**tiny.sample_inputs("llama")).logits  # the model still runs: no hang, no mixed state
    if error is None:
        raise AssertionError(f"rank {rank}: loaded {case} without an error")
    raise RuntimeError(f"{type(error).__name__}|{error}|{logits.sum().item()!r}")


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agreement")
    base = tiny.make_checkpoint(tmp / "llama", "llama")
    return {
        "base": base,
        "wrong_shape": _adapter(base, tmp / "wrong_shape", 1, edit=_wrong_shape),
        "wrong_shape_last": _adapter(base, tmp / "wrong_shape_last", 1, edit=_last_layer_wrong_shape),
        "rank0": _adapter(base, tmp / "rank0", 1),
        "rank1": _adapter(base, tmp / "rank1", 2),
    }


@pytest.mark.dist
@pytest.mark.parametrize("case, kind, cause", [
    ("wrong_shape", "AdapterError", "size mismatch"),
    ("wrong_shape_last", "AdapterError", "size mismatch"),
    ("per_rank", "InputError", "adapter files"),
])
def test_adapter_load_is_one_error_on_every_rank(adapter_dirs, case, kind, cause):
    errors = expect_errors(_load_case, 2, adapter_dirs, case, timeout=300)
    seen = []
    for rank, error in enumerate(errors):
        assert isinstance(error, Exception), f"rank {rank}: {error!r}"
        assert str(error).count("|") >= 2, f"rank {rank}: {errors}"
        name, message, logits = str(error).split("|")[-3:]
        name = name.split(": ")[-1].strip()
        assert name == kind, f"rank {rank} raised {name}: {message}"
        assert cause in message, f"rank {rank}: {message}"
        assert "AssertionError" not in str(error), f"rank {rank}: {error}"
        seen.append(float(logits))
    assert seen[0] == seen[1], f"the ranks' logits differ after the failed load: {seen}"


def _tp_case(dirs):
    import hf_pipeline
    from hf_pipeline.errors import InputError

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(dirs["base"], pipeline=True, device="cpu", tp_size=2)
    refused = []
    try:
        peft.get_peft_model(model, _config(lora_bias=True))
    except InputError as e:
        refused.append(str(e))
    assert not any("lora_" in n for n, _ in model.named_parameters()), "a refused adapter changed the model"
    loaded = peft.PeftModel.from_pretrained(model, dirs["rank0"])  # what tensor parallelism takes: loads
    with torch.no_grad():
        logits = loaded(**tiny.sample_inputs("llama")).logits
    return refused, logits


@pytest.mark.dist
def test_lora_bias_under_tensor_parallelism_is_refused_by_name(adapter_dirs):
    results = run_distributed(_tp_case, 2, adapter_dirs, timeout=300)
    for rank, (refused, _) in enumerate(results):
        assert len(refused) == 1, f"rank {rank}: {refused}"
        assert all("lora_bias=True" in m and "tp_size=2" in m for m in refused), refused
    assert torch.equal(results[0][1], results[1][1])


def _config_case(dirs):
    import os

    import hf_pipeline
    from hf_pipeline.errors import InputError

    model = hf_pipeline.AutoModelForCausalLM.from_pretrained(dirs["base"], pipeline=True, device="cpu")
    try:
        peft.get_peft_model(model, peft.LoraConfig(r=4 + 4 * int(os.environ["RANK"]), target_modules=["q_proj"]))
    except InputError as e:
        message = str(e)
    else:
        raise AssertionError("a config differing between ranks was injected")
    assert not any("lora_" in n for n, _ in model.named_parameters()), "a refused adapter changed the model"
    with torch.no_grad():
        return message, model(**tiny.sample_inputs("llama")).logits


@pytest.mark.dist
def test_adapter_config_differing_between_ranks_is_refused_on_every_rank(adapter_dirs):
    results = run_distributed(_config_case, 2, adapter_dirs, timeout=300)
    for rank, (message, _) in enumerate(results):
        assert "config of adapter 'default'" in message and "r differs" in message, f"rank {rank}: {message}"
    assert torch.equal(results[0][1], results[1][1])
