"""A process of ``--num-processes N`` ends with its launcher, however the launcher ends: by the Linux
parent-death signal alone, by the watch on its parent alone (the portable fallback), and when the
launcher was gone before the process looked. The launcher here is a stand-in that starts one process
the way torch's does (a child with ``HF_PIPELINE_LAUNCHER_PID``) and is then SIGKILLed."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 60.0  # the watch looks every 0.5 s; room for a loaded machine
# The launched process: one of the two ways to notice the launcher's death switched off, then waits.
PROCESS = """
import importlib, sys, time
launch = importlib.import_module("hf_pipeline.cli.launch")  # the module (the package's `launch` is its function)
if sys.argv[1] == "watch":
    launch._parent_death_signal = lambda sig: None
elif sys.argv[1] == "signal":
    launch._watch = lambda pid: None
launch.follow_launcher()
print("following", flush=True)
time.sleep(600)
"""
# The stand-in launcher: starts the process, says its pid, waits to be killed.
LAUNCHER = """
import os, subprocess, sys, time
env = {**os.environ, "HF_PIPELINE_LAUNCHER_PID": str(os.getpid())}
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env, start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("HF_PIPELINE_LAUNCHER_PID", None)
    return env


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int) -> bool:
    end = time.monotonic() + DEADLINE_S
    while not _gone(pid) and time.monotonic() < end:
        time.sleep(0.2)
    return _gone(pid)


def _line(stream, timeout: float = DEADLINE_S) -> str:
    """The next line of ``stream``, or "" when none comes within ``timeout`` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline().strip() if ready else ""


@pytest.mark.dist
@pytest.mark.parametrize("way", ["signal", "watch"])
def test_a_launched_process_ends_when_its_launcher_is_killed(way):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, PROCESS, way], env=_env(), stdout=subprocess.PIPE,
                                text=True)
    pid = None
    try:
        pid = int(_line(launcher.stdout))
        assert _line(launcher.stdout) == "following"  # the process shares the launcher's stdout
        launcher.kill()
        launcher.wait(timeout=30)
        assert _wait_gone(pid), f"process {pid} outlived its launcher ({way})"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.dist
def test_a_process_whose_launcher_is_already_gone_ends():
    # Started by this test, it is told to follow another process: its launcher died before it looked.
    with subprocess.Popen(["sleep", "600"]) as other:
        env = {**_env(), "HF_PIPELINE_LAUNCHER_PID": str(other.pid)}
        proc = subprocess.Popen([sys.executable, "-c", PROCESS, "watch"], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.wait(timeout=DEADLINE_S) == -signal.SIGTERM  # from its own watch
        finally:
            other.kill()
            if proc.poll() is None:
                proc.kill()
