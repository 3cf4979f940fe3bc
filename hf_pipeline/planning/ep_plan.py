"""Expert parallelism inside each stage: the plan that splits a mixture of experts' experts over the stage's ranks,
from transformers' own ``base_model_ep_plan``. A stage's expert-parallel ranks are the ranks that share its batch
(its tensor-parallel ranks), as in transformers when ``ep_size == tp_size``: every rank keeps ``num_experts /
ep_size`` whole experts (``"grouped_gemm"``: the experts' stacked parameters cut along the expert dim), the router
and the dense modules run on every rank, and an ``"ep_dispatch_experts"`` module brings its experts their tokens
through transformers' own implementation (``ep_implementation``: ``"all_to_all"`` exchanges the routed tokens,
``"all_reduce"`` runs each rank's experts on the shared batch and sums, ``"auto"`` picks the second at inference
and the first in training). With ``ep_over="data"`` (transformers' ``ep_size > tp_size``) the experts are split
over a stage's ranks in ``ep_size / tp_size`` replicas, whose batches differ: every exchange is all-to-all, and
every rank of an ep group must run the same MoE forwards in the same order. Forward and ``train_step`` do (every
replica runs the same microbatch count of the global batch); greedy, sampled and beam ``generate`` run every
replica's ring in lock step (``generation/ring.py``: finished rows padded until the replicas agree all are done, as
transformers' ``synced_gpus``); the continuous ring matches each op's forward count over the expert group
(``continuous_batching/ring_stage.py``).

Example:
    >>> ep_plan(mixtral_config, 2, model_class="MixtralForCausalLM")   # with fsdp_size too: FSDP over its slices
    (('layers.*.mlp.experts', 'ep_dispatch_experts'), ('layers.*.mlp.experts.down_proj', 'grouped_gemm'), ...)
"""

from __future__ import annotations

from ..errors import InputError

__all__ = [
    "EP_IMPLEMENTATIONS", "EP_STYLES", "ep_plan", "num_experts", "without_experts",
]

# The styles of transformers' ``base_model_ep_plan`` applied here: parameters cut by whole experts, and the
# experts module whose forward dispatches the tokens.
EP_STYLES = ("grouped_gemm", "ep_dispatch_experts")
# transformers' EPImplementationInterface names that run on any device ("deepgemm_megamoe" needs its CUDA kernel).
EP_IMPLEMENTATIONS = ("auto", "all_to_all", "all_reduce")
# Config fields counting the routed experts, by family (``num_local_experts`` is an alias in DeepSeek-V3).
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def num_experts(config) -> int | None:
    """The routed experts per MoE layer the config declares (None: not a mixture of experts)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _EXPERT_FIELDS:
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def ep_plan(
    config, ep_size: int, *, override=None, implementation: str = "auto", traced: bool = False,
    model_class: str | None = None,
) -> tuple[tuple[str, str], ...]:
    """``(pattern, style)`` pairs splitting a stage's experts over ``ep_size`` ranks (empty for 1).

    Patterns name modules or parameters of the base model, ``*`` standing for one block index, as
    transformers' ``base_model_ep_plan`` does; ``override`` (``DistributedConfig.ep_plan`` as pairs) updates
    its rules, as transformers merges it.

    Raises:
        InputError: naming the model class and the field: a model that is not a mixture of experts or has
            no expert-parallel plan, a style this version does not apply, an ``ep_size`` that does not divide
            the experts, an implementation that cannot run here, or a traced model (no module names).
    """
    if ep_size == 1:
        return ()
    name = model_class or getattr(config, "model_type", type(config).__name__)
    experts = num_experts(config)
    base = dict(getattr(config, "base_model_ep_plan", None) or {})
    plan = {**base, **dict(override or ())}
    if experts is None or not plan or traced:
        why = ("it is split by the tracer, which keeps no module names" if traced else
               "its config declares no experts" if experts is None else "its config has no base_model_ep_plan")
        raise InputError(
            f"{name} with ep_size={ep_size}: expert parallelism needs a mixture of experts with transformers' "
            f"base_model_ep_plan, and {why}; load it without ep_size, or pass "
            "DistributedConfig(ep_plan={'layers.*.mlp.experts': 'ep_dispatch_experts', ...})"
        )
    bad = {k: v for k, v in plan.items() if v not in EP_STYLES}
    if bad:
        raise InputError(
            f"{name}: ep_plan styles {bad} are not supported with pipeline=True; use {list(EP_STYLES)} (whole "
            "experts per rank, the tokens dispatched to them), or load without ep_size"
        )
    if "ep_dispatch_experts" not in plan.values():
        raise InputError(
            f"{name}: ep_plan {plan} cuts expert parameters but names no 'ep_dispatch_experts' module to bring "
            "them their tokens; add the experts module, e.g. 'layers.*.mlp.experts': 'ep_dispatch_experts'"
        )
    if experts % ep_size:
        raise InputError(
            f"{name}: ep_size={ep_size} does not divide the {experts} experts of each MoE layer (config."
            f"{next(f for f in _EXPERT_FIELDS if getattr(config, f, None) == experts)}); choose an ep_size that does"
        )
    if implementation not in EP_IMPLEMENTATIONS:
        raise InputError(
            f"{name}: ep_implementation={implementation!r} is not one pipeline=True runs; use one of "
            f"{list(EP_IMPLEMENTATIONS)}"
        )
    return tuple(sorted(plan.items()))


def without_experts(tp: tuple[tuple[str, str], ...], ep: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The tensor-parallel rules left once the expert-parallel ones take precedence (as in transformers: a
    module with an ep rule, and everything inside it, keeps no tp rule)."""
    experts = [k for k, _ in ep]
    return tuple((k, v) for k, v in tp if not any(k == e or k.startswith(e + ".") for e in experts))

