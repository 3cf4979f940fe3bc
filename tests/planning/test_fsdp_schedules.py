"""Which schedules FSDP stages train with: all of them (``planning.mesh_rules.FSDP_REFUSED_SCHEDULES`` is empty),
and a schedule put in that table is refused by name with its reason. The numbers of the zero-bubble ones
under FSDP: tests/training/test_fsdp_zero_bubble.py."""

from __future__ import annotations

import pytest
import tiny

from hf_pipeline.errors import InputError
from hf_pipeline.planning import mesh_rules
from hf_pipeline.planning.options import PipelineOptions
from hf_pipeline.planning.tp_plan import ParallelRequest

ZERO_BUBBLE = ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")


def _resolve(schedule: str) -> PipelineOptions:
    return PipelineOptions.resolve(
        tiny.config_for("llama"), 4, parallel=ParallelRequest(fsdp_size=2), auto_class="AutoModelForCausalLM",
        schedule=schedule, virtual_stages=2, n_microbatches=4,
    )


def test_zero_bubble_schedules_resolve_with_fsdp(monkeypatch):
    assert mesh_rules.FSDP_REFUSED_SCHEDULES == {}
    for schedule in ZERO_BUBBLE:
        opts = _resolve(schedule)
        assert (opts.schedule.name, opts.pp_size, opts.fsdp_size) == (schedule, 2, 2)
    monkeypatch.setitem(mesh_rules.FSDP_REFUSED_SCHEDULES, "dualpipev", "its halves overlap")
    with pytest.raises(InputError, match=r"fsdp_size=2 with the schedule 'dualpipev' is not supported \(its halves"):
        _resolve("dualpipev")
    _resolve("zbv-zero-bubble")  # the others still run
