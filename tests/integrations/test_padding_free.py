"""A padding-free batch as rows (``integrations/padding_free.py``), on hand-made tensors, exact.

TRL's ``padding_free`` collator (and transformers' ``DataCollatorWithFlattening``) puts a batch's sequences end to
end in one row, positions restarting at each; the pipeline needs rows to split into microbatches. Each sequence
becomes a right-padded row with its own ids, positions and labels, an attention mask over its tokens, filler rows
up to the count asked (no label, one attended token), and the varlen arguments gone.
"""

from __future__ import annotations

import pytest
import torch

from hf_pipeline.errors import InputError
from hf_pipeline.integrations.padding_free import is_padding_free, unflatten


def _flat():
    lengths = [3, 5, 2]
    ids = torch.arange(10, 20).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    labels[0, [0, 3, 8]] = -100  # each sequence's first label, as TRL masks it
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    return {"input_ids": ids, "position_ids": positions, "labels": labels, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": 5, "max_length_k": 5}


def test_each_sequence_becomes_a_right_padded_row_and_fillers_make_up_the_count():
    asked = []
    out = unflatten(_flat(), pad_token_id=7, rows_for=lambda n, longest: asked.append((n, longest)) or 4)
    assert asked == [(3, 5)]
    assert sorted(out) == ["attention_mask", "input_ids", "labels", "position_ids"]
    assert out["input_ids"].tolist() == [[10, 11, 12, 7, 7], [13, 14, 15, 16, 17], [18, 19, 7, 7, 7], [7] * 5]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4], [0, 1, 0, 0, 0], [0] * 5]
    assert out["labels"].tolist() == [[-100, 11, 12, -100, -100], [-100, 14, 15, 16, 17], [-100, 19, -100, -100, -100],
                                      [-100] * 5]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    # the scored targets are the flat row's, as many
    flat = _flat()["labels"]
    assert int((out["labels"][:, 1:] != -100).sum()) == int((flat[:, 1:] != -100).sum()) == 7


def test_what_is_padding_free():
    assert is_padding_free(_flat())
    positions_only = {k: v for k, v in _flat().items() if k in ("input_ids", "position_ids", "labels")}
    assert is_padding_free(positions_only)  # transformers' DataCollatorWithFlattening without the varlen arguments
    one = {"input_ids": torch.arange(5)[None], "position_ids": torch.arange(5)[None]}
    rows = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    assert not is_padding_free(one) and not is_padding_free(rows)


def test_a_varlen_batch_without_one_row_of_positions_is_refused_naming_what_it_has():
    batch = _flat()
    del batch["position_ids"]
    with pytest.raises(InputError, match=r"must hold its sequences in one row .* got input_ids of shape \(1, 10\) "
                                         r"and no position_ids"):
        unflatten(batch, pad_token_id=0, rows_for=lambda n, longest: n)
