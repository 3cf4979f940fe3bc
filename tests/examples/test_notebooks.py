"""Every notebook in notebooks/ runs top to bottom at tiny size (nbclient), with no error cell.

Each notebook launches its distributed part on 2 CPU processes with ``accelerate.notebook_launcher``
and ends with cells that compare its numbers with plain transformers on one process (asserts in the
notebook), so a passing run means: the launch worked, the pipelined result equals transformers', and
the plan, the timeline picture and the results were shown.
"""

from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 240  # one cell; the launch cells are the long ones (seconds at tiny size)


def test_there_are_five_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"]


def _outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == kind]


@pytest.mark.dist
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    for key, value in {
        "NOTEBOOK_TINY": "1", "NUM_PROCESSES": "2", "OMP_NUM_THREADS": "1", "HF_PIPELINE_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": f"{ROOT}",
    }.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this environment
    nb = nbformat.read(path, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "one cell tagged 'parameters' (papermill-style) holds the notebook's knobs"
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError (with the cell and traceback) on the first error cell
    assert not _outputs(nb, "error")
    shown = [o for o in _outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert shown, "the timeline picture is displayed"
    text = "".join(o.get("text", "") for o in _outputs(nb, "stream"))
    assert "StagePlan" in text or "stage  rank" in text, "the plan is shown"


def _saved_text(path) -> str:
    nb = nbformat.read(path, as_version=4)
    assert not _outputs(nb, "error")
    return "".join(o.get("text", "") for o in _outputs(nb, "stream"))


@pytest.mark.parametrize("stem", ["03_t5_seq2seq_pipelined", "04_bert_embeddings_fill_mask"])
def test_saved_outputs_are_a_full_run_of_the_bundled_models(stem):
    """The outputs stored in the notebook are a full-size run (every training step's loss printed) that makes sense."""
    import re

    path = ROOT / "notebooks" / f"{stem}.ipynb"
    nb = nbformat.read(path, as_version=4)
    steps = int(re.search(r"STEPS = \d+ if TINY else (\d+)", nb.cells[1].source).group(1))
    text = _saved_text(path)
    losses = re.search(r"^(?:MLM )?loss: (.*)$", text, re.M).group(1).split()
    assert len(losses) == steps, "saved from a NOTEBOOK_TINY run; execute the notebook at full size and save it"
    if stem.startswith("03"):
        # Each summary shares most of its words with the docstring's first sentence.
        pairs = re.findall(r"first sentence: (.*)\n  model: +(.*)", text)
        assert len(pairs) == 4
        for want, got in pairs:
            assert sum(w in got.split() for w in want.split()) >= 0.6 * len(want.split()), (want, got)
    else:
        tops = re.findall(r"top 5: (\[.*\])", text)
        # not just frequent words
        assert len(tops) == 4 and all(t.split("'")[1].strip() not in ("the", ",", ".") for t in tops), tops
        assert any(w in tops[0] for w in ("name", "size", "path", "contents", "length", "mode")), tops[0]


def test_saved_outputs_of_the_lora_notebook_are_a_full_run_that_learns():
    """05's stored outputs: every step's loss of a full-size run, falling, equal to transformers.Trainer + peft."""
    import re

    path = ROOT / "notebooks" / "05_finetune_lora.ipynb"
    nb = nbformat.read(path, as_version=4)
    steps = int(re.search(r"STEPS = \d+ if TINY else (\d+)", nb.cells[1].source).group(1))
    text = _saved_text(path)
    losses = [float(v) for v in re.search(r"^loss: (.*)$", text, re.M).group(1).split()]
    assert len(losses) == steps, "saved from a NOTEBOOK_TINY run; execute the notebook at full size and save it"
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses  # the adapter learned the text
    worst = float(re.search(r"largest difference from transformers.Trainer \+ peft: (\S+)", text).group(1))
    # fp32 parameters after a full LoRA run vs Trainer + peft: noise accumulates over the steps to ~1e-5; a wrong
    # step moves them ~lr.
    assert worst < 1e-4
    assert any("image/png" in o.get("data", {}) for o in _outputs(nb, "display_data")), "the loss curve is shown"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_saved_outputs_name_no_machine_paths(path):
    # What a notebook shows was run on someone's machine; its paths must read the same on any checkout:
    # relative to the repository (hf_pipeline/assets/...), site-packages without the interpreter's prefix.
    import re

    text = path.read_text()
    found = sorted(set(re.findall(r"/(?:work|root|home|tmp|Users|usr)/[^\s\"'\\]*", text)))
    assert not found, (
        f"{path.name}'s saved outputs carry paths of the machine they ran on: {found[:5]}; write them relative to "
        "the repository before committing"
    )
