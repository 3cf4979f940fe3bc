"""The device check's sections: env, checkpoint, load, reference, forward, generate, train.

One method of :class:`Sections` per section, each filling its figures and checks (the bounds and
why each holds are in :mod:`devtools.device_check`'s docstring; the model sizes and the tolerances
by dtype are in :mod:`~devtools.device_check.support`). :mod:`~devtools.device_check.run` runs them
in order under its time budget.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import math
import os
import pathlib
import platform
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import transformers

import hf_pipeline
from devtools.collectives import broadcast_object, gather_objects
from devtools.device_check.support import (
    GRAD_RTOL,
    HOST_SLACK_BYTES,
    LOGITS_RTOL,
    LOSS_RTOL,
    SIZES,
    WARMUP,
    check,
    empty_cache,
    first_divergences,
    left_padded,
    on_rank0,
    param_bytes,
    size_config,
    sync,
    timed,
)
from devtools.host_memory import host_peak_rss, host_rss, reset_host_peak, trim_host_heap

__all__ = ["Sections"]


# ----------------------------------------------------------------------------- sections
class Sections:
    """The sections, one method each: ``fn(figures, checks)`` fills the section's record in the JSON.

    Collectives are called by every rank in the same order; work only rank 0 does (the transformers
    reference and the comparisons) runs inside :func:`on_rank0`, which ends in a barrier even when
    it fails, so a failing reference never leaves the other ranks waiting.
    """

    def __init__(self, run: Any, ctx, args: argparse.Namespace):
        self.run, self.ctx, self.args = run, ctx, args
        self.device = ctx.device
        self.dtype = getattr(torch, args.dtype)
        self.size = SIZES[args.size]
        self.is_main = ctx.rank == 0
        # One process: all stages local (virtual stages); several: one stage per rank unless told.
        self.virtual = args.virtual_stages or (args.stages if ctx.world_size == 1 else 1)
        self.num_stages = args.stages if ctx.world_size == 1 else ctx.world_size * self.virtual
        self.microbatches = args.microbatches or self.num_stages
        self.batch = max(self.size.batch, self.microbatches) // self.microbatches * self.microbatches
        self.model = None
        self.ref = None
        self.tolerance: float | None = None
        run.result["config"] = {
            "size": args.size, "dtype": args.dtype, "device": str(self.device), "world_size": ctx.world_size,
            "backend": ctx.backend, "num_stages": self.num_stages, "virtual_stages": self.virtual,
            "schedule": args.schedule, "n_microbatches": self.microbatches, "batch": self.batch,
            "model": {k: v for k, v in vars(self.size).items()},
        }

    def _load_kwargs(self) -> dict[str, Any]:
        kw = dict(pipeline=True, device=str(self.device), dtype=self.dtype, num_stages=self.num_stages,
                  virtual_stages=self.virtual, n_microbatches=self.microbatches, progress=False)
        if self.args.schedule:
            kw["schedule"] = self.args.schedule
        return kw

    # -- env
    def env(self, fig: dict, checks: dict) -> None:
        fig.update(
            python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
            hf_pipeline=hf_pipeline.__version__, host=platform.node(), cpus=os.cpu_count(),
            world_size=self.ctx.world_size, backend=self.ctx.backend, device=str(self.device),
            cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
        )
        if torch.cuda.is_available():
            fig["gpus"] = [
                {"name": torch.cuda.get_device_name(i),
                 "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                for i in range(torch.cuda.device_count())
            ]
            fig["bf16_supported"] = torch.cuda.is_bf16_supported()
            with contextlib.suppress(Exception):
                v = torch.cuda.nccl.version()
                fig["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        self.run.log(f"torch {torch.__version__}, transformers {transformers.__version__}, "
                     f"{self.ctx.world_size} rank(s), device {self.device}, {fig.get('gpus', 'no GPU')}")

    # -- checkpoint
    def checkpoint(self, fig: dict, checks: dict) -> None:
        args = self.args
        mine = str(pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="device_check-"))) if self.is_main else None
        root = broadcast_object(mine)
        root = pathlib.Path(root)
        self.run.state["root"] = root
        errors: list[str] = []

        def write() -> dict:
            out = {}
            for name, size in (("warmup", WARMUP), ("model", self.size)):
                t = time.perf_counter()
                config = size_config(size, self.dtype)
                torch.manual_seed(args.seed)
                # Built on the device when there is one: random init of 1.5B parameters is instant there.
                with torch.device(self.device):
                    model = transformers.LlamaForCausalLM(config).to(self.dtype)
                model = model.to("cpu")  # saved from host memory, as any checkpoint is
                model.save_pretrained(root / name, max_shard_size=size.shard_bytes)
                n = sum(p.numel() for p in model.parameters())
                del model
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                shards = sorted(p.name for p in (root / name).glob("*.safetensors"))
                out[name] = {"params": n, "bytes": sum((root / name / s).stat().st_size for s in shards),
                             "shards": len(shards), "seconds": round(time.perf_counter() - t, 2)}
            return out

        written = on_rank0(errors, write)
        if self.is_main:
            fig.update(path=str(root / "model"), **written)
            model = written["model"]
            self.run.log(f"checkpoint: {model['params'] / 1e9:.3f}B params, {model['bytes'] / 2**30:.2f} GiB "
                         f"in {model['shards']} shards, {model['seconds']:.1f}s")
            check(checks, "shards", written["model"]["shards"], lo=2, why="a sharded checkpoint, as real ones are")

    # -- load
    def load(self, fig: dict, checks: dict) -> None:
        from hf_pipeline import AutoModelForCausalLM

        root = self.run.state["root"]
        dev = self.device
        # Warm-up on a tiny checkpoint of the same architecture: lazy imports, the CUDA context,
        # cuBLAS and the pinned bounce buffer belong to the process, not to loading.
        warm = AutoModelForCausalLM.from_pretrained(root / "warmup",
                                                    **{**self._load_kwargs(), "n_microbatches": self.num_stages})
        del warm
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            dev_base = torch.cuda.memory_allocated(dev)
        trim_host_heap()
        resettable = reset_host_peak()
        host_base = host_rss()
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(root / "model", **self._load_kwargs())
        sync(dev)
        seconds = time.perf_counter() - t
        host_peak = host_peak_rss() - host_base
        mine: dict[str, Any] = {"rank": self.ctx.rank, "device": str(model.device), "seconds": round(seconds, 3),
                                "host_peak_bytes": host_peak, "host_peak_resettable": resettable}
        if dev.type == "cuda":
            mine["device_bytes"] = torch.cuda.memory_allocated(dev) - dev_base
            mine["device_peak_bytes"] = torch.cuda.max_memory_allocated(dev) - dev_base
        mine["stages"] = [
            {"index": s.spec.index, "plan_bytes": s.spec.nbytes, "param_bytes": param_bytes(s.parameters()),
             "on_device": all(p.device == model.device for p in s.parameters())}
            for s in model.stages
        ]
        stage_bytes = sum(s.spec.nbytes for s in model.stages)
        mine.update(stage_bytes=stage_bytes,
                    param_bytes=param_bytes(p for _, p in model.checkpoint_named_parameters()),
                    bytes_read=model.load_report.bytes_read, files_opened=len(model.load_report.files_opened))
        self.model = model
        ranks = gather_objects(mine, who="device_check")
        if not self.is_main:
            return
        fig["plan"] = model.plan.to_dict()
        fig["ranks"] = ranks
        self.run.log(f"plan:\n{model.plan}")
        for r in ranks:
            if isinstance(r, dict):
                _check_rank_load(checks, r, self.run)

    # -- reference
    def reference(self, fig: dict, checks: dict) -> None:
        path = self.run.state["root"] / "model"
        errors: list[str] = []

        def load():
            t = time.perf_counter()
            ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
            sync(self.device)
            return ref, time.perf_counter() - t

        out = on_rank0(errors, load)
        if self.is_main:
            self.ref, seconds = out
            fig.update(seconds=round(seconds, 3), params=sum(p.numel() for p in self.ref.parameters()),
                       device=str(self.device))

    # -- forward
    def forward(self, fig: dict, checks: dict) -> None:
        size = self.size
        ids, mask = left_padded(self.batch, size.seq, size.vocab, seed=self.args.seed + 1)
        ids, mask = ids.to(self.device), mask.to(self.device)
        self.model.eval()
        out, seconds = timed(lambda: self.model(input_ids=ids, attention_mask=mask), self.device)
        errors: list[str] = []

        def compare(logits: torch.Tensor) -> None:
            real = mask.bool()  # (B, T): padded positions have no defined output to compare
            with torch.no_grad():
                ref = self.ref(input_ids=ids, attention_mask=mask).logits[real].float()  # (N, V)
            pp = logits[real].float()
            diff = (pp - ref).abs()
            scale = ref.abs().max().item()
            fig.update(pipelined_seconds=round(seconds, 4), logits_shape=list(logits.shape), max_abs_logit=scale,
                       max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
                       argmax_agreement=(pp.argmax(-1) == ref.argmax(-1)).float().mean().item())
            floor = LOGITS_RTOL[self.dtype] * max(1.0, scale)
            if self.dtype == torch.float32:
                tol = floor
                fig["tolerance_rule"] = "fp32: 1e-4 x max(1, largest |logit|); only the order of sums can differ"
            else:
                fig["tolerance_rule"] = (
                    "max(2 x transformers' own bf16 error against fp32 on these inputs, one bf16 step (2**-7) of the "
                    "largest |logit|): two results each within the rounding error of the exact one are within twice it"
                )
                # transformers' own rounding: the same weights in fp32 on the same inputs.
                ref32 = transformers.AutoModelForCausalLM.from_pretrained(
                    self.run.state["root"] / "model", dtype=torch.float32)
                ref32 = ref32.to(self.device).eval()
                with torch.no_grad():
                    exact = ref32(input_ids=ids, attention_mask=mask).logits[real].float()
                del ref32
                rounding = (ref - exact).abs().max().item()
                fig.update(reference_rounding_vs_fp32=rounding,
                           pipelined_rounding_vs_fp32=(pp - exact).abs().max().item())
                tol = max(2 * rounding, floor)
            fig["tolerance"] = tol
            self.tolerance = tol
            check(checks, "max_abs_logits_diff", fig["max_abs_diff"], hi=tol,
                   why="pipelined logits = transformers' (see the tolerance)")

        # The logits are bound now: `out` is released below, before the next section.
        on_rank0(errors, functools.partial(compare, out.logits))
        if self.is_main:
            self.run.log(f"forward: max |diff| {fig['max_abs_diff']:.3g} (tolerance {fig['tolerance']:.3g}, "
                         f"largest logit {fig['max_abs_logit']:.3g}), argmax agreement {fig['argmax_agreement']:.4f}")
        del out
        empty_cache(self.device)

    # -- generate
    def generate(self, fig: dict, checks: dict) -> None:
        size = self.size
        ids, mask = left_padded(self.batch, size.prompt_len, size.vocab, seed=self.args.seed + 2)
        ids, mask = ids.to(self.device), mask.to(self.device)
        gen = dict(do_sample=False, max_new_tokens=size.new_tokens, min_new_tokens=size.new_tokens, pad_token_id=0)
        self.model.eval()
        # Warm-up: kernels and caches of both shapes (prefill, one-token steps).
        self.model.generate(input_ids=ids, attention_mask=mask, **{**gen, "max_new_tokens": 2, "min_new_tokens": 2})
        times, pp_ids, stats = [], None, None
        for _ in range(size.reps):
            (pp_ids, stats), s = timed(
                lambda: self.model.generate(input_ids=ids, attention_mask=mask, return_stats=True, **gen), self.device)
            times.append(s)
        errors: list[str] = []

        def compare() -> None:
            ref = self.ref
            with torch.no_grad():
                ref.generate(input_ids=ids, attention_mask=mask, **{**gen, "max_new_tokens": 2, "min_new_tokens": 2})
                ref_times = []
                for _ in range(size.reps):
                    sync(self.device)
                    t = time.perf_counter()
                    ref.generate(input_ids=ids, attention_mask=mask, **gen)
                    sync(self.device)
                    ref_times.append(time.perf_counter() - t)
                scored = ref.generate(input_ids=ids, attention_mask=mask, output_logits=True,
                                      return_dict_in_generate=True, **gen)
            new = self.batch * size.new_tokens
            tol = self.tolerance
            if tol is None:  # the forward section did not run: one rounding step of the largest logit
                largest = max(step_logits.float().abs().max().item() for step_logits in scored.logits)
                tol = LOGITS_RTOL[self.dtype] * max(1.0, largest)
            div = first_divergences(pp_ids[:, ids.shape[1]:].cpu(), scored.sequences[:, ids.shape[1]:].cpu(),
                                    [step_logits.float().cpu() for step_logits in scored.logits])
            ties = [d for d in div if d["gap"] <= tol]
            fig.update(
                rows=self.batch, new_tokens_per_row=size.new_tokens, n_microbatches=stats.n_microbatches,
                pipelined_seconds=times, reference_seconds=ref_times,
                pipelined_tokens_per_s=new / statistics.median(times),
                reference_tokens_per_s=new / statistics.median(ref_times),
                peak_cache_bytes=stats.peak_cache_bytes, rows_equal=self.batch - len(div), divergences=div,
                tolerance=tol,
                tokens_equal=not div,
            )
            fig["speedup"] = fig["pipelined_tokens_per_s"] / fig["reference_tokens_per_s"]
            allowed = len(div) if self.dtype == torch.float32 else len(div) - len(ties)
            check(checks, "rows_differing_not_at_a_tie", allowed, hi=0,
                   why="greedy tokens = transformers'; in bf16 a row may part only at a tie within the logits "
                       "tolerance")
            check(checks, "pipelined_tokens_per_s", fig["pipelined_tokens_per_s"], lo=0, why="measured")

        on_rank0(errors, compare)
        if self.is_main:
            self.run.log(f"generate: {fig['rows_equal']}/{self.batch} rows equal ({len(fig['divergences'])} parted, "
                         f"gaps {[round(d['gap'], 4) for d in fig['divergences']]}); "
                         f"{fig['pipelined_tokens_per_s']:.1f} tokens/s pipelined, "
                         f"{fig['reference_tokens_per_s']:.1f} transformers ({fig['speedup']:.2f}x)")
        empty_cache(self.device)

    # -- train
    def train(self, fig: dict, checks: dict) -> None:
        size = self.size
        g = torch.Generator().manual_seed(self.args.seed + 3)
        ids = torch.randint(3, size.vocab, (self.batch, size.train_seq), generator=g).to(self.device)  # (B, T)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        model = self.model
        model.train()
        params = [p for _, p in model.checkpoint_named_parameters()]

        def clear() -> None:
            for p in params:
                p.grad = None

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        # The first step warms up and is the one compared; its gradients stay until the reference ran.
        loss, first = timed(lambda: model.train_step(batch), self.device)
        errors: list[str] = []
        mine: dict[str, Any] = {"rank": self.ctx.rank, "loss": float(loss), "first_step_seconds": first,
                                "param_bytes": param_bytes(params)}
        if self.device.type == "cuda":
            # Gradients (= param_bytes) plus the activations the step kept alive at its peak.
            mine["step_peak_above_weights_bytes"] = torch.cuda.max_memory_allocated(self.device) - before

        failure: Exception | None = None
        try:
            on_rank0(errors, lambda: self._train_reference(fig, batch, float(loss), len(params)))
        except RuntimeError as e:  # the pipelined timing below is still worth having; raised after it
            failure = e
        clear()
        times = []
        for _ in range(size.reps):
            _, s = timed(lambda: model.train_step(batch), self.device)
            times.append(s)
            clear()
        advice = breakdown = None
        if failure is None and model.plan.pp_size > 1:
            advice, breakdown = self._train_profile(batch, clear)
        model.eval()
        ranks = gather_objects(mine, who="device_check")
        if failure is not None:
            fig.update(ranks=ranks, pipelined_seconds=times)
            raise failure
        if not self.is_main:
            return
        tokens = ids.numel()
        fig.update(ranks=ranks, pipelined_seconds=times, tokens_per_step=tokens,
                   pipelined_tokens_per_s=tokens / statistics.median(times),
                   reference_tokens_per_s=tokens / statistics.median(fig["reference_seconds"]))
        fig["speedup"] = fig["pipelined_tokens_per_s"] / fig["reference_tokens_per_s"]
        self._train_report(fig, checks, advice, breakdown, len(params))
        empty_cache(self.device)

    def _train_reference(self, fig: dict, batch: dict, loss: float, n_params: int) -> None:
        """Rank 0: transformers' loss and gradients on the same batch against the pipeline's, and its step time."""
        model, ref = self.model, self.ref
        ref.train()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        diff2 = norm2 = 0.0
        for name, p in model.checkpoint_named_parameters():
            r = ref.get_parameter(name).grad
            gp = p.grad if p.grad is not None else torch.zeros_like(p)
            diff2 += (gp.float() - r.float()).pow(2).sum().item()
            norm2 += r.float().pow(2).sum().item()
        fig.update(loss=loss, reference_loss=ref_loss.item(), grad_rel_l2=math.sqrt(diff2 / max(norm2, 1e-30)),
                   grad_params_compared=n_params)
        ref.zero_grad(set_to_none=True)
        times = []
        for _ in range(self.size.reps):
            sync(self.device)
            t = time.perf_counter()
            ref(**batch).loss.backward()
            sync(self.device)
            times.append(time.perf_counter() - t)
            ref.zero_grad(set_to_none=True)
        ref.eval()
        fig["reference_seconds"] = times

    def _train_profile(self, batch: dict, clear: Callable[[], None]) -> tuple[Any, dict]:
        """(the measured split advice, one profiled step's breakdown): collective."""
        model = self.model
        # Each stage's device time per microbatch (the profiler settles the stream around each
        # action) and the split balanced on it: what the planner's FLOP model misses on this GPU.
        advice = model.measure_split(batch, steps=1)
        # One profiled step: each rank's compute, the step replayed with free messages, the step
        # as run. Their ratios are the schedule's own bubble and the time lost around the
        # messages (NCCL's latency and the hand-offs) on this machine.
        with model.profile() as prof:
            model.train_step(batch)
        clear()
        return advice, prof.timeline().breakdown()

    def _train_report(self, fig: dict, checks: dict, advice: Any, breakdown: dict | None, n_params: int) -> None:
        """Rank 0: the train section's figures, checks and log lines."""
        if advice is not None:
            fig["measured_split"] = advice.to_dict()
            self.run.log(str(advice))
        if breakdown is not None:
            fig["step_breakdown"] = breakdown
            self.run.log(f"train step: imbalance {breakdown['imbalance']:.3f}, schedule's bubble "
                         f"{breakdown['schedule']:.3f}, waits around messages {breakdown['waits']:.3f} "
                         f"(profiled step {breakdown['wall_seconds'] * 1e3:.1f} ms)")
        check(checks, "loss_rel_diff", abs(fig["loss"] - fig["reference_loss"]) / abs(fig["reference_loss"]),
               hi=LOSS_RTOL[self.dtype], why="the pipelined loss = transformers' mean loss of the batch")
        check(checks, "grad_rel_l2", fig["grad_rel_l2"], hi=GRAD_RTOL[self.dtype],
               why="rank 0's gradients = transformers'; bugs are off by 25%+, rounding by ~1%")
        self.run.log(f"train: loss {fig['loss']:.5f} vs {fig['reference_loss']:.5f}, grad rel L2 "
                     f"{fig['grad_rel_l2']:.3g} over {n_params} tensors; {fig['pipelined_tokens_per_s']:.0f} tokens/s "
                     f"pipelined, {fig['reference_tokens_per_s']:.0f} transformers ({fig['speedup']:.2f}x)")


def _check_rank_load(checks: dict, r: dict, run: Any) -> None:
    """The load section's checks of one rank's figures ``r`` (bytes per stage, device and host peaks)."""
    sb = max(1, r["stage_bytes"])
    tag = f"rank{r['rank']}"
    for s in r["stages"]:
        check(checks, f"{tag}.stage{s['index']}.param_bytes_per_plan_bytes",
               s["param_bytes"] / max(1, s["plan_bytes"]), lo=0.999, hi=1.001,
               why="each stage holds exactly the parameters the plan gave it")
        check(checks, f"{tag}.stage{s['index']}.on_device", float(s["on_device"]), lo=1,
               why="every parameter on the rank's device")
    check(checks, f"{tag}.bytes_read_per_stage_bytes", r["bytes_read"] / sb, lo=0.999, hi=1.001,
           why="reads its own tensors only, each once (stored dtype = load dtype)")
    if "device_bytes" in r:
        check(checks, f"{tag}.device_bytes_per_stage_bytes", r["device_bytes"] / sb, lo=0.99, hi=1.05,
               why="the stage's weights are what the load leaves on the GPU")
        check(checks, f"{tag}.device_peak_per_stage_bytes", r["device_peak_bytes"] / sb, hi=1.05,
               why="tensors are allocated once at their final place on the GPU: no second copy")
        if r["host_peak_resettable"]:
            bound = 0.1 + HOST_SLACK_BYTES / sb
            check(checks, f"{tag}.host_peak_per_stage_bytes", r["host_peak_bytes"] / sb, hi=bound,
                   why="straight to the GPU through a 16 MiB bounce buffer: host memory never holds the stage")
    elif r["host_peak_resettable"]:
        check(checks, f"{tag}.host_peak_per_stage_bytes", r["host_peak_bytes"] / sb, lo=0.5, hi=1.25,
               why="on CPU the weights live in host memory: about 1x, nothing held twice (under 0.5x: the meter "
                   "missed them)")
    device = ""
    if "device_bytes" in r:
        device = f", device {r['device_bytes'] / 2**20:.1f} MiB (peak {r['device_peak_bytes'] / 2**20:.1f})"
    run.log(
        f"{tag} on {r['device']}: stages {[s['index'] for s in r['stages']]}, {r['stage_bytes'] / 2**20:.1f} MiB; "
        f"host peak {r['host_peak_bytes'] / 2**20:.1f} MiB{device}; {r['seconds']:.2f}s"
    )


