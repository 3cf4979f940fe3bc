"""The continuous ring's messages alone (pure, no ranks): the op header packs to the exact int64 layout
every stage reads (a change of layout fails here, not in a 3-rank run), parses back to itself, and
refuses what is not a header; the joining rows' JSON round-trips; the reply's float64 layout is exact and
unpacks to each row's token and log-probabilities; the ring's sends are freed in order past their window."""

from __future__ import annotations

import json

import pytest
import torch

from hf_pipeline.continuous_batching.wire import NewRow, OpHeader, Reply, ReplyRow, pack_rows, unpack_rows
from hf_pipeline.errors import InternalError
from hf_pipeline.generation.logprobs import entries
from hf_pipeline.generation.mailbox import Mailbox

pytestmark = pytest.mark.unit


def test_header_layout_is_fixed():
    # [run, rows kept, rows joining, JSON bytes, kept slots..., joining slots..., -1 up to group_size]
    header = OpHeader(run=True, kept=(6, 4), joining=(5,), payload_bytes=97)
    packed = header.pack(group_size=4)
    assert packed.dtype == torch.long and packed.tolist() == [1, 2, 1, 97, 6, 4, 5, -1]
    assert header.slots == (6, 4, 5)
    assert OpHeader.stop().pack(group_size=3).tolist() == [0, 0, 0, 0, -1, -1, -1]
    assert OpHeader(run=True).pack(group_size=2).tolist() == [1, 0, 0, 0, -1, -1]  # a run op with no rows
    assert OpHeader(run=True, kept=(0, 1)).pack(group_size=2).tolist() == [1, 2, 0, 0, 0, 1]
    # The fixed message's size, known before the op is planned (the receive is posted ahead).
    assert OpHeader.nbytes(4) == packed.numel() * packed.element_size() == 64


@pytest.mark.parametrize("header", [
    OpHeader.stop(),
    OpHeader(run=True),
    OpHeader(run=True, kept=(3, 1, 2)),
    OpHeader(run=True, joining=(0, 2), payload_bytes=210),
    OpHeader(run=True, kept=(7,), joining=(4, 5, 6), payload_bytes=1),
])
def test_header_round_trip(header):
    for group_size in (len(header.slots), len(header.slots) + 3):
        packed = header.pack(group_size)
        assert packed.shape == (OpHeader.FIELDS + group_size,)
        assert OpHeader.unpack(packed) == header
        # As a stage receives it: bytes of one uint8 message, viewed back as int64.
        wire = torch.cat([packed.view(torch.uint8), torch.zeros(8, dtype=torch.uint8)])
        assert OpHeader.unpack(wire[: OpHeader.nbytes(group_size)].view(torch.long)) == header


def test_header_refuses_what_is_not_one():
    with pytest.raises(InternalError, match="stop"):
        OpHeader(run=False, kept=(1,))
    with pytest.raises(InternalError, match="JSON"):
        OpHeader(run=True, joining=(1,))
    with pytest.raises(InternalError, match="JSON"):
        OpHeader(run=True, payload_bytes=5)
    with pytest.raises(InternalError, match="do not fit"):
        OpHeader(run=True, kept=(0, 1, 2)).pack(group_size=2)
    for values in ([2, 0, 0, 0, -1], [1, 2, 0, 0, 5, -1], [1, 1, 0, 0, 5, 6], [1, 0]):
        with pytest.raises(InternalError, match="header"):
            OpHeader.unpack(torch.tensor(values))


def test_joining_rows_round_trip_as_json():
    rows = [NewRow(slot=2, prompt=[5, 6, 7], max_new_tokens=4),
            NewRow(slot=3, prompt=[9], max_new_tokens=8, temperature=0.9, top_p=0.95, seed=7, index=1)]
    payload = pack_rows(rows)
    assert payload.dtype == torch.uint8
    assert json.loads(bytes(payload.tolist())) == [r.__dict__ for r in rows]
    assert unpack_rows(payload) == rows
    with pytest.raises(InternalError, match="prompt"):
        NewRow(slot=0, prompt=[], max_new_tokens=1)


def test_reply_layout_and_round_trip():
    # Rows without log-probabilities are their tokens alone, in row order; an op without rows is one float.
    plain = Reply((ReplyRow(), ReplyRow(), ReplyRow()))
    assert plain.pack([7, 0, 11], [None] * 3, [None] * 3).tolist() == [7.0, 0.0, 11.0]
    assert Reply(()).pack([], [], []).tolist() == [0.0]
    # Mixed: a plain row, one with its token's entry (k=1), one joining with its prompt's entries (k=2), a plain one.
    logprobs = torch.log_softmax(torch.tensor([[0.1, 2.0, -1.0, 0.5]] * 3), dim=-1)  # (3, V=4)
    chosen = entries(logprobs[:1], torch.tensor([1]), 1)  # (1, 3)
    prompt = entries(logprobs[1:], torch.tensor([3, 0]), 2)  # (prompt_len - 1 = 2, 5)
    layout = Reply((ReplyRow(), ReplyRow(logprobs=1), ReplyRow(prompt_logprobs=2, prompt_len=3), ReplyRow()))
    message = layout.pack([4, 1, 2, 9], [None, chosen[0], None, None], [None, None, prompt, None])
    # [4] [1, its entry (3)] [2, its prompt's entries (2 x 5)] [9]
    assert message.shape == (layout.size,) == (1 + 4 + 11 + 1,)
    assert message[[0, 1, 5, 16]].tolist() == [4.0, 1.0, 2.0, 9.0]
    rows = layout.unpack(message, [None, None, [5, 3, 0], None])
    assert [r[0] for r in rows] == [4, 1, 2, 9]
    assert rows[0][1:] == (None, None) and rows[3][1:] == (None, None)
    assert rows[1][1].token == 1 and rows[1][1].logprob == pytest.approx(float(logprobs[0, 1]))
    assert [e.token for e in rows[2][2]] == [3, 0]
    assert rows[2][2][0].logprob == pytest.approx(float(logprobs[1, 3]))


class _Work:
    """A send's work as gloo's: ``is_completed`` only once waited for."""

    def __init__(self, log: list[int], n: int):
        self.log, self.n, self.waited = log, n, False

    def wait(self) -> None:
        self.waited = True
        self.log.append(self.n)

    def is_completed(self) -> bool:
        return self.waited


def test_mailbox_frees_sends_in_order_past_its_window():
    log: list[int] = []
    box = Mailbox(pp_rank=0, rank_of=lambda stage: stage, dims=None, device=torch.device("cpu"), window=3)
    box.sends.extend((_Work(log, n), torch.zeros(1)) for n in range(8))
    box.prune()
    assert log == [0, 1, 2, 3, 4] and len(box.sends) == 3  # the oldest waited for (and freed), oldest first
    box.close()
    assert log == list(range(8)) and not box.sends
    # Without a window, pruning by is_completed frees nothing of gloo's unwaited sends (why the ring sets one).
    unbounded = Mailbox(pp_rank=0, rank_of=lambda stage: stage, dims=None, device=torch.device("cpu"))
    unbounded.sends.extend((_Work([], n), torch.zeros(1)) for n in range(40))
    unbounded.prune()
    assert len(unbounded.sends) == 40
