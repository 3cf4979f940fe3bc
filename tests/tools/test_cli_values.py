"""Every numeric flag of every command is checked by the parser, and a missing extra is one line naming it.

A bad number (``train --weight-decay -1``, ``generate --top-p 1.5``, ``serve --port 70000``) is one
``hf-pipeline: error:`` line from the parser, before any model loads; ``hf-pipeline serve`` without
FastAPI / uvicorn says which extra to install instead of a ModuleNotFoundError traceback (simulated
here with ``sys.modules[name] = None``, which makes ``import name`` fail as if it were not installed).
"""

from __future__ import annotations

import argparse
import sys

import pytest
from test_cli_mistakes import _one_line, no_load  # noqa: F401 - the fixture is used by name

from hf_pipeline import cli
from hf_pipeline.cli.parser import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_no_numeric_flag_is_read_with_a_bare_int_or_float():
    # The class behind `train --weight-decay -1`: a flag read with type=float accepts any number, and the
    # mistake surfaces only where the value is used, after the model loaded. Every numeric flag has a
    # checked type (a range), so a new flag cannot slip back.
    bare = []
    for command, parser in _commands().items():
        for action in parser._actions:
            numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
            if action.type in (int, float) or (numeric_default and action.type is None and action.nargs != 0):
                bare.append(f"{command} {action.option_strings[0]}")
    assert not bare, f"numeric flags without a checked type: {bare}"


def _train(tmp_path, *flags):
    data = tmp_path / "notes.txt"
    data.write_text("Return the sum of the items.\n" * 8, encoding="utf-8")
    return ["train", "--data", str(data), "--output-dir", str(tmp_path / "out"), *flags]


@pytest.mark.parametrize(
    "command, flags, said",
    [
        ("train", ["--weight-decay", "-1"], "argument --weight-decay: must be >= 0, got -1.0"),
        ("train", ["--weight-decay", "nan"], "argument --weight-decay: must be a finite number, got nan"),
        ("train", ["--lr", "inf"], "argument --lr: must be a finite number, got inf"),
        ("train", ["--lr", "0"], "argument --lr: must be > 0, got 0.0"),
        ("train", ["--mlm-probability", "1.5"], r"argument --mlm-probability: must be in (0, 1], got 1.5"),
        ("train", ["--max-grad-norm", "-0.5"], "argument --max-grad-norm: must be > 0, got -0.5"),
        ("train", ["--seed", "-3"], "argument --seed: must be in 0..4294967295, got -3"),
        ("train", ["--seed", "1.5"], "argument --seed: '1.5' is not a whole number"),
        ("generate", ["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
        ("generate", ["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0.0"),
        ("generate", ["--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
        ("generate", ["--seed", "99999999999"], "argument --seed: must be in 0..4294967295, got 99999999999"),
        ("generate", ["--machine-rank", "-1"], "argument --machine-rank/--machine_rank: must be >= 0, got -1"),
        ("generate", ["--main-process-port", "0"], "argument --main-process-port/--main_process_port: must be in "
         "1..65535, got 0"),
        ("serve", ["--port", "70000"], "argument --port: must be in 1..65535, got 70000"),
        ("serve", ["--request-timeout", "-5"], "argument --request-timeout: must be > 0, got -5.0"),
    ],
)
def test_a_bad_number_is_one_line_before_anything_loads(tmp_path, capsys, no_load, command, flags, said):  # noqa: F811
    argv = _train(tmp_path, *flags) if command == "train" else [command, *flags]
    assert _one_line(capsys, argv) == f"{said} (see `hf-pipeline {command} --help`)"
    assert not (tmp_path / "out").exists()


def test_good_numbers_still_parse():
    args = build_parser().parse_args(["generate", "--top-p", "1", "--temperature", "0.7", "--seed", "0",
                                      "--main-process-port", "29500"])
    assert (args.top_p, args.temperature, args.seed, args.main_process_port) == (1.0, 0.7, 0, 29500)
    args = build_parser().parse_args(["train", "--data", ".", "--output-dir", "o", "--weight-decay", "0",
                                      "--mlm-probability", "1"])
    assert (args.weight_decay, args.mlm_probability) == (0.0, 1.0)


@pytest.mark.parametrize("missing", [("fastapi",), ("uvicorn",), ("prometheus_client",), ("fastapi", "uvicorn")])
@pytest.mark.parametrize("launch", [False, True])
def test_serve_without_the_serve_extra_is_one_line_naming_it(capsys, monkeypatch, no_load, missing, launch):  # noqa: F811
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now fails as if it were not installed
    monkeypatch.delitem(sys.modules, "hf_pipeline.serving.server", raising=False)  # imported afresh if reached

    def launch(*args, **kwargs):  # the started processes would not see the missing module: check first
        raise AssertionError("processes were launched before the serve extra was checked")

    monkeypatch.setattr(cli, "launch", launch)
    argv = ["serve", "--num-processes", "2"] if launch else ["serve"]  # a launch checks before starting anyone
    assert _one_line(capsys, argv) == (
        f"hf-pipeline serve needs fastapi, uvicorn and prometheus_client ({' and '.join(missing)} cannot be imported): "
        "pip install 'hf_pipeline[serve]'"
    )
