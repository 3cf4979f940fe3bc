"""The decode ring's timetable alone (pure): every rank derives the same ticks from it, so its
invariants are what keeps the ring from deadlocking or reading a token before it exists."""

from __future__ import annotations

import pytest

from hf_pipeline.generation.microbatches import microbatch_bounds
from hf_pipeline.generation.timetable import Timetable


def _table(first: int, n_decode: int, m: int, steps: int, rows: int = 13) -> Timetable:
    return Timetable(
        first_decode=first, n_decode=n_decode, bounds=tuple(microbatch_bounds(rows, m)), prompt_len=7, max_new=steps
    )


def _ops(tt: Timetable, steps: int) -> dict[tuple[int, int, int], int]:
    """(stage, step, microbatch) -> tick, for every op up to ``steps`` steps."""
    ops: dict[tuple[int, int, int], int] = {}
    for stage in range(tt.first_decode, tt.first_decode + tt.n_decode):
        for tick in range(tt.tick_limit):
            at = tt.decode_at(stage, tick)
            if at is not None and at[0] < steps:
                assert (stage, *at) not in ops, f"stage {stage} runs {at} twice"
                ops[(stage, *at)] = tick
    return ops


@pytest.mark.parametrize("first,n_decode,m", [(0, 2, 4), (0, 3, 2), (0, 4, 4), (2, 2, 3), (1, 3, 8), (0, 1, 1)])
def test_every_op_once_in_dependency_order(first, n_decode, m):
    steps = 5
    tt = _table(first, n_decode, m, steps)
    ops = _ops(tt, steps)
    stages = range(first, first + n_decode)
    assert len(ops) == n_decode * m * steps, "some (stage, step, microbatch) never runs before the tick limit"
    for (s, t, i), tick in ops.items():
        # Hidden states come from the previous stage of the same step, one tick earlier.
        if s > first:
            assert ops[(s - 1, t, i)] < tick, f"stage {s} runs ({t}, {i}) before stage {s - 1} produced it"
        # The first stage's next token comes from the last stage's previous step.
        if s == first and t > 0:
            assert ops[(stages[-1], t - 1, i)] < tick, f"first stage runs step {t} of mb {i} before its token exists"
    # Per stage, ticks are distinct (one op per tick) and follow step-major order.
    for s in stages:
        mine = sorted((tick, t, i) for (st, t, i), tick in ops.items() if st == s)
        assert [x[1:] for x in mine] == sorted(x[1:] for x in mine)


def test_with_enough_microbatches_the_pipe_never_drains():
    # m >= stages: in the steady state every stage has an op at every tick (no bubble between tokens).
    tt = _table(0, 3, 4, 6)
    ops = _ops(tt, 6)
    for s in range(3):
        ticks = sorted(tick for (st, _, _), tick in ops.items() if st == s)
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), f"stage {s} idles between tokens"


def test_fewer_microbatches_than_stages_wait_for_the_token():
    # m=2 on 4 decode stages: a step takes max(m, stages) = 4 ticks, the token's round trip.
    tt = _table(0, 4, 2, 3)
    assert tt.period == 4
    assert tt.decode_at(0, 4) == (1, 0) and tt.decode_at(0, 2) is None


def test_message_shapes_and_encoder_ticks():
    tt = _table(0, 2, 3, 4, rows=13)
    assert [tt.rows(i) for i in range(3)] == [5, 4, 4]
    assert tt.message_positions(0) == 7 and tt.message_positions(1) == 1
    assert [tt.encode_at(1, tick) for tick in range(5)] == [None, 0, 1, 2, None]


@pytest.mark.parametrize("chunk,n_decode,m", [(3, 2, 2), (1, 3, 2), (2, 2, 4), (7, 2, 2), (50, 3, 3)])
def test_chunked_prefill_steps(chunk, n_decode, m):
    # A 7-token prompt in chunks of `chunk`: the chunks are the first steps, the last of them chooses
    # the first token; every op runs once before the tick limit, and only steps after the last chunk
    # wait for a token from the last stage.
    new = 4
    tt = Timetable(
        first_decode=0,
        n_decode=n_decode,
        bounds=tuple(microbatch_bounds(9, m)),
        prompt_len=7,
        max_new=new,
        prefill_chunk=chunk,
    )
    size = min(chunk, 7)
    assert tt.chunks == tuple((a, min(a + size, 7)) for a in range(0, 7, size))
    assert [b - a for a, b in tt.chunks] == [tt.message_positions(t) for t in range(len(tt.chunks))] and sum(
        tt.message_positions(t) for t in range(len(tt.chunks))
    ) == 7
    assert tt.first_token_step == len(tt.chunks) - 1 and tt.message_positions(len(tt.chunks)) == 1
    steps = tt.first_token_step + new
    ops = _ops(tt, steps)
    assert len(ops) == n_decode * m * steps, "some op never runs before the tick limit"
    last = n_decode - 1
    for (s, t, i), tick in ops.items():
        if s > 0:
            assert ops[(s - 1, t, i)] < tick
        if s == 0 and t > tt.first_token_step:
            assert ops[(last, t - 1, i)] < tick, "a decode step runs before its token exists"
    # The prefill fills the pipe: with m >= stages the first stage runs every chunk of every
    # microbatch back to back, ticks 0 .. chunks x m - 1.
    if m >= n_decode:
        assert sorted(tick for (s, t, _), tick in ops.items() if s == 0 and t <= tt.first_token_step) == list(
            range(len(tt.chunks) * m)
        )


def test_prefill_chunk_must_be_positive():
    with pytest.raises(ValueError, match="prefill_chunk"):
        Timetable(first_decode=0, n_decode=2, bounds=((0, 2),), prompt_len=7, max_new=2, prefill_chunk=0)


def _steady_period(tt: Timetable, rank_of: dict[int, int], steps: int, key=None) -> float:
    """Ticks between steps of microbatch 0 on the first stage once the ring is full, each rank running its ops in
    ``Timetable.ops_at`` order (or sorted by ``key``), every op taking one unit, messages free."""
    orders: dict[int, list] = {r: [] for r in set(rank_of.values())}
    for r in orders:
        mine = [s for s in rank_of if rank_of[s] == r]
        for tick in range(tt.tick_limit):
            ops = tt.ops_at(mine, tick)
            orders[r] += sorted(ops, key=key) if key else ops
    last = max(rank_of)
    done: dict[tuple[int, int, int], float] = {}
    free = dict.fromkeys(orders, 0.0)
    pending = {r: list(o) for r, o in orders.items()}
    while any(pending.values()):
        progressed = False
        for r, ops in pending.items():
            while ops:
                s, t, i = ops[0]
                need = (s - 1, t, i) if s > 0 else ((last, t - 1, i) if t > 0 else None)
                if need is not None and need not in done:
                    break
                start = max(free[r], done[need] if need else 0.0)
                done[(s, t, i)] = free[r] = start + 1
                ops.pop(0)
                progressed = True
        assert progressed, "the ranks' orders deadlock"
    return done[(0, steps - 1, 0)] - done[(0, steps - 2, 0)]


def test_v_layout_runs_each_microbatch_depth_first():
    # zbv's V on 2 ranks (rank 0: stages 0 and 3, rank 1: stages 1 and 2), one microbatch per rank: each step
    # takes exactly the 4 ops a rank runs per step. Stage order at a tie (rank 1 running stage 1 of
    # microbatch 1 before stage 2 of microbatch 0) would hold microbatch 0 back: 1.5x as long per step.
    tt = _table(0, 4, 2, 8)
    v = {0: 0, 1: 1, 2: 1, 3: 0}
    assert _steady_period(tt, v, 8) == 4
    assert _steady_period(tt, v, 8, key=lambda op: op[0]) == 6
    # A looped layout (rank 0: stages 0 and 2) has no ties at m=2; at one microbatch per stage, a rank runs 2 ops
    # per step per microbatch pair without stalls either way.
    loop = {0: 0, 1: 1, 2: 0, 3: 1}
    assert _steady_period(tt, loop, 8) == 4
    assert _steady_period(_table(0, 4, 4, 8), loop, 8) == 8
