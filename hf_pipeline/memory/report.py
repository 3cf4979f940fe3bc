"""The memory planner's answer: a stage table and per-rank peaks, printable and as JSON.

:class:`StageMemory` (one stage's weights, activations per microbatch, P2P and KV-cache bytes),
:class:`RankMemory` (one pipeline rank's predicted peaks for training and generation) and
:class:`MemoryReport` (both tables, with ``str()``, ``to_markdown()`` and ``to_json()``), as
:func:`hf_pipeline.memory.planner.plan_report` fills them.

Example:
    >>> report = plan_report("path/to/llama", stages=4, dtype="bf16", batch=8, seq=2048)
    >>> print(report)                 # the stage table and the per-rank peaks
    >>> report.to_json()              # the same, for machines
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..planning.plan import compress_blocks, human_count
from .mesh_shares import human_bytes as _human

__all__ = ["MemoryReport", "RankMemory", "StageMemory"]

_count = human_count  # the plan's own format, so the two reports agree


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Predicted memory of one stage."""

    index: int
    rank: int
    modules: tuple[str, ...]
    params: int
    weight_bytes: int
    activation_bytes: int  # kept alive for backward by one microbatch (training)
    checkpointed_activation_bytes: int  # the same with activation checkpointing (the report's every_n_layers)
    recompute_bytes: int  # with checkpointing: how far a microbatch's backward (block recomputes) goes above it
    send_bytes: int  # sent to the next stage per microbatch
    recv_bytes: int  # received from the previous stage per microbatch
    # per sequence, over this stage's decoder layers (sliding ones: until the window is full)
    kv_bytes_per_token: int
    # batch x seq tokens over this stage's decoder layers, sliding-window layers capped at the window
    kv_cache_bytes: int
    largest_unit_bytes: int = 0  # the largest block (or the stage's other modules together): what fsdp gathers
    expert_bytes: int = 0  # of weight_bytes, the rank's routed experts' (left out of fsdp with ep_over="data")


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Predicted peaks of one pipeline rank."""

    rank: int
    stages: tuple[int, ...]
    weight_bytes: int
    grad_bytes: int
    in_flight: dict[int, int]  # stage -> microbatches whose activations are alive at the peak
    activation_bytes: int  # peak live activations
    p2p_buffer_bytes: int
    train_peak_bytes: int
    checkpointed_activation_bytes: int  # peak live activations with activation checkpointing (+ one recompute)
    checkpointed_train_peak_bytes: int
    kv_cache_bytes: int  # batch x seq tokens
    generate_peak_bytes: int


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """The planner's answer: a stage table and per-rank peaks. ``str()`` / ``to_markdown()`` / ``to_json()``."""

    model: str
    model_class: str
    dtype: str
    num_stages: int
    pp_size: int
    virtual_stages: int
    schedule: str
    batch: int
    seq: int
    n_microbatches: int
    microbatch_size: int
    stages: tuple[StageMemory, ...]
    ranks: tuple[RankMemory, ...]
    total_params: int
    total_weight_bytes: int
    checkpoint_every_n_layers: int = 1  # the activation checkpointing the "with checkpointing" figures assume
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r in d["ranks"]:
            r["in_flight"] = {str(k): v for k, v in r["in_flight"].items()}
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 2), **kwargs)

    def _header(self) -> str:
        return (
            f"{self.model} ({self.model_class}), {self.dtype}: {self.num_stages} stages on {self.pp_size} rank(s) "
            f"({self.virtual_stages} per rank), schedule {self.schedule}, batch {self.batch} x seq {self.seq} in "
            f"{self.n_microbatches} microbatches of {self.microbatch_size}; {_count(self.total_params)} params, "
            f"{_human(self.total_weight_bytes)} of weights"
        )

    def _tables(self) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
        ckpt = f"ckpt every {self.checkpoint_every_n_layers}"
        stage_rows = [("stage", "rank", "modules", "params", "weights", "activations / microbatch",
                       f"({ckpt})", "sent / microbatch", "KV cache / token")]
        for s in self.stages:
            stage_rows.append((
                str(s.index), str(s.rank), _compress_modules(s.modules), _count(s.params), _human(s.weight_bytes),
                _human(s.activation_bytes), _human(s.checkpointed_activation_bytes), _human(s.send_bytes),
                _human(s.kv_bytes_per_token),
            ))
        rank_rows = [("rank", "stages", "weights", "grads", "activations (in flight)", "P2P buffers", "train peak",
                      f"activations ({ckpt})", f"train peak ({ckpt})", f"KV cache ({self.batch}x{self.seq})",
                      "generate peak")]
        for r in self.ranks:
            flight = ", ".join(f"s{k}:{v}" for k, v in r.in_flight.items())
            rank_rows.append((
                str(r.rank), ",".join(map(str, r.stages)), _human(r.weight_bytes), _human(r.grad_bytes),
                f"{_human(r.activation_bytes)} ({flight})", _human(r.p2p_buffer_bytes), _human(r.train_peak_bytes),
                _human(r.checkpointed_activation_bytes), _human(r.checkpointed_train_peak_bytes),
                _human(r.kv_cache_bytes), _human(r.generate_peak_bytes),
            ))
        return stage_rows, rank_rows

    def __str__(self) -> str:
        def table(rows):
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

        stage_rows, rank_rows = self._tables()
        parts = [self._header(), table(stage_rows), "", "Predicted peak per rank:", table(rank_rows)]
        parts += [f"note: {n}" for n in self.notes]
        return "\n".join(parts)

    def to_markdown(self) -> str:
        def table(rows):
            out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows[1:]]
            return "\n".join(out)

        stage_rows, rank_rows = self._tables()
        parts = [self._header(), "", table(stage_rows), "", "Predicted peak per rank:", "", table(rank_rows)]
        if self.notes:
            parts += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(parts) + "\n"


def _compress_modules(modules: Sequence[str]) -> str:
    blocks = [m for m in modules if m.rpartition(".")[2].isdigit()]
    others = [m for m in modules if m not in blocks]
    return ", ".join(([compress_blocks(blocks)] if blocks else []) + others)
