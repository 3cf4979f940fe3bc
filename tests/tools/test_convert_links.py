"""convert copies only the checkpoint's own files: a link out of the source is skipped with a warning,
never followed (a README linked to a private file stays out of the output); links inside it and a
hub cache snapshot's links to its blobs are copied as their content."""

from __future__ import annotations

import pathlib
import shutil

import pytest
import tiny

from hf_pipeline.tools.convert import convert_to_stages

pytestmark = pytest.mark.unit


def test_links_out_of_the_source_are_not_copied(tmp_path, capsys):
    src = tiny.make_checkpoint(tmp_path / "src", "llama")
    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    (src / "README.md").symlink_to(secret)
    (src / "notes.txt").write_text("own notes")
    (src / "NOTES.md").symlink_to("notes.txt")  # a link inside the checkpoint: its content is copied
    (src / "docs").mkdir()
    (src / "docs" / "guide.md").write_text("guide")
    (src / "docs" / "leak.md").symlink_to(secret)
    (src / "home").symlink_to(tmp_path, target_is_directory=True)
    out = tmp_path / "out"
    convert_to_stages(src, out, num_stages=2)
    copied = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and "safetensors" not in p.name}
    assert {"notes.txt", "NOTES.md", "docs/guide.md", "config.json"} <= copied
    assert not {"README.md", "docs/leak.md"} & copied and not (out / "home").exists(), copied
    assert not any("private key" in p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file())
    assert (out / "NOTES.md").read_text() == "own notes" and not (out / "NOTES.md").is_symlink()
    err = capsys.readouterr().err
    assert f"not copying {src / 'README.md'}: it is a link to outside the checkpoint" in err, err
    assert f"not copying {src / 'docs' / 'leak.md'}" in err, err


def test_a_hub_cache_snapshot_whose_files_link_to_its_blobs_is_copied(tmp_path):
    made = tiny.make_checkpoint(tmp_path / "made", "llama")
    (made / "README.md").write_text("# tiny llama\n")
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(made.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(pathlib.Path("../../blobs") / blob.name)
    out = tmp_path / "out"
    convert_to_stages(snapshot, out, num_stages=2)
    assert (out / "README.md").read_text() == "# tiny llama\n"
