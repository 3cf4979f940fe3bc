"""Every load option is defined once (``hf_pipeline/load_options.py``), and each place that names the options
is derived from that definition or checked against it here, so they cannot drift apart.

What each test would catch: an option added to the resolver, the mesh request or the automatic choice but
not to ``LoadOptions`` (or the reverse); README's table edited by hand or left behind; a CLI flag of the
``model`` group that is no option, or an option with a flag the commands lack; ``from_pretrained`` taking
a keyword that is no option.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib

import pytest

from hf_pipeline import load_options
from hf_pipeline.errors import InputError, InputTypeError
from hf_pipeline.load_options import ACTS, ALIASES, CONCERNS, NO_OPS, LoadOptions, cli_fields, option_names

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _keywords(function) -> set[str]:
    return {n for n, p in inspect.signature(function).parameters.items() if p.kind is p.KEYWORD_ONLY}


def test_every_option_is_documented_with_its_concern_and_where_it_acts():
    for f in dataclasses.fields(LoadOptions):
        assert len(f.metadata["doc"].split()) >= 5, f"{f.name}: say what the option does in its doc"
        assert f.metadata["concern"] in CONCERNS and f.metadata["acts"] in ACTS, f.name
    assert set(ALIASES.values()) <= set(option_names()) and not set(NO_OPS) & set(option_names())


def test_the_resolver_takes_exactly_the_options_that_act_there():
    from hf_pipeline.planning.options import PipelineOptions

    # the model class from the Auto class called, the mesh request made below, what the default's choice sets
    own = {"auto_class", "parallel", "schedule_note", "adapt_microbatches"}
    assert _keywords(PipelineOptions.resolve) - own == set(LoadOptions().acting_in("resolve"))


def test_the_mesh_request_takes_exactly_the_mesh_options():
    from hf_pipeline.planning.tp_plan import parallel_request

    assert _keywords(parallel_request) - {"world_size"} == set(LoadOptions().acting_in("mesh"))


def test_the_automatic_choice_takes_the_options_that_act_there():
    from hf_pipeline.memory.auto_choice_costs import chooser

    assert set(LoadOptions().acting_in("choose")) == _keywords(chooser)


def test_the_checkpoint_is_found_with_the_options_that_act_there():
    from hf_pipeline.loading.checkpoint_files import resolve_checkpoint

    read = set(LoadOptions().acting_in("read")) - {"config", "attn_implementation", "trust_remote_code"}
    assert read <= _keywords(resolve_checkpoint)


def test_readme_holds_the_generated_options_table():
    readme = (ROOT / "README.md").read_text()
    assert load_options.options_table() in readme, (
        "README's options table is generated: paste `python -c 'from hf_pipeline.load_options import "
        "options_table; print(options_table())'` in place of the old one"
    )


@pytest.mark.parametrize("command", ["generate", "serve", "train"])
def test_model_flags_of_each_loading_command_are_the_options_with_a_flag(command, tmp_path):
    from hf_pipeline.cli.arguments import load_kwargs
    from hf_pipeline.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    group = next(g for g in sub._action_groups if g.title == "model")
    flags = {a.dest for a in group._group_actions} - {"model", "download"}
    assert flags == {f.name for f in cli_fields()}
    data = tmp_path / "data.txt"
    data.write_text("some words\n")
    argv = [command] + (["--output-dir", str(tmp_path / "out"), "--data", str(data)] if command == "train" else [])
    args = parser.parse_args([*argv, "--tp-size", "2", "--device", "cpu", "--dtype", "bf16"])
    assert load_kwargs(args) == {"tp_size": 2, "device": "cpu", "dtype": "bf16"}  # only what was given
    assert load_kwargs(parser.parse_args(argv)) == {}


def test_from_kwargs_takes_options_aliases_and_no_ops_and_refuses_the_rest():
    got = LoadOptions.from_kwargs({"torch_dtype": "bf16", "low_cpu_mem_usage": True, "tp_size": 2})
    assert (got.dtype, got.tp_size) == ("bf16", 2)
    assert LoadOptions.from_kwargs({"torch_dtype": "bf16", "dtype": "fp32"}).dtype == "fp32"  # as transformers
    with pytest.raises(InputTypeError, match=r"unexpected argument\(s\) \['n_micro_batches'\]"):
        LoadOptions.from_kwargs({"n_micro_batches": 2})
    with pytest.raises(InputError, match="device_map='auto' is not supported with pipeline=True"):
        LoadOptions.from_kwargs({"device_map": "auto"})
