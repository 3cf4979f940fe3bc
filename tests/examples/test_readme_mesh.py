"""README's mesh example: the 70B LLaMA layout on 16 ranks is what ``hf-pipeline plan`` prints today.

The README's section "Planning a mesh" writes a config (its Python block), runs one command (its
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
HEADING = "### Planning a mesh"


def _blocks() -> dict[str, str]:
    """The first python, bash and text blocks of the README's mesh-planning section."""
    text = README.read_text()
    section = text[text.index(HEADING):]
    section = section[: section.index("\n## ")]
    found: dict[str, str] = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        found.setdefault(lang, body)
    return found


@pytest.mark.slow
def test_readme_mesh_example_is_what_plan_prints(tmp_path, monkeypatch, capsys):
    blocks = _blocks()
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks["python"], "README.md", "exec"), {})  # noqa: S102 - the README's own example
    argv = shlex.split(blocks["bash"].strip())
    assert argv[0] == "hf-pipeline", argv
    capsys.readouterr()
    assert cli.main(argv[1:]) == 0
    got = [line.rstrip() for line in capsys.readouterr().out.strip().splitlines()]
    want = [line.rstrip() for line in blocks["text"].strip().splitlines()]
    assert got == want, "\n".join(got)
