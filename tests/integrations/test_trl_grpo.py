"""TRL's GRPOTrainer through ``PipelineTrainerMixin`` equals itself on one process.

``class PipelineGRPOTrainer(PipelineTrainerMixin, trl.GRPOTrainer)`` runs GRPO's own step: its completions come
from the pipelined ``generate``, its rewards and advantages from its own code with accelerate saying one process
(``integrations/one_process.py``), its loss from the log-probabilities of TRL's fused LM head computed from the
pipelined model's differentiable logits (``training/fused_head.py``, ``training/differentiable.py``).

Against ``GRPOTrainer`` on one process with the same arguments and seed, 3 optimizer steps of 2 accumulated batches,
on every rank: every logged value (loss, gradient norm, rewards, advantages' statistics, entropy, token counts, clip
ratios, KL) and every trained parameter at the end. Completions come from a deterministic ``rollout_func`` (prompt
groups of distinct completions, so the advantages and the gradient are not zero) for: the default loss (DAPO),
``loss_type="grpo"`` with ``scale_rewards="batch"`` and ``num_iterations=2`` (old log-probabilities from a forward),
``dr_grpo`` with ``steps_per_generation=4``, a LoRA adapter with ``beta=0.5`` (the reference is the model with its
adapter disabled), given wrapped or made by GRPOTrainer from ``peft_config=``, all at pp=2; the default at pp=2 x
dp=2 (one process with both replicas' rows) and pp=2 x tp=2. Greedy completions from the pipelined ``generate`` (no
rollout) give the first step's logs of one process, the same completions included; sampled ones (GRPO's defaults:
``generate`` draws what transformers draws from the global stream, every rank seeded as one process) give one
process's completions, logs and parameters.

Tolerances: SGD, so parameters move by lr x gradient (no Adam normalisation of round-off); TRL's fused head sums
its log-probabilities in tiles, ~1e-6 relative apart from a plain log-softmax; logged values within 1e-4 relative
(gradient norms: 2e-4), parameters within 1e-6. A gradient off by 2x, a duplicated process's rewards (their
standard deviation), a generation batch sized by the world's ranks (other prompts in step 2) or unsynchronised
random streams (other shuffles) move them by orders of magnitude more.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from harness import run_distributed

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.dist

LOG_RTOL, NORM_RTOL, PARAM_ATOL = 1e-4, 2e-4, 1e-6
STEPS = 3
LORA = {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0, "init_lora_weights": False}
CASES = {
    "dapo": {},
    "grpo": {"loss_type": "grpo", "scale_rewards": "batch", "num_iterations": 2},
    "dr_grpo": {"loss_type": "dr_grpo", "steps_per_generation": 4},
    "lora": {"beta": 0.5},
    "peft_config": {"beta": 0.5, "max_steps": 2},  # the adapter made by GRPOTrainer itself from peft_config=
    "greedy": {"max_steps": 1, "generation_kwargs": {"do_sample": False}},
    "sampled": {"max_steps": 2},  # GRPO's own sampling settings: one process's draws from the global stream
}
_TIMES = ("runtime", "per_second", "time")


def _tokenizer(path: str):
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def _dataset():
    return datasets.Dataset.from_dict({"prompt": [f"Return the value {i} of the" for i in range(16)]})


def rollout(prompts, trainer):
    """Distinct completions of 3-7 tokens per row, from the prompt's ids and the row's place."""
    ids = [trainer.processing_class(p)["input_ids"] for p in prompts]
    completions = [[(sum(p) * 7 + 13 * i + 31 * k) % 2000 + 3 for k in range(3 + (sum(p) + i) % 5)]
                   for i, p in enumerate(ids)]
    return {"prompt_ids": ids, "completion_ids": completions, "logprobs": None}


def reward(prompts, completions, completion_ids, **kwargs):
    return [float(sum(c) % 7) - 0.3 * len(c) for c in completion_ids]


def _args(out: pathlib.Path, case: str, batch: int):
    settings = dict(per_device_train_batch_size=batch, num_generations=2, max_completion_length=8, max_steps=STEPS,
                    gradient_accumulation_steps=2, optim="sgd", learning_rate=0.05, max_grad_norm=0.5, seed=3,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)
    return trl.GRPOConfig(str(out / case), **{**settings, **CASES[case]})


def _train(trainer_class, model, path: str, out: pathlib.Path, case: str, batch: int) -> dict:
    extra = {} if case in ("greedy", "sampled") else {"rollout_func": rollout}
    if case in ("lora", "peft_config"):
        import peft

        torch.manual_seed(5)
        if case == "lora":
            model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
        else:
            extra["peft_config"] = peft.LoraConfig(**LORA)
    trainer = trainer_class(model=model, reward_funcs=reward, args=_args(out, case, batch), train_dataset=_dataset(),
                            processing_class=_tokenizer(path), **extra)
    trainer.train()
    logs = [{k: v for k, v in e.items() if not any(t in k for t in _TIMES)} for e in trainer.state.log_history]
    completions = trainer._logs["completion"] if case in ("greedy", "sampled") else []
    adapter = case in ("lora", "peft_config")
    return {"logs": logs, "completions": list(completions), "params": _params(trainer.model, adapter)}


def _params(model, adapter: bool) -> dict[str, torch.Tensor]:
    import re

    from hf_pipeline.distributed.shards import full_tensor

    named = model.named_parameters()
    # stage parameter names are checkpoint keys inside ``stages.<i>.``; tensor-parallel shards gathered whole
    # (collective: the same order on every rank of a tensor-parallel group)
    return {re.sub(r"stages\.\d+\.", "", n): full_tensor(p.detach()).clone() for n, p in named
            if not adapter or "lora_" in n}


def _rank(path: str, out: str, cases: list[str], num_stages: int | None, tp_size: int = 1) -> dict:
    import hf_pipeline
    from hf_pipeline.integrations.trainer import PipelineTrainerMixin

    class PipelineGRPOTrainer(PipelineTrainerMixin, trl.GRPOTrainer):
        pass

    results = {}
    for case in cases:
        model = hf_pipeline.AutoModelForCausalLM.from_pretrained(path, pipeline=True, progress=False, n_microbatches=2,
                                                                 num_stages=num_stages, tp_size=tp_size)
        results[case] = _train(PipelineGRPOTrainer, model, path, pathlib.Path(out), case, 4)
    return results


def _reference(path: str, out: pathlib.Path, case: str, batch: int) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return _train(trl.GRPOTrainer, model, path, out, case, batch)


def _compare(what: str, got: dict, want: dict, floors: dict[str, float] | None = None) -> None:
    """Logged values within LOG_RTOL of ``max(|value|, floor)`` (gradient norms NORM_RTOL), parameters within
    PARAM_ATOL. ``floors``: the floor of the logged names starting with each key (others: 1e-2)."""
    assert len(got["logs"]) == len(want["logs"]) and got["completions"] == want["completions"], what
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"])):
        assert sorted(g) == sorted(w), f"{what} step {step}: logged {sorted(g)} != {sorted(w)}"
        for k, v in w.items():
            if isinstance(v, float):
                floor = next((f for prefix, f in (floors or {}).items() if k.startswith(prefix)), 1e-2)
                tol = (NORM_RTOL if k == "grad_norm" else LOG_RTOL) * max(abs(v), floor)
                assert abs(g[k] - v) <= tol, f"{what} step {step}: {k} {g[k]} != {v}"
    if what.startswith("greedy"):
        return  # greedy groups hold equal completions: their gradient is round-off, which SGD moves by lr x it
    assert got["params"] and set(got["params"]) <= set(want["params"]), what
    for n, p in got["params"].items():
        diff = (p - want["params"][n]).abs().max().item()
        assert diff <= PARAM_ATOL, f"{what}: {n} differs by {diff:.3g}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from hf_pipeline.tools.default_model import default_model_path

    source = default_model_path()
    config = transformers.AutoConfig.from_pretrained(source)
    config.initializer_range = 0.3  # peaked next-token distributions: log-probabilities far from uniform
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("grpo") / "model"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="1MB")
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return str(path)


def test_grpo_at_pp2_equals_trl_on_one_process(checkpoint, tmp_path):
    cases = list(CASES)
    per_rank = run_distributed(_rank, 2, checkpoint, str(tmp_path / "pipelined"), cases, None, timeout=900)
    for case in cases:
        want = _reference(checkpoint, tmp_path / "reference", case, 4)
        if case == "sampled":  # distinct samples in a group: advantages and the gradient are not zero
            assert len(set(want["completions"])) > len(want["completions"]) // 2, want["completions"]
        for r, result in enumerate(per_rank):
            _compare(f"{case} rank {r}", result[case], want)


def replicas_equal_one_process(rank_fn, reference_fn, checkpoint: str, tmp_path, case: str) -> None:
    """``case`` at pp=2 x dp=2 (4 ranks, 4 rows a replica) against one process with both replicas' 8 rows.

    ``rank_fn(path, out, cases, num_stages)`` trains on each rank, ``reference_fn(path, out, case, batch)`` on one
    process; each returns what :func:`_compare` reads."""
    per_rank = run_distributed(rank_fn, 4, checkpoint, str(tmp_path / "pipelined"), [case], 2, timeout=900)
    want = reference_fn(checkpoint, tmp_path / "reference", case, 8)
    for r, result in enumerate(per_rank):
        _compare(f"{case} rank {r} of 4", result[case], want)


def test_grpo_at_pp2_x_dp2_equals_trl_on_one_process_with_both_replicas_rows(checkpoint, tmp_path):
    replicas_equal_one_process(_rank, _reference, checkpoint, tmp_path, "dapo")


def test_grpo_at_pp2_x_tp2_equals_trl_on_one_process(checkpoint, tmp_path):
    per_rank = run_distributed(_rank, 4, checkpoint, str(tmp_path / "pipelined"), ["dapo"], 2, 2, timeout=900)
    want = _reference(checkpoint, tmp_path / "reference", "dapo", 4)
    for r, result in enumerate(per_rank):
        _compare(f"dapo rank {r} of pp2 x tp2", result["dapo"], want)
