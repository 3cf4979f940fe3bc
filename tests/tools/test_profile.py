"""Per-action timelines: recorded actions follow the schedule's action list; PNG and Chrome trace are written."""

import json
import re

import pytest
import tiny
import torch
from harness import run_distributed

from hf_pipeline.runtime.cache import signature
from hf_pipeline.tools.profile import ActionRecord, Timeline, schedule_actions, theoretical_bubble

# pytest.approx's default (1e-6 relative) compares float64 arithmetic on exact timelines and fractions:
# rounding only; a wrong formula or a miscounted action moves a figure by 1e-2 or more.
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zero-bubble", 2), ("zbv-zero-bubble", 2)]


def _profile_training(path, out_dir):
    """On every rank: for each schedule, one warm-up and one profiled training step of torch's schedule."""
    from hf_pipeline import AutoModelForCausalLM

    results = {}
    inputs = tiny.sample_inputs("llama", batch=8, seq=8, pad_left=False)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    for name, v in SCHEDULES:
        model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu", schedule=name,
                                                     virtual_stages=v, n_microbatches=4)
        prepared = model.prepare_inputs(dict(inputs))
        # The training runtime train_step drives: torch's schedule with a loss on the last stage.
        _, schedule = model.runtime.get(signature(prepared), training=True,
                                        loss_fn=lambda out, target: out.float().pow(2).mean())
        for stage in model.stages:
            stage.train()
        target = torch.zeros(8)
        schedule.step(**prepared, target=target)  # warm-up: shape inference and buffers
        with model.profile() as prof:
            schedule.step(**prepared, target=target)
        timeline = prof.timeline(title=name)
        png = trace = None
        if model.ctx.rank == 0:
            png = str(timeline.save_png(f"{out_dir}/{name}.png"))
            trace = str(timeline.save_chrome_trace(f"{out_dir}/{name}.json"))
        results[name] = {
            "actions": {r: timeline.actions(r) for r in timeline.ranks}, "idle": timeline.idle_fraction(),
            "records": [(r.rank, r.stage, r.microbatch, r.kind, r.start, r.end) for r in timeline.records],
            "steps": timeline.steps, "png": png, "trace": trace, "theory": timeline.theoretical_idle_fraction(),
            "local": [s.spec.index for s in model.stages],
            "replayed": timeline.replayed_seconds(), "busy": [timeline.busy_seconds(r) for r in timeline.ranks],
            "wall": [timeline.wall_seconds(r) for r in timeline.ranks],
        }
        if name == "interleaved-1f1b":
            # forward only (inference) of a looped model: the forward actions of looped BFS
            with model.profile() as prof:
                model(**inputs)
            fwd = prof.timeline()
            results["forward"] = {"actions": {r: fwd.actions(r) for r in range(2)}, "schedule": fwd.schedule}
    return results


@pytest.mark.dist
def test_recorded_actions_follow_the_schedule(tmp_path):
    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    results = run_distributed(_profile_training, 2, str(path), str(tmp_path), timeout=300)
    # the same timeline everywhere
    assert all(results[1][n]["actions"] == results[0][n]["actions"] for n, _ in SCHEDULES)
    for name, v in SCHEDULES:
        res = results[0][name]
        expected = schedule_actions(name, pp_size=2, n_microbatches=4, virtual_stages=v)
        for rank in (0, 1):
            assert res["actions"][rank] == expected[rank], (
                f"{name} rank {rank}: recorded {res['actions'][rank]} vs schedule {expected[rank]}"
            )
            kinds = {a.lstrip("0123456789")[0] for a in expected[rank]}
            # zero-bubble: split backward, merged into B where no other rank waits (actions.fuse_backward)
            if "zero-bubble" in name:
                assert {"F", "I", "W"} <= kinds <= {"F", "B", "I", "W"}, name
            else:
                assert kinds == {"F", "B"}, name
            # every recorded action belongs to a stage of that rank
            stages = {r[1] for r in res["records"] if r[0] == rank and r[1] is not None}
            assert stages == set(results[rank][name]["local"])
            assert 0.0 <= res["idle"][rank] < 1.0
            start, end = res["steps"][rank][0]
            assert all(start <= r[4] <= r[5] <= end for r in res["records"] if r[0] == rank)
        # the replay with free messages: at least the busiest rank's compute, at most the step as run
        assert max(res["busy"]) <= res["replayed"] <= max(res["wall"]) + 1e-6
        assert res["replayed"] == results[1][name]["replayed"]
        assert res["theory"] == pytest.approx(theoretical_bubble(name, pp_size=2, n_microbatches=4, virtual_stages=v))
        with open(res["png"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        trace = json.loads(open(res["trace"]).read())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") != "step"]
        assert len(spans) == len(res["records"])
        assert {e["pid"] for e in spans} == {0, 1}
        assert all(e["dur"] >= 0 and "microbatch" in e["args"] for e in spans)
        assert sorted(e["name"] for e in spans if e["cat"] in ("F", "B", "I", "W")) == sorted(expected[0] + expected[1])
    fwd = results[0]["forward"]
    assert fwd["schedule"] == "looped-bfs"
    assert fwd["actions"] == schedule_actions("looped-bfs", pp_size=2, n_microbatches=4, virtual_stages=2,
                                              training=False)


def test_schedule_actions_single_stage_orders():
    # 1F1B on 2 ranks, 4 microbatches: rank 0 warms up with 2 forwards, the last rank alternates from the start
    acts = schedule_actions("1f1b", pp_size=2, n_microbatches=4)
    assert acts[0] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert acts[1] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]
    assert schedule_actions("gpipe", pp_size=2, n_microbatches=2)[1] == ["1F0", "1F1", "1B0", "1B1"]
    zbv = schedule_actions("zbv", pp_size=2, n_microbatches=4, virtual_stages=2)
    # stage 0 has no input gradient to send: its I + W pairs run as one backward; stage 3's stay split
    want = [f"{s}F{m}" for s in (0, 3) for m in range(4)] + [f"0B{m}" for m in range(4)]
    want += [f"3{k}{m}" for k in "IW" for m in range(4)]
    assert sorted(zbv[0]) == sorted(want)


def test_theoretical_bubbles():
    assert theoretical_bubble("1f1b", pp_size=2, n_microbatches=8) == pytest.approx(1 / 9)
    assert theoretical_bubble("gpipe", pp_size=4, n_microbatches=4) == pytest.approx(3 / 7)
    interleaved = {"pp_size": 2, "n_microbatches": 8, "virtual_stages": 2}
    assert theoretical_bubble("interleaved-1f1b", **interleaved) == pytest.approx(1 / 17)
    assert theoretical_bubble("interleaved-zero-bubble", **interleaved) == pytest.approx(1 / 27)
    assert theoretical_bubble("zbv", pp_size=2, n_microbatches=8, virtual_stages=2) == 0.0


def _rec(rank, stage, mb, kind, start, end):
    return ActionRecord(rank=rank, stage=stage, microbatch=mb, kind=kind, start=start, end=end, step=0)


def test_idle_fraction_and_outputs_from_records(tmp_path):
    # rank 0 busy 0-1 and 2-3 of a 4 s step (idle 50%); rank 1 busy 1-2.5 with an overlapping loss and a wait
    records = [
        _rec(0, 0, 0, "F", 0.0, 1.0), _rec(0, 0, 1, "F", 2.0, 3.0), _rec(0, None, None, "recv_wait", 3.0, 4.0),
        _rec(1, 1, 0, "F", 1.0, 2.0), _rec(1, 1, 0, "loss", 1.5, 2.5),
    ]
    tl = Timeline(records=records, steps={0: [(0.0, 4.0)], 1: [(0.5, 4.5)]}, pp_size=2, schedule="gpipe",
                  n_microbatches=2)
    idle = tl.idle_fraction()
    assert idle[0] == pytest.approx(0.5) and idle[1] == pytest.approx(1 - 1.5 / 4)
    assert tl.actions(0) == ["0F0", "0F1"] and tl.actions(1) == ["1F0"]
    assert tl.theoretical_idle_fraction() == pytest.approx(1 / 3)
    trace = tl.chrome_trace()
    x = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") != "step"]
    assert [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in x][:2] == [(0, 0, 0.0, 1e6), (0, 0, 2e6, 1e6)]
    assert x[2]["tid"] == -1 and x[2]["cat"] == "recv_wait"
    png = tl.save_png(tmp_path / "t.png")
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("name,v",
                         [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("zbv-zero-bubble", 2),
                          ("interleaved-zero-bubble", 2)])
def test_replay_is_the_schedule_with_free_messages(name, v):
    # Records of a step whose actions take unequal times and start late (each waits 0.7 s for a
    # message): the replay drops the waits and keeps what the order needs, which is the planner's
    # simulation of the same schedule with the same costs.
    from hf_pipeline.planning.simulate import ACTION_WEIGHTS, simulate_step

    p, m = 2, 4
    cost = [1.0, 1.6, 0.8, 1.3][: p * v]
    orders = schedule_actions(name, pp_size=p, n_microbatches=m, virtual_stages=v)
    last = p * v - 1
    records = []
    for rank, acts in orders.items():
        t = 0.0
        for a in acts:
            s, k, i = re.fullmatch(r"(\d+)([FBIW])(\d+)", a).groups()
            t += 0.7
            records.append(_rec(rank, int(s), int(i), k, t, t + ACTION_WEIGHTS[k] * cost[int(s)]))
            t = records[-1].end
            if k == "F" and int(s) == last:  # the loss, right after the last stage's forward
                records.append(_rec(rank, int(s), int(i), "loss", t, t))
    wall = max(r.end for r in records)
    tl = Timeline(records=records, steps={r: [(0.0, wall)] for r in orders}, pp_size=p, schedule=name,
                  virtual_stages=v, n_microbatches=m)
    expected, busy = simulate_step(name, pp_size=p, virtual_stages=v, n_microbatches=m, stage_cost=cost)
    assert tl.replayed_seconds() == pytest.approx(expected)
    assert max(busy.values()) <= expected < wall
    if name == "gpipe":  # rank 1 cannot start before stage 0's first forward, nor finish before stage 0's last backward
        assert expected >= max(busy.values()) + cost[0]
    # a message's latency, added where an action waits for another rank's: GPipe on 2 ranks has one
    # cross-rank hop before rank 1's first forward and one before rank 0's first backward on its critical path
    with_latency = tl.replayed_seconds(latency=0.25)
    assert expected < with_latency <= expected + 0.25 * 2 * m * p * v
    if name == "gpipe":
        assert with_latency == pytest.approx(expected + 2 * 0.25)
    # the breakdown: its factors multiply up to the wall time over the busiest rank's compute
    bd = tl.breakdown(latency=0.25)
    most = max(busy.values())
    assert bd["busy_seconds"] == pytest.approx([busy[r] for r in sorted(busy)]) and bd["wall_seconds"] == wall
    assert bd["imbalance"] == pytest.approx(most * p / sum(busy.values()))
    assert bd["schedule"] == pytest.approx(expected / most) and bd["waits"] == pytest.approx(wall / expected)
    assert bd["messages"] == pytest.approx(with_latency / expected)
    assert bd["runtime"] == pytest.approx(wall / with_latency)
    assert bd["schedule"] * bd["messages"] * bd["runtime"] == pytest.approx(bd["bubble"])
    assert bd["bubble"] == pytest.approx(wall / most)
    assert "messages" not in tl.breakdown()


def test_replay_refuses_an_order_that_deadlocks():
    # rank 0 runs its backward before the forward rank 1 needs first: no order of the two ranks works
    records = [_rec(0, 0, 0, "B", 0.0, 1.0), _rec(0, 0, 0, "F", 1.0, 2.0), _rec(1, 1, 0, "F", 2.0, 3.0),
               _rec(1, 1, 0, "B", 3.0, 4.0)]
    tl = Timeline(records=records, steps={0: [(0.0, 4.0)], 1: [(0.0, 4.0)]}, pp_size=2)
    with pytest.raises(ValueError, match="cannot be replayed"):
        tl.replayed_seconds()
    # a decode loop: the same stage's forward of the same microbatch once per token
    loop = Timeline(records=[_rec(0, 0, 0, "F", 0.0, 1.0), _rec(0, 0, 0, "F", 1.0, 2.0)], steps={0: []}, pp_size=1)
    with pytest.raises(ValueError, match="repeats an action"):
        loop.replayed_seconds()


def test_world_size_1_records_every_stage_call(tmp_path):
    from hf_pipeline import AutoModelForCausalLM

    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu")
    inputs = tiny.sample_inputs("llama", batch=2, seq=5)
    with model.profile() as prof:
        model(**inputs)
    tl = prof.timeline()
    assert tl.actions(0) == ["0F"] and tl.schedule is None and tl.steps == {0: []}
    assert 0.0 <= tl.idle_fraction()[0] < 1.0
    with model.profile():
        with pytest.raises(RuntimeError, match="already active"):
            model.profile().__enter__()


def test_recorded_actions_wait_for_their_device_before_each_timestamp(tmp_path, monkeypatch):
    # On CUDA a host timestamp after queuing kernels says nothing of the device: every recorded action
    # settles its stage's device before it starts and before it ends. Checked on CPU through the hook,
    # and the hook itself against a stand-in CUDA stream.
    from hf_pipeline import AutoModelForCausalLM
    from hf_pipeline.tools import profile

    path = tiny.make_checkpoint(tmp_path / "llama", "llama")
    model = AutoModelForCausalLM.from_pretrained(path, pipeline=True, device="cpu")
    calls = []
    original = profile._settle
    monkeypatch.setattr(profile, "_settle", lambda device: calls.append(device) or original(device))
    with model.profile() as prof:
        model(**tiny.sample_inputs("llama", batch=2, seq=5))
    assert len(prof.records) == 1 and calls == [torch.device("cpu")] * 2

    synced = []

    class Stream:
        def synchronize(self):
            synced.append(True)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream())
    original(torch.device("cuda", 0))
    original(torch.device("cpu"))
    original(None)
    assert synced == [True]
