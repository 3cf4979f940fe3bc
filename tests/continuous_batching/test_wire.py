"""The continuous ring's messages alone (pure, no ranks): the op header packs to the exact int64 layout
every stage reads (a change of layout fails here, not in a 3-rank run), parses back to itself, and
refuses what is not a header; the joining rows' JSON round-trips."""

from __future__ import annotations

import json

import pytest
import torch

from hf_pipeline.continuous_batching.wire import NewRow, OpHeader, pack_rows, unpack_rows
from hf_pipeline.errors import InternalError

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
