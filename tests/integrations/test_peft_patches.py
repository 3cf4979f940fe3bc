"""peft's methods are replaced only while a pipelined model is alive, and are peft's own again after.

Run in a fresh process: other tests' pipelined models (alive until collected) would keep the
replacements in place in the test process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import tiny

pytest.importorskip("peft")


@pytest.mark.dist
def test_peft_methods_are_peft_own_before_the_first_and_after_the_last_pipelined_model(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    code = f"""
import gc, importlib, peft, torch, transformers, hf_pipeline
from peft.tuners.lora.layer import ParamWrapper
from peft.tuners.tuners_utils import BaseTuner
from hf_pipeline.compat import PEFT_PATCHED_METHODS
from hf_pipeline.integrations import peft_patches

owners = {{"inject_adapter": BaseTuner, "save_pretrained": peft.PeftModel, "load_adapter": peft.PeftModel,
          "get_delta_factors": ParamWrapper, "get_delta_weight": ParamWrapper, "_activate_lora": ParamWrapper}}
own = {{name: owner.__dict__[name] for name, owner in owners.items()}}
def current():
    return {{name: owner.__dict__[name] for name, owner in owners.items()}}
assert {{name for *_, name, _ in PEFT_PATCHED_METHODS}} == set(own)
assert all(getattr(importlib.import_module(m), c) is owners[n] for m, c, n, _ in PEFT_PATCHED_METHODS)
assert current() == own and not peft_patches.installed()
model = hf_pipeline.AutoModelForCausalLM.from_pretrained({str(path)!r}, pipeline=True, device="cpu")
assert peft_patches.installed() and all(current()[n] is not own[n] for n in own)
adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
assert model.adapter_state is not None  # this package's injection
plain = transformers.AutoModelForCausalLM.from_pretrained({str(path)!r})
plain_adapted = peft.get_peft_model(plain, peft.LoraConfig(r=2, target_modules=["q_proj"]))
assert sum("lora_A" in n for n, _ in plain_adapted.named_parameters()) == 4  # peft's own, by local names
del model, adapted
gc.collect()
assert current() == own and not peft_patches.installed(), current()
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok", proc.stdout
