"""Hub ids resolve from the local cache first, with no network request, at every entry point.

A fake huggingface_hub cache (``HF_HOME/hub/models--org--name/snapshots/<rev>/...`` and
``refs/main``, the files symlinks as the hub client writes them) holds the bundled model under
the id ``org/name``. ``HF_HUB_OFFLINE`` is *unset* and ``HF_ENDPOINT`` points to a local socket
that counts connections and closes them at once: a cached id must cost zero connections (no
request, no retry), and an id that is not cached must be one line on stderr and exit code 2,
also without a connection. The time bound on each command only guards against a hang.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import threading

import pytest

from hf_pipeline.errors import CheckpointExistsError, CheckpointNotFoundError, InputError, InternalError, RankError
from hf_pipeline.loading.checkpoint_files import resolve_checkpoint
from hf_pipeline.tools.default_model import BUNDLED_MODEL_DIR

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPO, MISSING = "org/name", "org/not-downloaded"
REVISION = "0123456789abcdef0123456789abcdef01234567"
HANG_GUARD_S = 180  # generous: a cached id takes seconds; a network wait would be minutes


def _fake_cache(home: pathlib.Path) -> pathlib.Path:
    """``home/hub`` with ``REPO`` cached at ``REVISION`` (blobs + snapshot symlinks + refs/main)."""
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in BUNDLED_MODEL_DIR.iterdir():
        blob = repo / "blobs" / f.name  # the hub names blobs by hash; the layout is what matters here
        os.symlink(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


class _Endpoint:
    """A local "hub" that counts connections and closes each at once (a client fails fast instead of hanging)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.connections = 0
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # conftest sets it; here the cache must suffice alone
    home = tmp_path / "hf-home"
    snapshot = _fake_cache(home)
    endpoint = _Endpoint()
    env = dict(os.environ)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE",
                "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(HF_HOME=str(home), HF_ENDPOINT=endpoint.url, OMP_NUM_THREADS="1", HF_PIPELINE_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    yield env, endpoint, snapshot, home
    endpoint.close()


def _run(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT
    )


# ------------------------------------------------------------------------------------------ library
def test_resolve_checkpoint_finds_a_cached_id_and_names_an_uncached_one(hub):
    _, endpoint, snapshot, home = hub
    assert resolve_checkpoint(REPO, cache_dir=home / "hub") == snapshot
    assert resolve_checkpoint(REPO, cache_dir=home / "hub", revision=REVISION) == snapshot
    with pytest.raises(CheckpointNotFoundError) as e:
        resolve_checkpoint(MISSING, cache_dir=home / "hub")
    first = str(e.value).splitlines()[0]
    assert MISSING in first and "not in the local Hugging Face cache" in first, first
    assert endpoint.connections == 0


def test_download_when_asked_still_respects_offline(hub, monkeypatch):
    from huggingface_hub import constants

    _, endpoint, _, home = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointNotFoundError, match="not in the local Hugging Face cache"):
        resolve_checkpoint(MISSING, cache_dir=home / "hub", download=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(CheckpointNotFoundError):
        resolve_checkpoint(MISSING, cache_dir=home / "hub", download=True)
    assert endpoint.connections == 0


# ------------------------------------------------------------------------------------------ CLI and scripts
@pytest.mark.dist
def test_cli_plan_generate_and_train_read_a_cached_id_without_the_network(hub, tmp_path):
    env, endpoint, snapshot, _ = hub
    plan = _run(env, "-m", "hf_pipeline.cli", "plan", REPO, "--stages", "2", "--json")
    assert plan.returncode == 0, plan.stderr[-3000:]
    gen = _run(
        env,
        "-m",
        "hf_pipeline.cli",
        "generate",
        "--model",
        REPO,
        "--max-new-tokens",
        "2",
        "--json",
        "--device",
        "cpu",
        "Return the",
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert '"model": "org/name"' in gen.stdout, gen.stdout
    data = tmp_path / "data.txt"
    data.write_text("\n".join(["Return the sum of the items.", "Open the file for reading."] * 8), encoding="utf-8")
    train = _run(
        env,
        "-m",
        "hf_pipeline.cli",
        "train",
        "--model",
        REPO,
        "--data",
        str(data),
        "--output-dir",
        str(tmp_path / "out"),
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--block-size",
        "8",
        "--device",
        "cpu",
        "--no-progress",
    )
    assert train.returncode == 0, train.stderr[-3000:]
    script = _run(
        env,
        "scripts/generate.py",
        "--model",
        REPO,
        "--prompt",
        "Return the",
        "--max-new-tokens",
        "2",
        "--json",
        "--device",
        "cpu",
    )
    assert script.returncode == 0, script.stderr[-3000:]
    assert endpoint.connections == 0, "a cached id reached the network"
    assert "retry" not in (plan.stderr + gen.stderr + train.stderr + script.stderr).lower()


@pytest.mark.dist
@pytest.mark.parametrize("argv", [
    ["plan", MISSING],
    ["generate", "--model", MISSING],
    ["train", "--model", MISSING, "--data", "README.md", "--output-dir", "unused-out"],
    ["convert", MISSING, "unused-out", "--stages", "2"],
], ids=["plan", "generate", "train", "convert"])
def test_cli_uncached_id_is_one_line_and_exit_2(hub, argv):
    env, endpoint, _, _ = hub
    proc = _run(env, "-m", "hf_pipeline.cli", *argv)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-pipeline: error: "), proc.stderr
    assert MISSING in lines[0] and "not in the local Hugging Face cache" in lines[0], lines[0]
    assert endpoint.connections == 0
    assert not (ROOT / "unused-out").exists()


# ------------------------------------------------------------------------------------------ which errors are mistakes
def test_user_errors_are_decided_by_the_library_types():
    from hf_pipeline import cli

    assert cli._is_user_error(CheckpointNotFoundError("x")) and cli._is_user_error(InputError("x"))
    # Only the library's classes say "mistake": a builtin error is a traceback (the CLI converts the mistakes it
    # can name, where it calls a library, into a CLIError naming the argument).
    assert not cli._is_user_error(FileNotFoundError("x")) and not cli._is_user_error(ValueError("x"))
    assert not cli._is_user_error(RuntimeError("x")) and not cli._is_user_error(KeyError("x"))
    assert not cli._is_user_error(InternalError("x")) and cli._is_user_error(CheckpointExistsError("x"))
    assert not cli._is_user_error(OSError("x"))  # e.g. transformers failing to read a file: a traceback

    def rank_error(*kinds: str) -> RankError:
        return RankError("m", failures={r: (k, "m", None) for r, k in enumerate(kinds)})

    assert cli._is_user_error(rank_error("CheckpointNotFoundError", "InputError"))
    assert not cli._is_user_error(rank_error("ValueError"))
    assert not cli._is_user_error(rank_error("InputError", "RuntimeError"))
    assert not cli._is_user_error(rank_error("ConnectionError"))  # a lost peer
    assert not cli._is_user_error(rank_error("SomeErrorNobodyDefines"))
    assert not cli._is_user_error(rank_error("RankError"))
