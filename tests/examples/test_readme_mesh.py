"""README's mesh examples: the 70B LLaMA layout and the DeepSeek-V3 (mixture of experts) layout on 16 ranks are
what ``hf-pipeline plan`` prints today.

Each of the README's sections "Planning a mesh" and "Planning a mixture of experts" writes a config (its
Python block, a config.json only: the planner builds the model on the meta device), runs one command (its
bash block) and shows the output (its text block). This runs the block and the command in a
temporary directory and compares the output with the README's, line by line: a change to the
planner that moves a figure fails here until the README shows the new one.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from hf_pipeline import cli

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
HEADINGS = ("### Planning a mesh", "### Planning a mixture of experts")


def _blocks(heading: str) -> dict[str, str]:
    """The first python, bash and text blocks of the README's section under ``heading``."""
    text = README.read_text()
    section = text[text.index(heading):]
    section = section[: section.index("\n## ")]
    found: dict[str, str] = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        found.setdefault(lang, body)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("heading", HEADINGS)
def test_readme_mesh_example_is_what_plan_prints(heading, tmp_path, monkeypatch, capsys):
    blocks = _blocks(heading)
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks["python"], "README.md", "exec"), {})  # noqa: S102 - the README's own example
    argv = shlex.split(blocks["bash"].strip())
    assert argv[0] == "hf-pipeline", argv
    capsys.readouterr()
    assert cli.main(argv[1:]) == 0
    got = [line.rstrip() for line in capsys.readouterr().out.strip().splitlines()]
    want = [line.rstrip() for line in blocks["text"].strip().splitlines()]
    assert got == want, "\n".join(got)
