"""The rendezvous of a one-machine ``--num-processes`` launch: torch's static rendezvous, its store listening
on one address instead of every interface.

torch's static rendezvous starts its ``TCPStore`` server on all interfaces (the host it is given is
only where clients connect), so ``hf-pipeline serve`` on 127.0.0.1 left the job's store, which holds
the job and accepts writes from anyone who reaches it, open to the network. One machine's processes
need it on one address only: :func:`store_socket` binds that address (127.0.0.1 unless
``--main-process-ip`` says otherwise) and the store serves on that socket (``master_listen_fd``). Jobs
over several machines keep torch's static rendezvous: machine 0's store must be reachable from the
others.

Example (the launcher, one machine):
    >>> sock = store_socket("127.0.0.1", 0)
    >>> config = LaunchConfig(rdzv_backend=register(), rdzv_endpoint=endpoint(sock),
    ...                       rdzv_configs={"rank": 0, "store_socket": sock}, ...)
"""

from __future__ import annotations

import datetime
import errno
import socket
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from ..distributed.sockets import listening_socket
from ..errors import CLIError

__all__ = ["BACKEND", "endpoint", "register", "store_socket"]

BACKEND = "hf-pipeline-local"


def store_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any free one) for the job's store.

    Raises:
        CLIError: the port is taken, or the address is not this machine's.
    """
    try:
        sock = listening_socket(host, port, backlog=512)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise CLIError(
                f"--main-process-port {port} is already in use on this machine ({e.strerror}); pass a free port, "
                "or leave the option out on one machine to use any free port"
            ) from None
        raise CLIError(
            f"cannot listen on {host}:{port} for the job's rendezvous store ({e.strerror or e}); pass an address "
            "of this machine as --main-process-ip"
        ) from None
    return sock


def endpoint(sock: socket.socket) -> str:
    """``host:port`` of ``sock`` as the processes connect to it (IPv6 in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _LocalRendezvous(RendezvousHandler):
    """One machine (the only node, rank 0): the store on the socket in ``params.config["store_socket"]``."""

    def __init__(self, params: RendezvousParameters):
        self.sock: socket.socket = params.config["store_socket"]
        self.host, self.port = self.sock.getsockname()[:2]
        self.run_id = params.run_id
        self.timeout = datetime.timedelta(seconds=int(params.config.get("timeout", 900)))
        self._store: Any = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the processes connect to this store as clients (MASTER_ADDR / MASTER_PORT)

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            # The store owns the socket from here (detach: Python no longer closes it).
            self._store = TCPStore(self.host, self.port, 1, True, self.timeout, multi_tenant=True,
                                   master_listen_fd=self.sock.detach())
        return RendezvousInfo(PrefixStore(self.run_id, self._store), 0, 1,
                              RendezvousStoreInfo(self.host, self.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def register() -> str:
    """Register the one-machine rendezvous with torch's launcher (again: a no-op). Returns its backend name."""
    rendezvous_handler_registry.register(BACKEND, _LocalRendezvous)
    return BACKEND
