"""PipelineTrainer against transformers.Trainer on one process, with the same arguments and seed.

Every run: LR warm-up, gradient accumulation 2, ``max_grad_norm`` (small enough to clip), logging
every step, evaluation and a checkpoint every 2 steps, 4 optimizer steps. The pipelined run logs
the same losses, gradient norms and learning rates, evaluates the same loss (and metrics), ends
with every parameter equal by name, and a run resumed from its step-2 checkpoint ends where the
uninterrupted one did. A data-parallel job (pp x dp) trains on ``per_device_train_batch_size x
dp`` rows per batch, so its reference is one process with that batch.

Tolerances: a step moves parameters by about the learning rate (1e-2); 2e-5 is the fp32 noise
of summing the same gradients in another order (measured: under 1e-6), far below one step, so a
wrong accumulation scale, a missed clip or replicas training the same rows fail.
"""

from __future__ import annotations

import functools
import pathlib

import datasets
import numpy as np
import pytest
import tiny
import torch
import transformers
from harness import run_distributed

TOL = 2e-5
STEPS = 4
BATCH = 4  # per pipeline replica
FAMILIES = {
    # family -> (tiny arch, Auto class, config overrides); BERT without dropout (its masks depend on RNG order)
    "llama": ("llama", "AutoModelForCausalLM", {}),
    "bert": ("bert", "AutoModelForSequenceClassification", {"hidden_dropout_prob": 0.0,
                                                            "attention_probs_dropout_prob": 0.0}),
}
_RUNTIME = ("runtime", "per_second")  # timings differ between runs


def _dataset(family: str, rows: int = 40) -> datasets.Dataset:
    ids = tiny.sample_inputs("llama", batch=rows, seq=9, seed=3, pad_left=False)
    columns = {"input_ids": ids["input_ids"].tolist(), "attention_mask": ids["attention_mask"].tolist(),
               "note": [f"row {i}" for i in range(rows)]}  # a column no model takes: removed as transformers does
    if family == "llama":
        columns["labels"] = ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100).tolist()
    else:
        columns["label"] = (ids["input_ids"][:, 0] % 2).tolist()
    return datasets.Dataset.from_dict(columns)


def _accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


def _args(out, batch: int, **overrides) -> transformers.TrainingArguments:
    settings = dict(
        per_device_train_batch_size=batch, per_device_eval_batch_size=batch, gradient_accumulation_steps=2,
        learning_rate=1e-2, warmup_steps=2, max_grad_norm=0.5, logging_steps=1, max_steps=STEPS, save_steps=2,
        eval_strategy="steps", eval_steps=2, seed=7, data_seed=11, report_to=[], use_cpu=True, disable_tqdm=True,
        include_num_input_tokens_seen="non_padding",  # logged: counted once, not once per rank
    )
    return transformers.TrainingArguments(str(out), **{**settings, **overrides})


def _kwargs(family: str) -> dict:
    data = _dataset(family)
    extra = {"compute_metrics": _accuracy} if family == "bert" else {}
    return {"train_dataset": data, "eval_dataset": data.select(range(12)), **extra}


def _logs(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if not any(r in k for r in _RUNTIME)} for e in history]


# --------------------------------------------------------------------------------------------
# Each rank
# --------------------------------------------------------------------------------------------
def _train_rank(paths: dict[str, str], out: str, num_stages: int) -> dict:
    import hf_pipeline
    from hf_pipeline.errors import UsageError

    results = {}
    for family, path in paths.items():
        auto = getattr(hf_pipeline, FAMILIES[family][1])
        model = auto.from_pretrained(path, pipeline=True, n_microbatches=2, num_stages=num_stages)
        root = pathlib.Path(out) / family
        try:  # refused on every rank before anything runs; the model stays usable
            hf_pipeline.PipelineTrainer(model=model, args=_args(root / "bad", 3), **_kwargs(family))
            refused = None
        except UsageError as e:
            refused = str(e)
        trainer = hf_pipeline.PipelineTrainer(model=model, args=_args(root / "run", BATCH), **_kwargs(family))
        trainer.train()
        logs = _logs(trainer.state.log_history)
        final = trainer.evaluate()
        predicted = trainer.predict(_kwargs(family)["eval_dataset"]).predictions
        params = {n: p.detach().clone() for n, p in model.checkpoint_named_parameters()}
        checkpoint = root / "run" / "checkpoint-2"
        files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())

        fresh = auto.from_pretrained(path, pipeline=True, n_microbatches=2, num_stages=num_stages)
        resumed = hf_pipeline.PipelineTrainer(model=fresh, args=_args(root / "resumed", BATCH), **_kwargs(family))
        resumed.train(resume_from_checkpoint=str(checkpoint))
        results[family] = {
            "refused": refused, "logs": logs, "eval": _logs([final])[0],
            "predicted": torch.as_tensor(predicted), "params": params, "files": files,
            "resumed_logs": _logs(resumed.state.log_history), "global_step": resumed.state.global_step,
            "resumed": {n: p.detach().clone() for n, p in fresh.checkpoint_named_parameters()},
        }
    return results


# --------------------------------------------------------------------------------------------
# The reference: transformers.Trainer on one process
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _reference(path: str, family: str, batch: int, out: str) -> dict:
    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(path, dtype=torch.float32)
    trainer = transformers.Trainer(model=model, args=_args(out, batch), **_kwargs(family))
    trainer.train()
    logs = _logs(trainer.state.log_history)
    final = trainer.evaluate()
    return {
        "logs": logs, "eval": _logs([final])[0],
        "predicted": torch.as_tensor(trainer.predict(_kwargs(family)["eval_dataset"]).predictions),
        "params": {n: p.detach().clone() for n, p in model.state_dict(keep_vars=True).items()},
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("trainer")
    return {
        family: str(tiny.make_checkpoint(root / family, arch, auto=auto, **overrides))
        for family, (arch, auto, overrides) in FAMILIES.items()
    }


def _assert_logs_equal(got: list[dict], want: list[dict], what: str) -> None:
    assert [sorted(e) for e in got] == [sorted(e) for e in want], what
    for i, (g, w) in enumerate(zip(got, want)):
        for key, value in w.items():
            assert g[key] == pytest.approx(value, rel=TOL, abs=TOL), f"{what}: entry {i} {key}: {g[key]} != {value}"


def _assert_params_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) <= set(want) and len(got) > 0, f"{what}: names {sorted(set(got) - set(want))[:3]}"
    for name, p in got.items():
        torch.testing.assert_close(p, want[name], atol=TOL, rtol=TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def _check(results: list[dict], checkpoints: dict[str, str], dp: int, tmp_path) -> None:
    for family in checkpoints:
        ref = _reference(checkpoints[family], family, BATCH * dp, str(tmp_path / f"ref-{family}"))
        whole = set(ref["params"])
        seen: set[str] = set()
        for rank, by_family in enumerate(results):
            got, what = by_family[family], f"{family} rank {rank}"
            assert "per_device_train_batch_size=3" in got["refused"] and "n_microbatches=2" in got["refused"], what
            # Every rank's TrainerState is the same, and equal to transformers' on one process.
            assert got["logs"] == results[0][family]["logs"], what
            _assert_logs_equal(got["logs"], ref["logs"], what)
            _assert_logs_equal([got["eval"]], [ref["eval"]], what + " evaluate()")
            torch.testing.assert_close(got["predicted"], ref["predicted"], atol=TOL, rtol=TOL)
            _assert_params_equal(got["params"], ref["params"], what)
            # Resumed from checkpoint-2: the same end, and the same history (steps 1-2 read from the checkpoint).
            _assert_params_equal(got["resumed"], got["params"], what + " resumed")
            assert got["global_step"] == STEPS, what
            steps = [e for e in got["resumed_logs"] if "loss" in e or "eval_loss" in e]
            _assert_logs_equal(steps, [e for e in ref["logs"] if "loss" in e or "eval_loss" in e], what + " resumed")
            seen |= set(got["params"])
            # Trainer's layout, data-only state: no pickle of transformers' Trainer is written.
            files = got["files"]
            assert "trainer_state.json" in files and "scheduler.json" in files and "config.json" in files, files
            assert sum(f.startswith("rng/") for f in files) == len(results), files
            assert not any(f.endswith((".pth", ".bin")) or f in ("optimizer.pt", "scheduler.pt") for f in files)
        assert seen == whole, f"{family}: parameters no rank holds: {sorted(whole - seen)[:3]}"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "world, num_stages, dp, families",
    [(2, 2, 1, ("llama", "bert")), (3, 3, 1, ("llama",)), (4, 2, 2, ("llama", "bert"))],
    ids=["pp2", "pp3", "pp2xdp2"],
)
def test_trainer_equals_transformers_trainer(checkpoints, tmp_path, world, num_stages, dp, families):
    paths = {family: checkpoints[family] for family in families}
    results = run_distributed(_train_rank, world, paths, str(tmp_path / "runs"), num_stages, timeout=600)
    _check(results, paths, dp, tmp_path)
