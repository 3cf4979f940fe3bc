"""An Engine served on every rank with a client beside it on rank 0, for the tools that drive one without HTTP
(the serve benchmark, ``devtools.ring_fuzz``)."""

from __future__ import annotations

import threading

__all__ = ["serve_with_client"]


def serve_with_client(engine, client) -> None:
    """Every rank serves until drained; rank 0 runs ``client()`` (which submits, waits and drains the engine) in a
    thread beside its ring, and joins it after."""
    feeder = threading.Thread(target=client, daemon=True) if engine.ctx.rank == 0 else None
    if feeder is not None:
        feeder.start()
    engine.serve_forever()
    if feeder is not None:
        feeder.join()
