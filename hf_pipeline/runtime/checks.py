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

from typing import Any, Mapping

import torch
from transformers.utils import logging

from ..errors import InputError
from ..families.losses import check_sequence_labels
from ..families.recipe import position_kind

logger = logging.get_logger(__name__)

__all__ = [
    "IGNORE_INDEX",
    "EMBEDDING_INDEX_DTYPES",
    "INDEX_TABLES",
    "check_index_inputs",
    "check_labels",
    "check_microbatches",
    "check_model_inputs",
    "check_sequence_length",
    "check_token_ids",
    "index_table",
    "max_positions",
    "refuse_meta",
    "vocab_size",
]

IGNORE_INDEX = -100  # the label transformers' losses skip
# The index dtypes torch's embedding takes ("Expected tensor for argument #1 'indices' to have one of
# the following scalar types: Long, Int"): transformers passes ids through uncast, so int16 / uint8
# ids raise on the first stage alone. Refused here, on every rank, as transformers would refuse them.
EMBEDDING_INDEX_DTYPES = (torch.long, torch.int32)
# The token losses take Long targets (and Byte, which cannot hold -100): "expected target dtype to be
# Long or Byte, but got Int" on the last stage alone.
_TOKEN_LABEL_DTYPES = (torch.long, torch.uint8)
# What each index input of the embeddings indexes, as data: the config fields giving the size of its
# table, the first one the config has. Models without token types of their own (GPT-2, GPT-J) embed
# token_type_ids with the word embedding; position_ids index a table only when the recipe says the
# positions are learned (rotary positions have none to run off).
INDEX_TABLES: dict[str, tuple[str, ...]] = {
    "input_ids": ("vocab_size",),
    "decoder_input_ids": ("vocab_size",),
    "token_type_ids": ("type_vocab_size", "vocab_size"),
    "position_ids": ("max_position_embeddings",),
}
# The width inputs_embeds must have: the embedding's own width where it differs from the hidden size
# (OPT's word_embed_proj_dim, ALBERT's embedding_size), else hidden_size.
_EMBEDDING_WIDTHS = ("word_embed_proj_dim", "embedding_size", "hidden_size")


def vocab_size(config) -> int | None:
    """Token ids the model's embeddings (and LM head) cover: ``config.vocab_size`` (a composite model's text config)."""
    value = getattr(config, "vocab_size", None)
    if not isinstance(value, int) and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(decoder=True), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None


def _first_outside(values: torch.Tensor, bad: torch.Tensor, *, column_offset: int = 0) -> str:
    """``"96 at [0, 3]"``: the first offending value and where it is (only computed once something is wrong)."""
    where = tuple(int(i) for i in bad.nonzero()[0].tolist())
    shown = list(where[:-1]) + [where[-1] + column_offset] if where else []
    return f"{int(values[where])} at {shown}"


def check_token_ids(
    ids: Any, *, vocab: int | None, what: str = "input_ids", limit_name: str = "config.vocab_size"
) -> None:
    """Raise InputError unless ``ids`` is a (batch, length) integer tensor of ids in ``[0, vocab)``.

    Cheap: one min/max pass over the ids (a second pass only to say where a bad id is).

    Args:
        ids: the tensor.
        vocab: how many ids the embedding has (None: the range is not checked).
        what: the input's name, for the message.
        limit_name: where ``vocab`` comes from, for the message.
    """
    if not isinstance(ids, torch.Tensor):
        raise InputError(
            f"{what} must be a (batch, length) tensor of token ids, got {type(ids).__name__}; pass tok(..., "
            "return_tensors='pt')"
        )
    refuse_meta({what: ids})
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputError(
            f"{what} must hold integer token ids, got dtype {ids.dtype}; pass a torch.long tensor (e.g. {what}.long() "
            "if the values are ids)"
        )
    _check_index_dtype(ids, what)
    shape = tuple(ids.shape)
    if ids.dim() != 2:
        fix = (
            f"; for one sequence pass {what}[None]"
            if ids.dim() == 1
            else f"; merge the leading dimensions ({what}.reshape(-1, {shape[-1]})) or drop the extra one"
            if ids.dim() > 2
            else "; pass a (batch, length) tensor"
        )
        raise InputError(f"{what} must be (batch, length), got shape {shape} ({ids.dim()}-D){fix}")
    if shape[0] == 0:
        raise InputError(f"{what} of shape {shape} holds no rows; pass at least one")
    if shape[1] == 0:
        raise InputError(f"{what} of shape {shape} holds no tokens; every row needs at least one (e.g. the BOS token)")
    if vocab is None:
        return
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if lo < 0 or hi >= vocab:
        first = _first_outside(ids, (ids < 0) | (ids >= vocab))
        raise InputError(
            f"{what} holds token id {first}, outside the model's vocabulary of {vocab} tokens ({limit_name}); ids must "
            f"be in [0, {vocab - 1}]: check that the tokenizer belongs to this model"
        )


def refuse_meta(tensors: Mapping[str, Any]) -> None:
    """Raise InputError for a tensor on the meta device: a shape without values, which no check can read.

    transformers embeds such ids as whatever memory it gets when it moves them (or fails reading
    them); the pipeline's checks would fail on the first value they read, with torch's own message.
    """
    name = next((k for k, v in tensors.items() if isinstance(v, torch.Tensor) and v.is_meta), None)
    if name is not None:
        raise InputError(
            f"{name} is on the meta device: it has a shape {tuple(tensors[name].shape)} but no values (as tensors "
            "made under torch.device('meta') or by init_empty_weights); pass a tensor holding its values"
        )


def max_positions(config) -> int | None:
    """Longest sequence the model's position embeddings cover (``max_position_embeddings``; GPT-2's
    ``n_positions`` maps to it), or None for models without a limit (T5's relative positions)."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_sequence_length(config, length: int, *, what: str = "the input sequence", new_tokens: int = 0) -> None:
    """Raise InputError if ``length`` (+ ``new_tokens`` to generate) exceeds the model's learned position table.

    Models whose recipe says their positions are rotary or relative (LLaMA, T5) run longer inputs
    as transformers does; generation past ``max_position_embeddings`` logs transformers' reminder.

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
    if position_kind(config) != "learned":
        # Rotary and relative positions have no table to run off: transformers runs such models on
        # longer inputs (its rope-scaling tests do), and its generate only reminds once.
        if new_tokens and total > limit:
            logger.warning_once(
                "This is a friendly reminder - the current text generation call will exceed the model's predefined "
                f"maximum length ({limit}). Depending on the model, you may observe exceptions, performance "
                "degradation, or nothing at all."
            )
        return
    if total > limit:
        grown = f" + {new_tokens} new tokens = {total}" if new_tokens else ""
        fixes = []
        if limit - new_tokens >= 1:
            fixes.append(f"truncate the input to at most {limit - new_tokens} tokens")
        if new_tokens and length < limit:
            fixes.append(f"generate at most {limit - length} new tokens (max_new_tokens={limit - length})")
        if not fixes:  # the input alone fills every position
            fixes.append(f"truncate the input to fewer than {limit} tokens and generate fewer tokens")
        raise InputError(
            f"{what} has {length} tokens{grown}, more than the model's maximum of {limit} positions "
            f"(config.max_position_embeddings); " + " or ".join(fixes)
        )


def check_microbatches(*, batch: int, n_microbatches: int, training: bool) -> None:
    """Raise InputError if a training step's ``batch`` rows cannot be split into ``n_microbatches`` microbatches.

    Inference takes any batch: it pads one that is not a multiple, fewer rows than ``n_microbatches``
    included, by repeating its last row, and drops the padded rows' outputs (an evaluation harness's last
    batch is often one row). A training step cannot (padded rows would change the loss), so there the
    batch must divide evenly.
    """
    if not training:
        return
    if batch < n_microbatches:
        raise InputError(
            f"batch size {batch} is smaller than n_microbatches={n_microbatches}; pass at least {n_microbatches} "
            f"rows or load the model with a smaller n_microbatches"
        )
    if batch % n_microbatches:
        lower = batch - batch % n_microbatches
        raise InputError(
            f"a training batch of {batch} rows does not split into n_microbatches={n_microbatches} equal microbatches; "
            f"pass a multiple of {n_microbatches} rows (e.g. {lower} or {lower + n_microbatches}) or load the model "
            f"with an n_microbatches that divides {batch}"
        )


def check_labels(
    loss: str | None,
    labels: torch.Tensor,
    *,
    input_ids: torch.Tensor | None = None,
    decoder_input_ids: torch.Tensor | None = None,
    batch: int | None = None,
    vocab: int | None = None,
    num_labels: int | None = None,
) -> None:
    """Raise InputError if ``labels`` does not fit the head's loss.

    Args:
        loss: the recipe head's loss kind (``causal_lm``, ``masked_lm``, ``seq2seq_lm``,
            ``sequence_classification``) or None for a head without one.
        labels: the labels tensor.
        input_ids / decoder_input_ids: the inputs it must match.
        batch: the batch size (when no ids are given).
        vocab: token labels must be in ``[0, vocab)`` or -100 (None: not checked).
        num_labels: class labels must be in ``[0, num_labels)`` (None: not checked).
    """
    if loss is None:
        raise InputError(
            "this model's head has no loss; do not pass labels (load it with a head class, e.g. AutoModelForCausalLM)"
        )
    if not isinstance(labels, torch.Tensor):
        raise InputError(f"labels must be a tensor, got {type(labels).__name__}")
    ref = input_ids if input_ids is not None else decoder_input_ids
    rows = batch if batch is not None else (ref.shape[0] if ref is not None else labels.shape[0])
    if labels.shape[:1] != (rows,):
        raise InputError(
            f"labels has {labels.shape[0] if labels.dim() else 0} rows but the batch has {rows}; pass one row of "
            "labels per input row"
        )
    if loss in ("causal_lm", "masked_lm"):
        if input_ids is not None and labels.shape != input_ids.shape:
            raise InputError(
                f"labels shape {tuple(labels.shape)} does not match input_ids {tuple(input_ids.shape)}; for {loss} "
                "pass labels of the same shape as input_ids (-100 where no loss is wanted); the shift happens inside "
                "the loss"
            )
    elif loss == "seq2seq_lm":
        if labels.dim() != 2:
            raise InputError(f"labels must be (batch, target length), got shape {tuple(labels.shape)}")
        if decoder_input_ids is not None and labels.shape != decoder_input_ids.shape:
            raise InputError(
                f"labels shape {tuple(labels.shape)} does not match decoder_input_ids "
                f"{tuple(decoder_input_ids.shape)}; "
                "pass labels only (decoder inputs are derived from them) or both with the same shape"
            )
    elif loss == "sequence_classification":
        if labels.dim() not in (1, 2):
            raise InputError(
                f"labels must be (batch,) class ids or (batch, num_labels) targets, got shape {tuple(labels.shape)}"
            )
    if labels.dtype.is_floating_point and loss != "sequence_classification":
        raise InputError(f"labels must hold integer token ids for {loss}, got dtype {labels.dtype}")
    # Class ids (1-D, num_labels > 1) go to cross entropy too, which takes Long targets only there:
    # transformers routes int32 to it (and raises), other integer types to a multi-label loss (and raises).
    class_ids = loss == "sequence_classification" and labels.dim() == 1 and (num_labels or 0) > 1
    allowed = _TOKEN_LABEL_DTYPES if loss in ("causal_lm", "masked_lm", "seq2seq_lm") else (torch.long,)
    tokens_or_classes = loss in ("causal_lm", "masked_lm", "seq2seq_lm") or class_ids
    if tokens_or_classes and not labels.dtype.is_floating_point and labels.dtype not in allowed:
        raise InputError(
            f"labels must be a torch.long tensor for {loss}, got dtype {labels.dtype} (transformers' loss takes Long "
            "targets and raises the same); pass labels.long()"
        )
    _check_label_range(loss, labels, vocab=vocab, num_labels=num_labels)


def _check_label_range(loss: str, labels: torch.Tensor, *, vocab: int | None, num_labels: int | None) -> None:
    # One min/max pass; the loss would raise "Target 96 is out of bounds" on the last stage alone.
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.numel() == 0:
        return
    offset = 0
    if loss == "causal_lm":
        labels, offset = labels[..., 1:], 1  # the shift drops the first position: transformers never reads it
        limit, name, what = vocab, "config.vocab_size", "token"
    elif loss in ("masked_lm", "seq2seq_lm"):
        limit, name, what = vocab, "config.vocab_size", "token"
    elif loss == "sequence_classification" and labels.dim() == 1 and num_labels is not None and num_labels > 1:
        limit, name, what = num_labels, "config.num_labels", "class"
    else:
        return
    if limit is None or labels.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(labels))
    if hi < limit and (lo >= 0 or not bool(((labels < 0) & (labels != IGNORE_INDEX)).any())):
        return
    first = _first_outside(labels, (labels >= limit) | ((labels < 0) & (labels != IGNORE_INDEX)), column_offset=offset)
    raise InputError(
        f"labels hold {what} id {first}, outside the model's {limit} {what}s ({name}); labels must be in "
        f"[0, {limit - 1}], or {IGNORE_INDEX} where no loss is wanted"
    )


def _check_index_dtype(ids: torch.Tensor, what: str) -> None:
    if ids.dtype not in EMBEDDING_INDEX_DTYPES:
        raise InputError(
            f"{what} has dtype {ids.dtype}, but embeddings take torch.long or torch.int32 indices (transformers "
            f"raises the same); pass {what}.long()"
        )


def index_table(config, name: str) -> tuple[int, str] | None:
    """The size of the table input ``name`` indexes and the config field giving it (see INDEX_TABLES), or None."""
    if name == "position_ids" and position_kind(config) != "learned":
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for field in INDEX_TABLES.get(name, ()):
        value = getattr(config, field, None)
        value = value if isinstance(value, int) else getattr(text, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"config.{field}"
    return None


def check_index_inputs(config, inputs: Mapping[str, Any], *, dtype: torch.dtype | None = None) -> None:
    """Raise InputError unless every index input besides the token ids (token types, positions) has an
    embedding dtype and indexes inside its table (INDEX_TABLES), and inputs_embeds has the embedding's width
    and a floating dtype the model's ``dtype`` computes with.

    One min/max pass per tensor; the first stage's embedding would otherwise raise alone, with its
    peers waiting for it.
    """
    refuse_meta(inputs)
    for name in INDEX_TABLES:
        values = inputs.get(name)
        if name in ("input_ids", "decoder_input_ids") or not isinstance(values, torch.Tensor) or not values.numel():
            continue  # token ids: check_token_ids (shapes and all)
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise InputError(f"{name} must hold integer indices, got dtype {values.dtype}; pass {name}.long()")
        _check_index_dtype(values, name)
        table = index_table(config, name)
        if table is None:
            continue
        size, field = table
        lo, hi = (int(v) for v in torch.aminmax(values))
        if lo < 0 or hi >= size:
            raise InputError(
                f"{name} holds {_first_outside(values, (values < 0) | (values >= size))}, outside the table of {size} "
                f"entries it indexes ({field}); {name} must be in [0, {size - 1}]"
            )
    _check_embeds(config, inputs.get("inputs_embeds"), dtype)


def _check_embeds(config, embeds: Any, dtype: torch.dtype | None) -> None:
    if not isinstance(embeds, torch.Tensor):
        return
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    field = next((f for f in _EMBEDDING_WIDTHS if isinstance(getattr(text, f, None), int)), None)
    width = getattr(text, field) if field else None
    if embeds.dim() != 3 or not embeds.dtype.is_floating_point or (width is not None and embeds.shape[-1] != width):
        want = f"(batch, length, {width}) (config.{field})" if width is not None else "(batch, length, hidden)"
        raise InputError(
            f"inputs_embeds must be a floating point tensor of shape {want}, got shape {tuple(embeds.shape)} "
            f"of dtype {embeds.dtype}; pass the output of model.get_input_embeddings() or input_ids instead"
        )
    # transformers adds a narrower float (float16 for a float32 model) into the model's dtype and runs
    # it; a wider one (float64, or float32 for a bfloat16 model) promotes the hidden state past the
    # weights' dtype, and the first linear or layer norm raises on the first stage alone.
    if dtype is not None and torch.promote_types(embeds.dtype, dtype) != dtype:
        raise InputError(
            f"inputs_embeds has dtype {embeds.dtype}, but the model computes in {dtype} (transformers raises too: "
            f"the first layer cannot mix the two); pass inputs_embeds.to({dtype})"
        )


def check_model_inputs(
    config, loss: str | None, inputs: Mapping[str, Any], *, labels: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Token ids, sequence lengths and labels of one call's inputs (see the functions above); ``dtype``: the model's."""
    for flag in ("output_hidden_states", "output_attentions"):
        if inputs.get(flag):
            raise InputError(
                f"{flag}=True is not supported by the pipelined forward: each stage holds only its own layers, and "
                f"only the head's outputs come back; run transformers' model on one device for per-layer outputs"
            )
    refuse_meta({**inputs, "labels": labels})
    batch = None
    if loss == "multiple_choice":
        # (batch, num_choices, length), as transformers' ForMultipleChoice heads take them: the checks
        # below see one (length,) row per choice, the labels one per example.
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() != 3:
            raise InputError(
                "input_ids of a multiple-choice head must be (batch, num_choices, length), got shape "
                f"{tuple(ids.shape)}"
            )
        ref = ids if isinstance(ids, torch.Tensor) else inputs.get("inputs_embeds")
        batch = ref.shape[0] if isinstance(ref, torch.Tensor) else None
        inputs = {
            k: v.flatten(0, 1) if isinstance(v, torch.Tensor) and v.dim() >= 3 and k != "labels" else v
            for k, v in inputs.items()
        }
    vocab = vocab_size(config)
    for key in ("input_ids", "decoder_input_ids"):
        if inputs.get(key) is not None:
            check_token_ids(inputs[key], vocab=vocab, what=key)
    check_index_inputs(config, inputs, dtype=dtype)
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(inputs.get(key), torch.Tensor) and inputs[key].dim() >= 2:
            check_sequence_length(config, inputs[key].shape[1], what=key)
            break
    _check_mask(inputs.get("attention_mask"), inputs.get("input_ids"))
    if labels is not None:
        num_labels = getattr(config, "num_labels", None)
        classes = loss == "sequence_classification" and isinstance(labels, torch.Tensor)
        kind = check_sequence_labels(config, labels) if classes else None
        check_labels(
            loss, labels, input_ids=inputs.get("input_ids"), decoder_input_ids=inputs.get("decoder_input_ids"),
            batch=batch, vocab=vocab, num_labels=num_labels if isinstance(num_labels, int) else None,
        )
        if kind is not None:
            # As transformers' forward: the first labelled call fixes config.problem_type, which the
            # next calls' labels must then fit (on every rank alike: the inputs are agreed).
            config.problem_type = getattr(config, "problem_type", None) or kind


def _check_mask(mask: Any, ids: Any) -> None:
    if not isinstance(mask, torch.Tensor) or not isinstance(ids, torch.Tensor):
        return
    if mask.dim() == 1:
        # transformers' forward broadcasts a (length,) mask over a batch of one; the pipeline cuts the
        # batch into microbatches along dim 0, which a 1-D mask does not have: refused, with the fix.
        raise InputError(
            f"attention_mask must be (batch, length) like input_ids {tuple(ids.shape)}, got shape "
            f"{tuple(mask.shape)} (1-D); pass attention_mask[None] for one sequence"
        )
    if mask.dim() == 2 and mask.shape != ids.shape:
        raise InputError(f"attention_mask shape {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
