"""``python -m devtools.house_figures`` on this checkout: it runs, and its figures agree with the house rules'
tests."""

from __future__ import annotations

import pathlib

import pytest

from devtools import house_figures

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.dist  # runs ruff in a subprocess
def test_house_figures_of_this_checkout_meet_the_rules(tmp_path, capsys):
    got = house_figures.figures(ROOT)
    assert got["modules over 500 lines (package, scripts, benchmarks, devtools)"] == 0
    assert got["functions over 80 lines"] == 0
    assert got["builtin raises in hf_pipeline"] == 0
    assert got["private library names reached outside compat.py"] == 0
    assert got["ruff violations"] == 0
    assert got["package folders"] >= 9 and got["largest module (package)"] <= 500
    # The same probes see a violation: a copy of the package with one builtin raise and one long module.
    bad = tmp_path / "tree"
    (bad / "hf_pipeline").mkdir(parents=True)
    (bad / "scripts").mkdir()
    (bad / "tests").mkdir()
    (bad / "hf_pipeline" / "x.py").write_text("def f():\n    raise ValueError('x')\n" + "y = 1\n" * 600)
    (bad / "scripts" / "s.py").write_text("z = 2\n")
    worse = house_figures.figures(bad)
    assert worse["builtin raises in hf_pipeline"] == 1
    assert worse["modules over 500 lines (package, scripts, benchmarks, devtools)"] == 1
    house_figures.main([str(bad)])
    assert "builtin raises in hf_pipeline: 1" in capsys.readouterr().out
