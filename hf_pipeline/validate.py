"""Checks of call arguments that every rank runs before a pipelined call communicates.

A bad argument found inside a pipelined call surfaces on one stage only (a position index out of
range in the first stage's embedding, a labels shape error in the last stage's loss), after its
peers are already waiting for it. These checks run on every rank, on inputs that
``check_same_on_all_ranks`` has shown to be identical, so each rank raises the same error at once
and the process group stays usable.

Example:
    >>> check_sequence_length(model.config, input_ids.shape[1])
    >>> check_labels(model.resolved.head.loss, labels, input_ids=input_ids)
    >>> check_microbatches(batch=8, n_microbatches=4, training=True)
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = [
    "check_generate_inputs",
    "check_labels",
    "check_microbatches",
    "check_model_inputs",
    "check_prompts",
    "check_sequence_length",
    "max_positions",
]


def max_positions(config) -> int | None:
    """Longest sequence the model's position embeddings cover (``max_position_embeddings``; GPT-2's
    ``n_positions`` maps to it), or None for models without a limit (T5's relative positions)."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_sequence_length(config, length: int, *, what: str = "the input sequence", new_tokens: int = 0) -> None:
    """Raise ValueError if ``length`` (+ ``new_tokens`` to generate) exceeds the model's maximum positions.

    Args:
        config: the transformers config.
        length: tokens per row of the input.
        what: the input's name, for the message.
        new_tokens: tokens generation will append.
    """
    limit = max_positions(config)
    if limit is None:
        return
    total = length + new_tokens
    if total > limit:
        grown = f" + {new_tokens} new tokens = {total}" if new_tokens else ""
        raise ValueError(
            f"{what} has {length} tokens{grown}, more than the model's maximum of {limit} positions "
            f"(config.max_position_embeddings); truncate the input to at most {limit - new_tokens} tokens"
            + (" or generate fewer tokens" if new_tokens else "")
        )


def check_microbatches(*, batch: int, n_microbatches: int, training: bool) -> None:
    """Raise ValueError if ``batch`` rows cannot be split into ``n_microbatches`` microbatches.

    Inference pads a batch that is not a multiple (the padded rows' outputs are dropped); a training
    step cannot (padded rows would change the loss), so there it must divide evenly.
    """
    if batch < n_microbatches:
        raise ValueError(
            f"batch size {batch} is smaller than n_microbatches={n_microbatches}; pass at least {n_microbatches} "
            f"rows or load the model with a smaller n_microbatches"
        )
    if training and batch % n_microbatches:
        lower = batch - batch % n_microbatches
        raise ValueError(
            f"a training batch of {batch} rows does not split into n_microbatches={n_microbatches} equal microbatches; "
            f"pass a multiple of {n_microbatches} rows (e.g. {lower} or {lower + n_microbatches}) or load the model "
            f"with an n_microbatches that divides {batch}"
        )


def check_labels(loss: str | None, labels: torch.Tensor, *, input_ids: torch.Tensor | None = None, decoder_input_ids: torch.Tensor | None = None, batch: int | None = None) -> None:
    """Raise ValueError if ``labels`` does not fit the head's loss.

    Args:
        loss: the recipe head's loss kind (``causal_lm``, ``masked_lm``, ``seq2seq_lm``,
            ``sequence_classification``) or None for a head without one.
        labels: the labels tensor.
        input_ids / decoder_input_ids: the inputs it must match.
        batch: the batch size (when no ids are given).
    """
    if loss is None:
        raise ValueError("this model's head has no loss; do not pass labels (load it with a head class, e.g. AutoModelForCausalLM)")
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"labels must be a tensor, got {type(labels).__name__}")
    ref = input_ids if input_ids is not None else decoder_input_ids
    rows = batch if batch is not None else (ref.shape[0] if ref is not None else labels.shape[0])
    if labels.shape[:1] != (rows,):
        raise ValueError(f"labels has {labels.shape[0] if labels.dim() else 0} rows but the batch has {rows}; pass one row of labels per input row")
    if loss in ("causal_lm", "masked_lm"):
        if input_ids is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}; for {loss} pass "
                "labels of the same shape as input_ids (-100 where no loss is wanted); the shift happens inside the loss"
            )
    elif loss == "seq2seq_lm":
        if labels.dim() != 2:
            raise ValueError(f"labels must be (batch, target length), got shape {tuple(labels.shape)}")
        if decoder_input_ids is not None and labels.shape != decoder_input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} does not match decoder_input_ids {tuple(decoder_input_ids.shape)}; "
                "pass labels only (decoder inputs are derived from them) or both with the same shape"
            )
    elif loss == "sequence_classification":
        if labels.dim() not in (1, 2):
            raise ValueError(f"labels must be (batch,) class ids or (batch, num_labels) targets, got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point and loss != "sequence_classification":
        raise ValueError(f"labels must hold integer token ids for {loss}, got dtype {labels.dtype}")


def check_model_inputs(config, loss: str | None, inputs: Mapping[str, Any], *, labels: torch.Tensor | None = None) -> None:
    """Sequence lengths and labels of one call's inputs (see the functions above)."""
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(inputs.get(key), torch.Tensor) and inputs[key].dim() >= 2:
            check_sequence_length(config, inputs[key].shape[1], what=key)
            break
    mask, ids = inputs.get("attention_mask"), inputs.get("input_ids")
    if isinstance(mask, torch.Tensor) and isinstance(ids, torch.Tensor) and mask.dim() == 2 and mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    if labels is not None:
        check_labels(loss, labels, input_ids=inputs.get("input_ids"), decoder_input_ids=inputs.get("decoder_input_ids"))


def check_prompts(prompts: Any) -> str:
    """Raise ValueError unless ``prompts`` is a non-empty list of strings or of token-id lists.

    Returns:
        ``"text"`` or ``"ids"``.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of strings (or of token-id lists), got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("the prompt list is empty; pass at least one prompt")
    kinds = []
    for p in prompts:
        if isinstance(p, str):
            kinds.append("text")
        elif isinstance(p, (list, tuple)):
            kinds.append("ids" if all(isinstance(t, int) and not isinstance(t, bool) for t in p) else "list holding non-int items")
        else:
            kinds.append(type(p).__name__)
    odd = next((i for i, k in enumerate(kinds) if k not in ("text", "ids")), None)
    if odd is not None:
        raise ValueError(f"prompts must be strings or lists of int token ids, got a {kinds[odd]} at index {odd}")
    if len(set(kinds)) > 1:
        seen = sorted(set(kinds))
        first = {k: kinds.index(k) for k in seen}
        raise ValueError(
            "prompts must all be strings or all be token-id lists, got a mix: "
            + ", ".join(f"{k} (first at index {first[k]})" for k in seen)
        )
    if kinds[0] == "ids" and any(len(p) == 0 for p in prompts):
        raise ValueError(f"prompt {next(i for i, p in enumerate(prompts) if len(p) == 0)} is an empty token list")
    return kinds[0]


def check_generate_inputs(input_ids: Any) -> None:
    """Raise a clear error for prompts ``generate`` cannot take: lists (untokenized or mixed) and empty batches.

    A list is checked with :func:`check_prompts` first, so an empty or mixed list gets that message.
    """
    if isinstance(input_ids, (list, tuple)):
        kind = check_prompts(input_ids)
        hint = "tok(prompts, return_tensors='pt', padding=True)" if kind == "text" else "torch.tensor(ids) (pad rows to one length)"
        raise TypeError(f"generate takes input_ids as a (batch, length) tensor of token ids, got a list of {kind} prompts; pass {hint}")
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and 0 in input_ids.shape:
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)} holds no "
            + ("prompts; pass at least one" if input_ids.shape[0] == 0 else "tokens; every prompt needs at least one (e.g. the BOS token)")
        )
