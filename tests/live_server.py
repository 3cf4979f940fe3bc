"""A live ``hf-pipeline serve`` for the tests: started as a user would (the CLI, its own launcher), on
127.0.0.1 at a free port, with the environment every rank gets in tests (1 thread, offline, gloo on
loopback); stopped with everything it started, always.

Example:
    >>> server = start_server(model_dir, tmp_path / "server.log", "--max-batch", "2")
    >>> try:
    ...     httpx.get(f"{server.url}/health")
    ... finally:
    ...     server.stop()
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass, field

from harness import free_port

from devtools.process_tree import kill_tree

__all__ = ["ROOT", "STARTUP_S", "LiveServer", "rss_bytes", "start_server"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
STARTUP_S = 240.0  # two processes importing torch and transformers on a loaded 2-core machine


@dataclass
class LiveServer:
    """A started server: its launcher process, port, log file, and (once up) the ranks' processes."""

    proc: subprocess.Popen
    port: int
    log: pathlib.Path
    children: list = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ranks(self) -> list:
        """The rank processes (psutil) the launcher started."""
        return [c for c in self.children if "hf_pipeline.cli" in " ".join(c.cmdline())]

    def wait_up(self) -> None:
        """Wait until ``/health`` says ok (the launcher must not exit meanwhile); note its processes."""
        import httpx
        import psutil

        end = time.monotonic() + STARTUP_S
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).json()["status"] == "ok":
                    self.children = psutil.Process(self.proc.pid).children(recursive=True)
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError(f"the server did not answer in {STARTUP_S} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def stop(self) -> None:
        """Kill the launcher and every process it started (each rank is in a session of its own)."""
        kill_tree(self.proc, self.children, wait_s=30)


def start_server(model: pathlib.Path, log: pathlib.Path, *args: str, processes: int = 2, name: str = "tiny",
                 env: dict[str, str] | None = None) -> LiveServer:
    """``hf-pipeline serve MODEL --num-processes N`` on a free port, serving ``name``; ``args`` are more
    options, ``env`` more environment. Returns at once: call :meth:`LiveServer.wait_up`."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_PIPELINE_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "hf_pipeline.cli", "serve", str(model), "--num-processes", str(processes),
           "--port", str(port), "--served-model-name", name, *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    return LiveServer(proc=proc, port=port, log=log)


def rss_bytes(processes: list) -> int:
    """The summed resident memory (VmRSS of /proc/<pid>/status) of ``processes`` (psutil processes)."""
    total = 0
    for p in processes:
        for line in pathlib.Path(f"/proc/{p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total
