"""Tier 1: PipelineOptions check themselves however they are made (resolve or dataclasses.replace)."""

import dataclasses

import pytest
import tiny

from hf_pipeline.errors import InputError, ScheduleError
from hf_pipeline.planning.options import PipelineOptions


def _options(**kw):
    return PipelineOptions.resolve(tiny.config_for("llama"), 2, auto_class="AutoModelForCausalLM", **kw)


def test_resolved_options_fill_the_defaults():
    opts = _options(virtual_stages=2)
    assert (opts.schedule.name, opts.num_stages, opts.pp_size, opts.dp_size, opts.n_microbatches) == (
        "interleaved-1f1b", 4, 2, 1, 4,
    )


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_n_microbatches_refused_as_given_and_through_replace(bad):
    message = rf"n_microbatches must be a positive integer, got {bad!r}"
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _options(n_microbatches=bad)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(_options(), n_microbatches=bad)


def test_replace_checks_the_placement():
    opts = _options()
    with pytest.raises(ScheduleError, match=r"schedule '1f1b' needs virtual_stages 1 per rank, got 2"):
        dataclasses.replace(opts, virtual_stages=2, num_stages=4)
    with pytest.raises(InputError, match=r"num_stages=3 must be pp_size x virtual_stages = 2 x 1"):
        dataclasses.replace(opts, num_stages=3)
