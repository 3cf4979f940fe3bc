"""The mesh planner (``hf-pipeline plan --num-processes N --tp-size T --fsdp-size F``).

The tensor-parallel share of the parameters is checked exactly against a real pp2 x tp2 load in
tests/checkpointing/test_tp_resume.py (the same 4-rank job). Here: the fsdp arithmetic on a stand-in
pipeline (every figure sharded or not as FSDP2 does it), the mesh sizes and their refusals, and the
CLI's mesh report from a config alone.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import tiny

from hf_pipeline import cli
from hf_pipeline.errors import InputError
from hf_pipeline.memory.mesh_report import MeshReport, MeshShape, mesh_shape, with_fsdp


def _pipeline():
    stage = SimpleNamespace(rank=0, params=1001, largest_unit_bytes=300)
    rank = SimpleNamespace(rank=0, weight_bytes=4004, activation_bytes=50, checkpointed_activation_bytes=20,
                           p2p_buffer_bytes=8, kv_cache_bytes=16)
    return SimpleNamespace(stages=[stage], ranks=[rank])


def test_fsdp_shards_parameters_gradients_and_adamw_and_gathers_the_largest_block_twice():
    report = MeshReport(mesh=MeshShape(dp=1, fsdp=1, pp=1, tp=1), batch=4, pipeline=_pipeline(), ranks=())
    one, = with_fsdp(report, 1).ranks
    assert (one.weight_bytes, one.grad_bytes, one.optimizer_bytes, one.fsdp_gather_bytes) == (4004, 4004, 8008, 0)
    assert one.train_peak_bytes == 4 * 4004 + 50 + 8 and one.checkpointed_train_peak_bytes == 4 * 4004 + 20 + 8
    two = with_fsdp(report, 2)
    r, = two.ranks
    assert two.mesh.fsdp == 2 and r.params == 501  # ceil(1001 / 2)
    assert (r.weight_bytes, r.grad_bytes, r.optimizer_bytes, r.fsdp_gather_bytes) == (2002, 2002, 4004, 600)
    assert r.train_peak_bytes == 4 * 2002 + 600 + 50 + 8
    # Activations, P2P buffers and the KV cache are per rank's rows, not sharded by fsdp; decoding gathers units.
    assert (r.activation_bytes, r.p2p_buffer_bytes, r.kv_cache_bytes) == (50, 8, 16)
    assert r.generate_peak_bytes == 2002 + 600 + 16 and one.generate_peak_bytes == 4004 + 16
    assert with_fsdp(report, 3).ranks[0].weight_bytes == 1335  # ceil(4004 / 3)


def test_mesh_sizes_and_their_refusals():
    assert mesh_shape(16, pp_size=2, tp_size=4, fsdp_size=2) == MeshShape(dp=1, fsdp=2, pp=2, tp=4)
    assert mesh_shape(32, pp_size=2, tp_size=4, fsdp_size=2).dp == 2
    assert str(mesh_shape(16, pp_size=2, tp_size=8)) == "dp=1 x fsdp=1 x pp=2 x tp=8 = 16 ranks"
    with pytest.raises(InputError, match="--num-processes 12 is not a multiple of pp x tp x fsdp = 2 x 4 x 2 = 16"):
        mesh_shape(12, pp_size=2, tp_size=4, fsdp_size=2)
    with pytest.raises(InputError, match="fsdp size must be a positive integer"):
        MeshShape(dp=1, fsdp=0, pp=1, tp=1)


def test_cli_plans_a_mesh_from_a_config_alone(tmp_path, capsys):
    tiny.config_for("llama").save_pretrained(tmp_path)
    argv = ["plan", str(tmp_path), "--num-processes", "8", "--tp-size", "2", "--fsdp-size", "2", "--batch", "4",
            "--seq", "8", "--json"]
    assert cli.main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mesh"] == {"dp": 1, "fsdp": 2, "pp": 2, "tp": 2, "ep": 1, "ep_over": "stage", "world": 8}
    assert d["pipeline"]["batch"] == 2  # the global batch over dp x fsdp
    for rank, stage in zip(d["ranks"], d["pipeline"]["stages"]):
        assert rank["weight_bytes"] == -(-stage["weight_bytes"] // 2)
        assert rank["optimizer_bytes"] == 2 * rank["weight_bytes"]
    for bad, message in ((["--num-processes", "6"], "not a multiple of pp x tp x fsdp"),
                         (["--num-processes", "8", "--batch", "3"], "does not split over dp x fsdp"),
                         (["--tp-size", "3", "--batch", "2"], "tp_size=3 does not divide")):
        assert cli.main(["plan", str(tmp_path), "--tp-size", "2", "--fsdp-size", "2", *bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (bad, err)
