"""LoRA on a model whose stages FSDP2 shards (``fsdp_size``): the adapter whole on every rank, beside the shards.

A stage loaded with ``fsdp_size`` is ``fully_shard``-ed block by block at load (``loading/fsdp.py``), so each
frozen base weight is a ``DTensor`` chunk that FSDP gathers for the forward. peft's injection then adds
``lora_A`` / ``lora_B`` inside modules FSDP already manages; FSDP2 does not take them into its parameter
groups (it fixes them at ``fully_shard``), so they stay plain tensors, the same whole ones on every fsdp rank
(the same seed: peft's initial values, ``peft_inject.py``). That is the layout kept, not a second
``fully_shard`` over the adapted blocks: torch's FSDP2 has no call to re-shard a module already sharded, and an
adapter is a few ``r x hidden`` matrices per projection, not worth sharding. What it asks of the rest:

* gradients: FSDP's reduce-scatter skips the adapter, so ``train_step`` sums its gradients over the
  data-parallel ranks of the pipeline slot (every fsdp rank, and under HSDP every replica's), as it sums plain
  replicas' (``training/flat_reduce.replicated_keys``). The forward reads the gathered base weight in the
  dtype FSDP gathers it in (no ``MixedPrecisionPolicy`` is set: the checkpoint's), and every microbatch loss
  is already divided by the global batch's item count, so the sum is the whole batch's gradient, what the
  sharded parameters' reduce-scatter (forced to a sum) gives them;
* clipping and AdamW: a whole tensor counts once in the global norm (``distributed/shards.norm_power``), and
  each rank steps the same summed gradient, so the copies stay equal;
* saving: every fsdp rank holds the whole adapter, so the first one's pipeline writes it (``peft_save.py``);
* merging (``merge_adapter``, ``merge_and_unload``): peft adds the whole delta ``B A * scaling`` to the base
  weight, here FSDP's sharded ``DTensor``; the delta is laid out as the weight first (this rank's chunk of rows,
  taken locally: ``peft_tensor_parallel.shard_adapters``), so the add updates FSDP's shard in place and the next
  gather reads the merged weight;
* replicas of fsdp-sharded pipelines (HSDP, ``dims.replicas > 1``, the weights on a ``("dp", "fsdp")`` mesh):
  peft would size a LoRA layer on such a mesh by the local shard (it takes any dim but ``"fsdp"`` for tensor
  parallelism); while it injects it is given the whole layer's features (``peft_tensor_parallel.whole_features``),
  and the gradients are summed over every replica's fsdp ranks, as above.

Refused here, at injection, on every rank (no communication):

* ``modules_to_save`` (peft's ``SEQ_CLS`` classifier): peft's trainable copy of a head module would be a copy
  of FSDP's ``DTensor`` shards that no FSDP unit gathers or reduces;
* an adapter on expert parameters (``target_parameters``) FSDP chunks (experts within a stage, ``ep_over=
  "stage"``): its delta would have to match FSDP's chunk of each expert. Experts over the fsdp ranks
  (``ep_over="data"``) are left out of FSDP, whole on their rank, and take one (``peft_experts.py``).

Example (every rank; ``torchrun --nproc_per_node 2``):
    >>> model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, num_stages=1, fsdp_size=2)
    >>> peft_model = peft.get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    >>> model.train_step(batch)      # lora_A / lora_B gradients summed over the 2 fsdp ranks
"""

from __future__ import annotations

from typing import Any

from ..core import PipelineCore
from ..errors import InputError

__all__ = ["refuse_under_fsdp"]


def refuse_under_fsdp(model: PipelineCore, config: Any) -> None:
    """Refuse what an adapter cannot do on a model loaded with ``fsdp_size`` (see the module docstring); nothing
    without FSDP. Every rank raises the same error, with no communication.

    Args:
        model: the pipelined model.
        config: the adapter's ``LoraConfig``.
    """
    fsdp = getattr(model.dims, "fsdp_size", 1)
    if fsdp == 1:
        return
    saved = list(getattr(config, "modules_to_save", None) or [])
    if saved:
        raise InputError(
            f"modules_to_save={saved} on a model loaded with fsdp_size={fsdp} is not supported: peft's trainable "
            "copies of those modules would be copies of FSDP's shards, which no FSDP unit gathers or reduces. "
            "Leave modules_to_save unset (a task_type other than SEQ_CLS), or load without fsdp_size"
        )
    if getattr(config, "lora_bias", False):  # merging would add peft's whole bias delta to FSDP's bias chunk
        raise InputError(
            f"LoraConfig(lora_bias=True) on a model loaded with fsdp_size={fsdp} is not supported: merging adds the "
            "adapter's bias to the base layer's bias, which FSDP shards; leave lora_bias unset, or load without "
            "fsdp_size"
        )
    ep = getattr(getattr(model, "options", None), "ep_size", 1)
    if ep > 1 and model.dims.ep_data == 1 and getattr(config, "target_parameters", None):
        raise InputError(
            f"a PEFT adapter on parameters ({sorted(config.target_parameters)}) of a model loaded with ep_size={ep} "
            f"within each stage and fsdp_size={fsdp} is not supported: FSDP chunks those experts further, and the "
            "adapter's delta is whole experts. Load with ep_over='data' (the experts over the fsdp ranks, left out "
            "of FSDP), or adapt no expert parameters"
        )
