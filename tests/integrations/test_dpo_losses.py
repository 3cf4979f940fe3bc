"""The pipeline's DPO loss pieces on one process, against TRL's DPOTrainer.compute_loss, and the pair ordering.

* Every loss type of ``PAIR_LOSSES`` (and a weighted mix): TRL's loss for one batch of a tiny LLaMA and a
  reference of another seed, against ``pair_loss`` of ``row_stats`` over the same model's logits, averaged over
  the pairs. Tolerance 1e-5 (relative and absolute): TRL's fused head sums log-probabilities computed in tiles,
  ``row_stats`` takes torch's ``log_softmax`` (~1e-6 apart on sequence log-probabilities of ~-20); a wrong formula,
  sign or length normalisation moves a loss by 1e-3 or more.
* ``DPOStep.ordered``: for 2 replicas x 2 microbatches, every microbatch holds whole pairs (its chosen rows,
  then the same pairs' rejected rows), and the ``rows`` target gives each row's place in TRL's order.
"""

from __future__ import annotations

import pathlib
import types

import datasets
import pytest
import tiny
import torch
import transformers

from hf_pipeline.integrations.trainer_dpo import PAIR_LOSSES, DPOStep, pair_loss, row_stats

trl = pytest.importorskip("trl")


TOL = 1e-5


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dpo")
    text = tiny.text_file(pathlib.Path(directory) / "text.txt", lines=16)
    words = text.read_text().split()
    data = datasets.Dataset.from_dict({
        "prompt": [" ".join(words[i: i + 2 + i % 3]) for i in range(6)],
        "chosen": [" " + " ".join(words[10 + i: 11 + i % 4]) for i in range(6)],
        "rejected": [" " + " ".join(words[20 + i: 22 + i % 2]) for i in range(6)],
    })
    tok = tiny.word_tokenizer(text)
    load = transformers.AutoModelForCausalLM.from_pretrained
    model = load(str(tiny.make_checkpoint(directory / "llama", "llama")), dtype=torch.float32)
    ref = load(str(tiny.make_checkpoint(directory / "ref", "llama", seed=5)), dtype=torch.float32)
    args = trl.DPOConfig(str(directory / "out"), per_device_train_batch_size=6, report_to=[], use_cpu=True, bf16=False,
                         gradient_checkpointing=False, max_length=16, label_smoothing=0.1)
    trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(6)])
    return trainer, batch


def _ours(trainer, batch, loss_types, weights) -> torch.Tensor:
    settings = types.SimpleNamespace(beta=trainer.beta, loss_types=loss_types, loss_weights=weights,
                                     label_smoothing=trainer.label_smoothing, discopop_tau=trainer.args.discopop_tau)
    labels = DPOStep.labels(batch)
    with torch.no_grad():
        stats = row_stats(trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                          labels)
        ref = row_stats(trainer.ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                        labels)[:, 0]
    n = stats.shape[0] // 2
    return pair_loss(stats[:n, 0], stats[n:, 0], ref, batch["completion_mask"].sum(1), settings).mean()


@pytest.mark.equiv
@pytest.mark.parametrize("loss_types", [(t,) for t in sorted(PAIR_LOSSES)] + [("sigmoid", "ipo")], ids=str)
def test_pair_losses_equal_trl(dpo, loss_types):
    trainer, batch = dpo
    weights = (1.0,) if len(loss_types) == 1 else (0.7, 0.3)
    trainer.loss_types, trainer.loss_weights = list(loss_types), list(weights)
    with torch.no_grad():
        want = trainer.compute_loss(trainer.model, batch)
    got = _ours(trainer, batch, loss_types, weights)
    assert float(got) == pytest.approx(float(want), rel=TOL, abs=TOL), loss_types
    assert abs(float(want) - float(_ours(trainer, batch, ("hinge" if loss_types[0] != "hinge" else "sigmoid",),
                                         (1.0,)))) > 1e-3  # the loss types differ: the comparison can fail


def test_the_default_pair_loss_equals_trl(dpo):
    test_pair_losses_equal_trl(dpo, ("sigmoid",))  # the quick tier's representative; every loss runs in the full suite


def test_trl_private_names_the_mixin_uses_exist(dpo):
    # compat names them: a trl release renaming one fails here instead of silently running TRL's own pass.
    from hf_pipeline.compat import TRL_DPO_OVERRIDES, TRL_METRICS, TRL_TOKENS

    trainer, _ = dpo
    assert all(callable(getattr(trl.DPOTrainer, name, None)) for name in TRL_DPO_OVERRIDES)
    assert set(getattr(trainer, TRL_METRICS)) == {"train", "eval"} and getattr(trainer, TRL_TOKENS) == 0


def test_microbatches_hold_whole_pairs():
    pairs, rows = 8, 16
    model = types.SimpleNamespace(dims=types.SimpleNamespace(dp_size=2),
                                  microbatches_for=lambda r, training, seq=None: 2)
    step = DPOStep.__new__(DPOStep)
    step.pipelined = model
    ids = torch.arange(rows)[:, None].repeat(1, 3)  # row r holds r everywhere: [chosen 0..7; rejected 8..15]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": torch.ones_like(ids)}
    batch = step.ordered(inputs, ref=torch.arange(rows, dtype=torch.float32))
    for mb in batch["input_ids"][:, 0].split(rows // 4):  # 2 replicas x 2 microbatches, 4 rows each
        chosen, rejected = mb[:2], mb[2:]
        assert torch.equal(rejected, chosen + pairs), mb  # pair p: chosen row p, rejected row pairs + p
    assert torch.equal(batch["rows"], batch["input_ids"][:, 0])
    assert torch.equal(batch["ref_logps"], batch["rows"].float())
    assert sorted(batch["rows"].tolist()) == list(range(rows))
