"""The failure records ranks exchange through the rendezvous store are data, never code.

The store listens on all interfaces: any process that reaches its port can write under the
library's key prefix. A value there must never be unpickled (a pickle runs code when loaded); a
value that is not one of the library's JSON records is ignored with a log line, and the real
failure is still reported.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle

import pytest
import torch
from harness import run_distributed

from hf_pipeline.distributed import fault_records, faults


class _Hostile:
    """A pickle that creates ``marker`` when loaded: what an attacker would write under the prefix."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _genuine() -> bytes:
    try:
        raise ValueError("labels hold token id 977 but the vocabulary has 96 entries")
    except ValueError as e:
        return fault_records.make_record("error", 2, e, "stage 2", "a training step", 7)


@pytest.mark.unit
def test_a_genuine_record_round_trips_as_json():
    raw = _genuine()
    assert json.loads(raw)["kind"] == "error"  # plain JSON on the wire
    rec, why = fault_records.decode_record(raw)
    assert why == "" and rec is not None
    assert (rec["rank"], rec["type"], rec["label"], rec["what"], rec["call"]) == (
        2, "ValueError", "stage 2", "a training step", 7
    )
    assert rec["message"] == "labels hold token id 977 but the vocabulary has 96 entries"


def _changed(**fields) -> bytes:
    rec = json.loads(_genuine())
    rec.update(fields)
    return json.dumps({k: v for k, v in rec.items() if v is not ...}).encode()


@pytest.mark.unit
@pytest.mark.parametrize(
    "raw,why",
    [
        (b"not json", "not UTF-8 JSON"),
        (b"\xff\xfe", "not UTF-8 JSON"),
        (b"[1, 2]", "expected keys"),
        (_changed(extra=1), "expected keys"),
        (_changed(label=...), "expected keys"),
        (_changed(rank="0"), "'rank' must be int"),
        (_changed(rank=True), "'rank' must be int"),
        (_changed(rank=-1), "'rank' is out of range"),
        (_changed(message=None), "'message' must be str"),
        (_changed(message="x" * 5000), "'message' is too long"),
        (_changed(kind="exec"), "is not one of"),
        (b" " * (17 * 1024), "more than 16384"),
    ],
    ids=["text", "binary", "list", "extra-key", "missing-key", "rank-str", "rank-bool", "rank-negative",
         "message-null", "message-long", "kind", "oversized"],
)
def test_malformed_records_are_refused_with_a_reason(raw, why):
    rec, reason = fault_records.decode_record(raw)
    assert rec is None and why in reason, reason


@pytest.mark.unit
def test_a_pickle_in_the_store_is_ignored_not_executed(tmp_path, monkeypatch, caplog):
    import torch.distributed as dist

    marker = tmp_path / "pwned"
    store = dist.HashStore()
    store.set("hf_pipeline/faults/call0/rank1", pickle.dumps(_Hostile(str(marker))))
    monkeypatch.setattr(fault_records, "default_store", lambda: store)
    reader = fault_records.FaultStore()
    assert reader.get("hf_pipeline/faults/call0/rank1") is None
    assert reader.get("hf_pipeline/faults/call0/rank1") is None  # polled again: logged once
    assert not marker.exists()
    assert reader.ignored == {"hf_pipeline/faults/call0/rank1"}
    store.set("hf_pipeline/faults/call0/rank1", _genuine())  # the real rank overwrites it: read again
    assert reader.get("hf_pipeline/faults/call0/rank1")["type"] == "ValueError"


def _attacked_call(marker: str):
    """Every fault key of the next calls holds a hostile pickle (written by an outsider through a plain
    TCPStore client, before the call); then rank 1 raises while rank 0 waits for it."""
    import torch.distributed as dist

    from hf_pipeline.distributed.context import init_distributed

    ctx = init_distributed(device="cpu")
    if ctx.rank == 0:
        outsider = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=30),
        )
        store = dist.PrefixStore("default_pg", outsider)  # the prefix init_process_group puts on its keys
        hostile = pickle.dumps(_Hostile(marker))
        for key in [f"hf_pipeline/faults/call{n}/rank{r}" for n in range(3) for r in range(2)]:
            store.set(key, hostile)
        store.set("hf_pipeline/faults/epoch0/first", hostile)
    ctx.barrier()
    try:
        with faults.spread_failures(ctx, "a test call", describe=lambda r: f"stage {r}"):
            if ctx.rank == 1:
                raise ValueError("the real failure on rank 1")
            dist.recv(torch.empty(1), src=1)  # rank 1 never sends: it raised
    except Exception as e:  # noqa: BLE001 - what this test is about
        return type(e).__name__, str(e)
    return None


@pytest.mark.dist
def test_hostile_values_under_the_fault_prefix_never_run_and_the_failure_is_still_named(tmp_path):
    marker = tmp_path / "pwned"
    results = run_distributed(_attacked_call, 2, str(marker), timeout=90, env={"HF_PIPELINE_TIMEOUT": "30"})
    assert not marker.exists(), "a value read from the store ran code"
    assert results[1] == ("ValueError", "the real failure on rank 1")
    kind, message = results[0]
    assert kind == "RankError", results[0]
    assert message.startswith("rank 1 (stage 1) failed during a test call: ValueError: the real failure on rank 1")

