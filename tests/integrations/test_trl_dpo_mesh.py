"""TRL's DPOTrainer through PipelineTrainerMixin on 4 ranks, dp2 x pp2, against DPOTrainer on one process.

One spawned 4-rank job: two pipeline replicas of 2 stages (``num_stages=2``), 2 microbatches each, 2 pairs per
replica (``per_device_train_batch_size=2``), so the global batch is the 4 pairs ``trl.DPOTrainer`` takes on one
process (tests/integrations/test_trl_dpo.py's reference). The three set-ups of that test (``ref``: a pipelined
reference model, sigmoid; ``precompute``: TRL's precomputed reference columns, ipo; ``peft``: LoRA with its frozen
copy as the reference), compared as there: every logged step (loss, gradient norm, learning rate, TRL's metrics),
``evaluate()`` (``ref``) and every trained parameter after 2 optimizer steps of 2 accumulated batches, on every
rank. Tolerance ``TOL`` (2e-5) as there: the sequence log-probabilities differ from TRL's fused head by ~1e-6
(measured here, largest over ranks and steps: logged losses 8e-8 relative, metrics 6e-7, parameters 4e-6 in the
precompute case at lr 1e-3; the other cases 1e-6 or less).
What it catches beyond 2 ranks: a replica taking the other's rows or the same rows as it (another loss at step
1), a pair split across replicas, a loss not divided by the global batch's pairs (each replica's loss would be
twice TRL's mean), gradients summed instead of averaged across replicas, or metrics from one replica's rows only.
"""

from __future__ import annotations

import pytest
import tiny
from harness import run_distributed
from test_trl_dpo import _dpo_rank, assert_equal_to_trl

pytest.importorskip("trl")
pytest.importorskip("peft")

DP2_PP2 = {"num_stages": 2, "n_microbatches": 2}


@pytest.mark.dist
@pytest.mark.slow
def test_dpo_trainer_on_dp2_by_pp2_equals_dpo_trainer(tmp_path):
    path = str(tiny.make_checkpoint(tmp_path / "llama", "llama"))
    ref_path = str(tiny.make_checkpoint(tmp_path / "llama-ref", "llama", seed=5))
    results = run_distributed(_dpo_rank, 4, path, ref_path, str(tmp_path), DP2_PP2, 2, timeout=600)
    assert [r["dims"] for r in results] == [(2, 2)] * 4
    assert_equal_to_trl(results, path, ref_path, str(tmp_path), "dp2 x pp2")
