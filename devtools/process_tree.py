"""Stopping a launched server and every process it started: a launcher (``hf-pipeline serve``, torchrun,
``transformers serve``) whose ranks or workers may sit in sessions of their own, so killing the launcher's
process group alone can leave them running. Shared by the tests' live servers and the benchmark's."""

from __future__ import annotations

import os
import signal
import subprocess


def kill_tree(proc: subprocess.Popen, children: list, *, wait_s: float = 60) -> None:
    """Kill ``children`` (``psutil`` processes listed while the launcher ran), then ``proc``'s process group."""
    for p in children:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=wait_s)
