"""LoRA section, measuring side: per-rank peak memory of a LoRA training step against a full fine-tune.

The train section's model on its ranks (1F1B), loaded twice in one launch: once trained in full
(AdamW over every parameter), once with a LoRA adapter from ``peft.get_peft_model`` (AdamW over the
adapter only). For each, per rank: the RSS the loaded model adds, the peak RSS of a few
``train_step`` + ``optimizer.step`` above it (gradients, optimizer state, activations), and the
trainable parameters and optimizer state this rank holds.
"""

from __future__ import annotations

import gc
import os

from benchmarks.config import Sizes
from benchmarks.meters import PeakMeter
from benchmarks.timing import batch
from devtools.host_memory import trim_host_heap

__all__ = ["LORA_TARGETS", "TASKS", "launches"]

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_RANK = 8
STEPS = 2


def lora_memory(task: dict, out: dict) -> None:
    """One mode (``task["mode"]``: "full" or "lora"): load, (adapt,) train ``STEPS`` steps, measure."""
    import torch

    from hf_pipeline import AutoModelForCausalLM

    sizes = task["sizes"]
    # Both modes run in one process: what the first freed goes back to the OS before the second is
    # measured, or the second would reuse it unseen (glibc keeps freed heap).
    trim_host_heap()
    with PeakMeter() as loading:
        model = AutoModelForCausalLM.from_pretrained(
            task["path"], pipeline=True, device="cpu", progress=False, schedule="1f1b",
            n_microbatches=sizes["n_microbatches"],
        )
        if task["mode"] == "lora":
            import peft

            config = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                                     target_modules=LORA_TARGETS)
            peft.get_peft_model(model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    data = batch(sizes)
    with PeakMeter() as training:
        for _ in range(STEPS):
            model.train_step(data)
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep the gradient buffers: their memory is part of a step
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    out.update(
        rank=int(os.environ.get("RANK", "0")), mode=task["mode"], model_bytes=loading.peak, step_peak=training.peak,
        resettable=training.resettable, trainable=sum(p.numel() for p in params),
        local_params=sum(p.numel() for p in model.parameters()), optimizer_bytes=state,
    )
    del model, opt, params
    gc.collect()
    trim_host_heap()


TASKS = {"lora_memory": lora_memory}


def launches(sizes: Sizes, ckpts: dict[str, str]) -> dict[int, list[dict]]:
    """The LoRA section's tasks: on the train section's ranks, the full fine-tune, then LoRA."""
    from dataclasses import asdict

    sz = asdict(sizes)
    return {sizes.world: [
        {"task": "lora_memory", "label": f"lora {mode}", "path": ckpts["train"], "sizes": sz, "mode": mode}
        for mode in ("full", "lora")
    ]}
