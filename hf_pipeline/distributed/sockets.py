"""A listening TCP socket made here rather than by the library that serves on it, so the caller words the error.

The HTTP server (``serving/server.py``) and the launcher's rendezvous store (``cli/rendezvous.py``) both bind
their own socket first: a taken port or a foreign address is then an error naming the option to change,
not uvicorn's exit or torch's store timeout.
"""

from __future__ import annotations

import socket

__all__ = ["listening_socket"]


def listening_socket(host: str, port: int, *, backlog: int) -> socket.socket:
    """A socket listening on ``host:port`` (port 0: any free one), IPv4 or IPv6 as ``host`` resolves.

    ``SO_REUSEADDR`` as torch's store and uvicorn set it: a port in TIME_WAIT is free, one with a listener is not.

    Raises:
        OSError: the port is taken (``EADDRINUSE``), the address is not this machine's, or ``host`` does not resolve.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
