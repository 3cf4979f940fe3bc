"""``--num-processes N``: start N processes running the same command with torch's elastic launcher (as torchrun).

The processes end with their launcher, however it ends: each one started by :func:`launch` calls
:func:`follow_launcher` first, which asks Linux for SIGTERM when its parent dies
(``prctl(PR_SET_PDEATHSIG)``) and watches its parent in a thread as well (any platform, and a
launcher that died before the ``prctl``); SIGTERM drains ``serve`` and stops the other commands, and a
process still alive :data:`GRACE_S` seconds later is killed, as the launcher itself would. On one
machine the job's rendezvous store listens on 127.0.0.1 (or ``--main-process-ip``), not on every
interface (:mod:`.rendezvous`).
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any, Sequence

from ..errors import CLIError
from .arguments import local_path
from .parser import LAUNCH_OPTIONS, PROG

__all__ = ["GRACE_S", "LAUNCHER_ENV", "follow_launcher", "launch", "strip_launch_args"]

LAUNCHER_ENV = "HF_PIPELINE_LAUNCHER_PID"  # set for the processes launch() starts: the pid they follow
GRACE_S = 30.0  # as torch's launcher waits after SIGTERM before it kills
_WATCH_S = 0.5  # how often a process looks at its parent
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _parent_death_signal(sig: int) -> None:
    """Linux: ``sig`` to this process when the thread that started it ends (torch's launcher starts its
    processes from its main thread, so: when the launcher ends). Elsewhere nothing: the watch covers it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(_WATCH_S)
    if os.environ.get("RANK", "0") == "0":
        print(f"{PROG}: the launcher (pid {launcher}) is gone; stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def follow_launcher() -> None:
    """In a process :func:`launch` started (``HF_PIPELINE_LAUNCHER_PID`` set): end when the launcher ends,
    even by SIGKILL (SIGTERM first, SIGKILL :data:`GRACE_S` seconds later). Elsewhere a no-op."""
    pid = os.environ.pop(LAUNCHER_ENV, None)  # popped: what this process starts does not follow it
    if not pid or not pid.isdigit() or int(pid) == os.getpid():
        return
    _parent_death_signal(signal.SIGTERM)
    # Started after the prctl, the watch also sees a launcher that died before it (the signal then never comes).
    threading.Thread(target=_watch, args=(int(pid),), name="hf-pipeline-launcher-watch", daemon=True).start()


def strip_launch_args(argv: Sequence[str]) -> list[str]:
    """``argv`` without the launch options (and their values): what each started process runs."""
    out: list[str] = []
    skip = False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in LAUNCH_OPTIONS:
            skip = "=" not in tok
            continue
        out.append(tok)
    return out



def _check_port_free(port: int) -> None:
    """Machine 0's ``--main-process-port`` must be free: the launcher's rendezvous listens on it."""
    import socket

    if not 0 < port < 65536:
        raise CLIError(f"--main-process-port {port} is not a port number; pass one in 1..65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as the rendezvous store sets it: a port in TIME_WAIT is free, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise CLIError(
                f"--main-process-port {port} is already in use on this machine ({e.strerror}); pass a free port, "
                "or leave the option out on one machine to use any free port"
            ) from None


def _rendezvous(args) -> tuple[str, str, dict[str, Any]]:
    """The rendezvous backend, endpoint and settings: on one machine its store listens where the processes
    connect (127.0.0.1 unless ``--main-process-ip``), not on every interface; over several machines
    torch's static rendezvous at machine 0's address."""
    if args.main_process_port is not None and args.machine_rank == 0:
        _check_port_free(args.main_process_port)
    if args.num_machines > 1:
        return "static", f"{args.main_process_ip}:{args.main_process_port}", {}
    from . import rendezvous

    sock = rendezvous.store_socket(args.main_process_ip or "127.0.0.1", args.main_process_port or 0)
    return rendezvous.register(), rendezvous.endpoint(sock), {"store_socket": sock}


def launch(args, argv: Sequence[str]) -> int:
    """Start ``args.num_processes`` processes running this command (torch's elastic launcher, as torchrun).

    Returns:
        0 when every process succeeded; 2 when they all stopped on a user mistake (already printed
        by rank 0 as one line); otherwise the first failing process's exit code.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    n, machines = args.num_processes, args.num_machines
    if os.environ.get("WORLD_SIZE") not in (None, "", "1"):
        raise CLIError("this process already runs under a launcher (WORLD_SIZE is set); drop --num-processes")
    if n % machines:
        raise CLIError(
            f"--num-processes {n} is the total over all machines; it must be a multiple of --num-machines {machines}"
        )
    if not 0 <= args.machine_rank < machines:
        raise CLIError(f"--machine-rank must be in 0..{machines - 1}, got {args.machine_rank}")
    if machines > 1 and (args.main_process_ip is None or args.main_process_port is None):
        raise CLIError(
            "with --num-machines > 1 pass --main-process-ip and --main-process-port "
            "(machine 0's address and a free port)"
        )
    if getattr(args, "model", None) is not None:
        # A missing model fails here, once, not in every process; a download also happens once, here,
        # and the processes then find it in the cache.
        local_path(args.model, args.download)
    backend, endpoint, configs = _rendezvous(args)
    local = n // machines
    # The processes inherit this environment: they import this very package, installed or from a checkout.
    here = str(pathlib.Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = here + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    threads = args.num_cpu_threads_per_process or max(1, (os.cpu_count() or 1) // local)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("HF_PIPELINE_THREADS", str(threads))
    config = LaunchConfig(
        min_nodes=machines,
        max_nodes=machines,
        nproc_per_node=local,
        run_id="hf-pipeline",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": args.machine_rank, **configs},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # The agent logs every failure with a traceback of its own; the processes already said what went wrong.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the processes follow this one (follow_launcher)
    try:
        elastic_launch(config, sys.executable)("-m", "hf_pipeline.cli", *strip_launch_args(argv))
    except SignalException as e:
        # SIGTERM / SIGINT to this process: the agent has passed it on to every process and waited for them
        # (up to 30 s). `serve` drains on it and stops cleanly: a normal end. Others: killed by the signal.
        if args.command == "serve" and e.sigval in (signal.SIGTERM, signal.SIGINT):
            return 0
        print(f"{PROG}: stopped by signal {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        # The first process to fail decides; the agent then stops the others (SIGTERM: negative codes).
        rank, failure = e.get_first_failure()
        if failure.exitcode == 2:
            return 2  # a user mistake, already said in one line
        print(
            f"{PROG}: error: process {rank} exited with code {failure.exitcode} (its output is above)", file=sys.stderr
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        os.environ.pop(LAUNCHER_ENV, None)
    return 0
