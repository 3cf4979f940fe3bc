"""Schedules as data: every accepted name and class, the rule fields, and what they allow at run time.

Pure tests: each name torch's ``get_schedule_class`` accepts, each torch class (and a subclass) and
each of this package's names maps to the right torch class; the spec's rule fields drive the
load-time layout check and the training-time microbatch check (they agree with torch's own
constructors, and every fix a message names does run); bubble formulas equal the documented ones.

Multi-rank: with ``n_microbatches=2`` on 3 ranks (fewer microbatches than stages) forward logits and
greedy tokens equal transformers on one process, for one stage per rank (GPipe's forward) and for a
V layout (the in-order forward); ``train_step`` of a schedule that cannot train so raises on every
rank naming the fix and the model still works afterwards; interleaved 1F1B, which can, trains.
Training with torch's name or class equals training with this package's name.
"""

from __future__ import annotations

import re
import types

import pytest
import tiny
import torch
from harness import run_distributed
from torch.distributed import pipelining as pp
from torch.distributed.pipelining.schedules import get_schedule_class

from hf_pipeline.compat import Action, ComputationType
from hf_pipeline.planning.actions import fuse_backward
from hf_pipeline.planning.schedules import (
    SCHEDULES,
    ScheduleError,
    ScheduleSpec,
    check_layout,
    check_training,
    get_schedule,
)
from hf_pipeline.tools.profile import schedule_actions, theoretical_bubble

# fp32 logits of the tiny LLaMA are below 0.5 (one ulp 3e-8); sums of 32-64 terms over 4 layers keep another
# summation order's rounding near 1e-6; a wrong mask, cache or position moves them by 1e-2 or more.
# Measured (pipelined on 5 rows in 3 microbatches vs transformers, 1 and 2 threads): max diff 0, bitwise equal,
# under ATEN_CPU_CAPABILITY=default and =avx2 (and the native avx512).
TOL = 1e-5  # fp32 logits: the same kernels on the same inputs; only summation order may differ
# fp32 loss, relative: summation order ~1e-6; a wrong mask or label, or a dropped microbatch, moves it by 1e-2 or
# more.
LOSS_RTOL = 1e-5

# Every name torch 2.13's get_schedule_class maps to a runnable schedule.
TORCH_NAMES = ["1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
PACKAGE = {
    "gpipe": pp.ScheduleGPipe,
    "1f1b": pp.Schedule1F1B,
    "interleaved-1f1b": pp.ScheduleInterleaved1F1B,
    "looped-bfs": pp.ScheduleLoopedBFS,
    "interleaved-zero-bubble": pp.ScheduleInterleavedZeroBubble,
    "zbv-zero-bubble": pp.ScheduleZBVZeroBubble,
    "dualpipev": pp.ScheduleDualPipeV,
}
# The formulas README's schedule table and DESIGN.md document: p ranks, m microbatches, v per rank.
DOCUMENTED_BUBBLE = {
    "gpipe": lambda p, m, v: (p - 1) / (m + p - 1),
    "1f1b": lambda p, m, v: (p - 1) / (m + p - 1),
    "interleaved-1f1b": lambda p, m, v: (p - 1) / (v * m + p - 1),
    "looped-bfs": lambda p, m, v: (p - 1) / (v * m + p - 1),
    "interleaved-zero-bubble": lambda p, m, v: (p - 1) / (m + p - 1) / 3,
    "zbv-zero-bubble": lambda p, m, v: 0.0,
    "dualpipev": lambda p, m, v: 0.0,
}


def _settings(spec: ScheduleSpec):
    """(pp_size, virtual_stages, n_microbatches) combinations the spec's layout accepts."""
    for p in (1, 2, 3, 4):
        for v in (1, 2, 3):
            if spec.accepts_virtual(v):
                for m in range(1, 10):
                    yield p, v, m


def _rank(stage: int, p: int, layout: str) -> int:
    # looped: rank r owns r, r+p, ...; V: rank r owns r and 2p-1-r (README, "Schedules")
    wave, pos = divmod(stage, p)
    return pos if layout == "loop" or wave % 2 == 0 else p - 1 - pos


def _stand_ins(spec: ScheduleSpec, p: int, v: int):
    # The attributes torch's schedule constructors read from their stages (rank 0's stages).
    num_stages = p * v
    local = [
        types.SimpleNamespace(
            stage_index=i, num_stages=num_stages, group_size=p, group_rank=0,
            is_first=i == 0, is_last=i == num_stages - 1, submod=torch.nn.Module(),
        )
        for i in range(num_stages) if _rank(i, p, spec.layout) == 0
    ]
    return local if spec.multi else local[0]


# --------------------------------------------------------------------------- names and classes
def test_package_names_map_to_torch_classes():
    assert set(SCHEDULES) == set(PACKAGE)
    for name, cls in PACKAGE.items():
        for spelling in (name, name.upper(), name.replace("-", "_")):
            spec = get_schedule(spelling)
            assert spec.cls is cls and spec.name == name, spelling
    assert get_schedule("zbv").name == "zbv-zero-bubble" and get_schedule("interleaved").name == "interleaved-1f1b"


@pytest.mark.parametrize("name", TORCH_NAMES)
def test_torch_names_and_classes_map_to_the_same_torch_class(name):
    cls = get_schedule_class(name)
    for spelling in (name, name.lower(), name.upper(), cls.__name__, cls.__name__.lower()):
        spec = get_schedule(spelling)
        assert spec.cls is cls, f"{spelling!r} -> {spec.cls.__name__}, torch says {cls.__name__}"
        assert spec.name in PACKAGE and PACKAGE[spec.name] is cls
    assert get_schedule(cls) is get_schedule(name)
    assert get_schedule(get_schedule(name)) is get_schedule(name)
    assert get_schedule(name).torch_name == name


def test_a_subclass_of_a_torch_schedule_keeps_its_rules_and_runs_as_itself():
    class MyInterleaved(pp.ScheduleInterleaved1F1B):
        pass

    spec = get_schedule(MyInterleaved)
    base = get_schedule("interleaved-1f1b")
    assert spec.cls is MyInterleaved and spec.name == "interleaved-1f1b"
    assert {k: v for k, v in vars(spec).items() if k != "cls"} == {k: v for k, v in vars(base).items() if k != "cls"}


@pytest.mark.parametrize(
    "bad",
    [
        "2f2b",
        "PipelineScheduleSingle",
        "PipelineScheduleMulti",
        3,
        None,
        pp.schedules.PipelineScheduleMulti,
        torch.nn.Linear,
    ],
)
def test_unknown_schedules_list_what_is_accepted(bad):
    with pytest.raises(ScheduleError) as info:
        get_schedule(bad)
    message = str(info.value)
    assert message.startswith("unknown schedule"), message
    for name in list(PACKAGE) + TORCH_NAMES:
        assert repr(name) in message, f"{name!r} missing from: {message}"
    assert "torch.distributed.pipelining.Schedule" in message


# --------------------------------------------------------------------------- rules as fields
def test_layout_check_reads_the_virtual_stage_fields():
    for spec in SCHEDULES.values():
        for v in (1, 2, 3, 4):
            ok = v >= spec.min_virtual and (spec.max_virtual is None or v <= spec.max_virtual)
            if ok:
                # any n_microbatches >= 1: forward and generate need no more than the layout
                check_layout(spec, pp_size=3, virtual_stages=v, n_microbatches=1)
                continue
            with pytest.raises(
                ScheduleError, match=rf"schedule '{spec.name}' needs virtual_stages .* per rank, got {v}; use schedule="
            ) as info:
                check_layout(spec, pp_size=3, virtual_stages=v)
            for other in re.findall(r"'([a-z0-9-]+)'", str(info.value).split("use schedule=")[1]):
                check_layout(SCHEDULES[other], pp_size=3, virtual_stages=v)  # the named fix is a fix
    with pytest.raises(ScheduleError, match=r"n_microbatches must be an integer >= 1, got 0"):
        check_layout(SCHEDULES["gpipe"], pp_size=2, virtual_stages=1, n_microbatches=0)


def test_too_few_microbatches_names_the_fix():
    with pytest.raises(ScheduleError) as info:
        check_training(get_schedule("1f1b"), pp_size=3, virtual_stages=1, n_microbatches=2)
    message = str(info.value)
    assert "needs n_microbatches >= the number of stages (3) to train, got 2" in message, message
    assert "n_microbatches=3" in message and "schedule='gpipe'" in message, message
    with pytest.raises(
        ScheduleError,
        match=r"multiple of the number of rounds \(2 = n_microbatches // pp_size\).*n_microbatches=6 or 4",
    ):
        check_training(get_schedule("Interleaved1F1B"), pp_size=2, virtual_stages=2, n_microbatches=5)
    with pytest.raises(ScheduleError, match=r"'zbv-zero-bubble' needs n_microbatches >= the number of stages \(6\)"):
        check_training(get_schedule("ZBVZeroBubble"), pp_size=3, virtual_stages=2, n_microbatches=2)
    # what needs no refusal is not refused: interleaved 1F1B trains 2 microbatches over 6 stages
    check_training(get_schedule("interleaved-1f1b"), pp_size=3, virtual_stages=2, n_microbatches=2)
    check_training(get_schedule("gpipe"), pp_size=4, virtual_stages=1, n_microbatches=1)


def test_every_fix_a_training_error_names_trains():
    for spec in SCHEDULES.values():
        for p, v, m in _settings(spec):
            try:
                check_training(spec, pp_size=p, virtual_stages=v, n_microbatches=m)
            except ScheduleError as e:
                message = str(e)
            else:
                continue
            counts = re.search(r"n_microbatches=([\d or]+)", message)
            assert counts, message
            for count in map(int, counts.group(1).split(" or ")):
                check_training(spec, pp_size=p, virtual_stages=v, n_microbatches=count)
            for other in (
                re.findall(r"'([a-z0-9-]+)'", message.split("with schedule=")[1].split(", which")[0])
                if "with schedule=" in message
                else ()
            ):
                check_training(SCHEDULES[other], pp_size=p, virtual_stages=v, n_microbatches=m)


def test_training_rules_agree_with_torchs_constructors():
    # torch refuses -> the spec's rules refuse first (before any communication); a combination the
    # rules accept is one torch builds its action lists for.
    for spec in SCHEDULES.values():
        for p, v, m in _settings(spec):
            if p * v < 2:
                continue
            try:
                spec.cls(_stand_ins(spec, p, v), n_microbatches=m, loss_fn=lambda out, target: out)
                torch_ok = True
            except ValueError:
                torch_ok = False
            ours = spec.training_problem(pp_size=p, virtual_stages=v, n_microbatches=m) is None
            assert torch_ok or not ours, f"{spec.name} p={p} v={v} m={m}: torch refuses, the rules accept"


def test_bubble_formulas_equal_the_documented_formulas():
    for name, formula in DOCUMENTED_BUBBLE.items():
        spec = SCHEDULES[name]
        for p, v, m in _settings(spec):
            want = formula(p, m, v) if p > 1 else 0.0
            got = spec.theoretical_bubble(pp_size=p, n_microbatches=m, virtual_stages=v)
            # two float64 evaluations of one formula on small integers: rounding only (default 1e-6 relative);
            # a wrong term moves a bubble fraction by 1e-2 or more.
            assert got == pytest.approx(want), (name, p, v, m)
            assert theoretical_bubble(name, pp_size=p, n_microbatches=m, virtual_stages=v) == pytest.approx(want)
    assert SCHEDULES["1f1b"].bubble_formula == "(p-1)/(m+p-1)"
    assert SCHEDULES["interleaved-1f1b"].bubble_formula == "(p-1)/(v*m+p-1)"
    assert theoretical_bubble(pp.ScheduleGPipe, pp_size=4, n_microbatches=4) == pytest.approx(3 / 7)


def test_forward_only_actions_follow_the_layout():
    # What a forward-only call runs: GPipe's forwards with one stage per rank, looped BFS's forwards
    # for looped stages (torch's own action list), stage order for a V layout.
    looped = schedule_actions("looped-bfs", pp_size=3, n_microbatches=2, virtual_stages=2)
    for spec in SCHEDULES.values():
        v = spec.default_virtual_stages()
        got = schedule_actions(spec, pp_size=3, n_microbatches=2, virtual_stages=v, training=False)
        if not spec.multi:
            assert got == {r: [f"{r}F0", f"{r}F1"] for r in range(3)}, spec.name
        elif spec.layout == "loop":
            assert got == {r: [a for a in looped[r] if "F" in a] for r in range(3)}, spec.name
        else:
            assert got == {r: [f"{s}F{i}" for s in (r, 5 - r) for i in range(2)] for r in range(3)}, spec.name
        assert (spec.forward_as or spec.name) in SCHEDULES


def _torch_order(spec, p: int, m: int) -> dict[int, list]:
    """torch's own pipeline_order for a multi-stage schedule (stand-in stages, no process group)."""
    from hf_pipeline.planning.schedules import rank_of_stage

    n = p * 2

    def stand_in(i):
        return types.SimpleNamespace(
            stage_index=i,
            num_stages=n,
            group_size=p,
            group_rank=0,
            is_first=i == 0,
            is_last=i == n - 1,
            submod=torch.nn.Module(),
        )

    local = [stand_in(i) for i in range(n) if rank_of_stage(i, p, spec.layout) == 0]
    return spec.cls(local, n_microbatches=m, loss_fn=lambda out, target: out).pipeline_order


@pytest.mark.parametrize("name", [s.name for s in SCHEDULES.values() if s.zero_bubble])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 6), (4, 8)])
def test_fused_backward_merges_only_pairs_no_other_rank_waits_for(name, p, m):
    # Each merged B stands where torch listed I(s, i) directly followed by W(s, i), and only where
    # the input gradient stays on this rank (first stage, or stage s-1 on the same rank); every
    # other action is torch's, in torch's order.
    from hf_pipeline.planning.schedules import rank_of_stage

    spec = SCHEDULES[name]
    if spec.training_problem(pp_size=p, virtual_stages=2, n_microbatches=m) is not None:
        pytest.skip(f"{name} does not train p={p} m={m}")
    where = lambda s: rank_of_stage(s, p, spec.layout)  # noqa: E731
    torch_order = _torch_order(spec, p, m)
    fused = fuse_backward(torch_order, where)
    merged_somewhere = False
    for r, acts in torch_order.items():
        acts = [a for a in acts if a is not None]
        want, k = [], 0
        while k < len(acts):
            a = acts[k]
            pair = (
                k + 1 < len(acts)
                and str(a).endswith(f"I{a.microbatch_index}")
                and str(acts[k + 1]) == f"{a.stage_index}W{a.microbatch_index}"
            )
            if pair and (a.stage_index == 0 or where(a.stage_index - 1) == r):
                want.append(f"{a.stage_index}B{a.microbatch_index}")
                merged_somewhere = True
                k += 2
            else:
                want.append(str(a))
                k += 1
        assert [str(a) for a in fused[r]] == want, (name, p, m, r)
        for a in fused[r]:  # a remote consumer's gradient is never held back behind a weight pass
            if (
                str(a) == f"{a.stage_index}I{a.microbatch_index}"
                and a.stage_index > 0
                and where(a.stage_index - 1) != r
            ):
                assert f"{a.stage_index}B{a.microbatch_index}" not in want
    if name == "zbv-zero-bubble":
        assert merged_somewhere  # stage 0's pairs at least (nothing to send)
        assert all(f"0B{i}" in [str(a) for a in fused[0]] for i in range(m))


def test_fused_backward_keeps_a_pair_whose_gradient_another_rank_waits_for():
    A, C = ComputationType, Action
    order = {
        0: [
            C(1, A.BACKWARD_INPUT, 0),
            C(1, A.BACKWARD_WEIGHT, 0),
            C(0, A.BACKWARD_INPUT, 0),
            None,
            C(0, A.BACKWARD_WEIGHT, 0),
        ],
        1: [
            C(2, A.BACKWARD_INPUT, 0),
            C(2, A.BACKWARD_WEIGHT, 0),
            C(3, A.BACKWARD_INPUT, 1),
            C(3, A.BACKWARD_WEIGHT, 0),
        ],
    }
    on = {0: 0, 1: 0, 2: 1, 3: 1}
    got = {r: [str(a) for a in acts] for r, acts in fuse_backward(order, on.__getitem__).items()}
    # stage 1 -> 0 on rank 0: merged; stage 0 (no consumer), across a bubble: merged;
    # stage 2 -> 1 on rank 0: kept split; 3I1 then 3W0: different microbatches, kept
    assert got == {0: ["1B0", "0B0"], 1: ["2I0", "2W0", "3I1", "3W0"]}


# --------------------------------------------------------------------------- on 3 ranks, m < stages
def _ids(rows: int, seq: int, seed: int = 1) -> dict[str, torch.Tensor]:
    inputs = tiny.sample_inputs("llama", batch=rows, seq=seq, seed=seed)
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}


def _few_microbatches_job(path: str):
    """On every rank: n_microbatches=2 over 3 ranks with three schedules."""
    from hf_pipeline import AutoModelForCausalLM

    out = {}
    for name, v in (("1f1b", 1), ("zbv-zero-bubble", 2), ("interleaved-1f1b", 2)):
        model = AutoModelForCausalLM.from_pretrained(
            path, pipeline=True, device="cpu", schedule=name, virtual_stages=v, n_microbatches=2
        )
        res = {"stages": model.plan.num_stages, "logits": model(**_ids(4, 9)).logits}
        res["greedy"] = model.generate(**_ids(4, 5), max_new_tokens=4, do_sample=False)
        batch = {**_ids(4, 9), "labels": _ids(4, 9)["input_ids"].clone()}
        try:
            res["loss"] = model.train_step(batch).item()
        except Exception as e:  # noqa: BLE001 - compared in the parent
            res["error"] = f"{type(e).__name__}: {e}"
            res["after"] = model(**_ids(4, 9)).logits  # the failed step left the pipeline usable
        out[name] = res
    return out


@pytest.mark.dist
def test_fewer_microbatches_than_stages_forward_and_generate_run_training_names_the_fix(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    per_rank = run_distributed(_few_microbatches_job, 3, str(path), timeout=400)
    ref = tiny.reference(path, "AutoModelForCausalLM")
    with torch.no_grad():
        logits = ref(**_ids(4, 9)).logits
        ref_loss = ref(**_ids(4, 9), labels=_ids(4, 9)["input_ids"]).loss.item()
    greedy = ref.generate(**_ids(4, 5), max_new_tokens=4, do_sample=False)
    for rank, out in enumerate(per_rank):
        for name, res in out.items():
            where = f"rank {rank} {name} ({res['stages']} stages, 2 microbatches)"
            assert res["stages"] > 2, where
            diff = (res["logits"] - logits).abs().max().item()
            assert diff <= TOL, f"{where}: logits max abs diff {diff}"
            assert torch.equal(res["greedy"], greedy), f"{where}: greedy tokens differ"
        for name in ("1f1b", "zbv-zero-bubble"):
            res, where = out[name], f"rank {rank} {name}"
            assert res.get("error", "").startswith("ScheduleError"), f"{where}: {res.get('error', res.get('loss'))}"
            assert f"needs n_microbatches >= the number of stages ({res['stages']}) to train, got 2" in res["error"], (
                where
            )
            assert f"n_microbatches={res['stages']}" in res["error"] and "schedule='" in res["error"], (
                f"{where}: {res['error']}"
            )
            assert (res["after"] - logits).abs().max().item() <= TOL, f"{where}: forward after the error"
        loss = out["interleaved-1f1b"].get("loss")
        assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL), (
            f"rank {rank} interleaved-1f1b: {out['interleaved-1f1b'].get('error', loss)}"
        )


# --------------------------------------------------------------------------- torch's names train alike
def _named_schedules_job(path: str):
    """On every rank: one training step + SGD step per way of naming interleaved 1F1B."""
    from hf_pipeline import AutoModelForCausalLM

    out = {}
    for label, schedule in (
        ("package", "interleaved-1f1b"),
        ("torch name", "Interleaved1F1B"),
        ("torch class", pp.ScheduleInterleaved1F1B),
    ):
        model = AutoModelForCausalLM.from_pretrained(
            path, pipeline=True, device="cpu", schedule=schedule, virtual_stages=2, n_microbatches=4
        )
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        batch = {**_ids(4, 9), "labels": _ids(4, 9)["input_ids"].clone()}
        loss = model.train_step(batch).item()
        opt.step()
        opt.zero_grad()
        out[label] = {
            "spec": (model.schedule.name, model.schedule.cls.__name__, model.plan.virtual_stages),
            "loss": loss,
            "params": {n: p.detach().clone() for st in model.stages for n, p in st.named_parameters()},
        }
    return out


@pytest.mark.dist
def test_torch_schedule_names_train_like_the_package_name(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    per_rank = run_distributed(_named_schedules_job, 2, str(path), timeout=300)
    for rank, out in enumerate(per_rank):
        want = out["package"]
        assert want["spec"] == ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2)
        assert want["params"], f"rank {rank}: no parameters"
        for label in ("torch name", "torch class"):
            got = out[label]
            assert got["spec"] == want["spec"], (rank, label)
            assert got["loss"] == want["loss"], f"rank {rank} {label}: loss {got['loss']} vs {want['loss']}"
            assert got["params"].keys() == want["params"].keys(), (rank, label)
            for name, p in want["params"].items():
                assert torch.equal(got["params"][name], p), (
                    f"rank {rank} {label}: {name} differs after the optimizer step"
                )
