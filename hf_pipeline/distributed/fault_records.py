"""The failure records ranks leave in the rendezvous store: JSON data, never code (see :mod:`.faults`).

Note (the store is not trusted): the rendezvous store listens on all interfaces and any process that
reaches its port can list and write keys. Records are therefore JSON, never pickle, and a record is
used only if it is small and has exactly the expected keys and types (:func:`decode_record`); anything
else under the prefix is ignored with a log line, so the worst a stranger can do is make a failure
message wrong, never run code in a rank.

Example:
    >>> raw = make_record("error", 2, error, "stage 2", "a training step", 7)
    >>> rec, why = decode_record(raw)      # (dict, "") or (None, why it is not a record)
"""

from __future__ import annotations

import json

from ..compat import default_store
from ..log import get_logger
from .agreement import describe_error

__all__ = ["FaultStore", "decode_record", "make_record"]

logger = get_logger(__name__)

_MAX_MESSAGE = 2000
# A record's fields and types (bool is refused where int is expected), its kinds, and size bounds:
# describe_error cuts a message to 2000 characters plus a short tail; the other strings are short.
_RECORD_FIELDS: dict[str, type] = {
    "kind": str, "rank": int, "type": str, "message": str, "label": str, "what": str, "where": str, "call": int,
}
_RECORD_KINDS = ("error", "lost")
_MAX_FIELD = {"message": _MAX_MESSAGE + 100}
_MAX_OTHER_FIELD = 1000
_MAX_RECORD_BYTES = 16 * 1024


def make_record(kind: str, rank: int, error: BaseException, label: str, what: str, call: int) -> bytes:
    """What this rank tells the others through the store: ``kind`` "error" (its own code raised) or "lost"."""
    type_name, message, where = describe_error(error)
    rec = {"kind": kind, "rank": rank, "type": type_name[:_MAX_OTHER_FIELD], "message": message,
           "label": label[:_MAX_OTHER_FIELD], "what": what[:_MAX_OTHER_FIELD], "where": where[:_MAX_OTHER_FIELD],
           "call": call}
    return json.dumps(rec).encode()


def decode_record(raw: bytes) -> tuple[dict | None, str]:
    """A record read from the store, or ``(None, why it is not one)``: data only, never code (see the Note).

    Accepted: at most 16 KiB of UTF-8 JSON holding an object with exactly the keys of
    ``_RECORD_FIELDS``, each of its type and within its length bound, ``kind`` one of
    ``_RECORD_KINDS`` and non-negative ``rank`` / ``call``.
    """
    if len(raw) > _MAX_RECORD_BYTES:
        return None, f"{len(raw)} bytes, more than {_MAX_RECORD_BYTES}"
    try:
        rec = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, "not UTF-8 JSON"
    if not isinstance(rec, dict) or set(rec) != set(_RECORD_FIELDS):
        return None, "not an object with the expected keys"
    for name, kind in _RECORD_FIELDS.items():
        value = rec[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            return None, f"field {name!r} must be {kind.__name__}"
        if isinstance(value, str) and len(value) > _MAX_FIELD.get(name, _MAX_OTHER_FIELD):
            return None, f"field {name!r} is too long"
        if isinstance(value, int) and not 0 <= value < 1 << 31:
            return None, f"field {name!r} is out of range"
    if rec["kind"] not in _RECORD_KINDS:
        return None, f"kind {rec['kind'][:20]!r} is not one of {_RECORD_KINDS}"
    return rec, ""


class FaultStore:
    """The rendezvous store, tolerant of its own death (it lives in rank 0 under plain env:// init)."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.ignored: set[str] = set()  # keys whose malformed value was logged (the reads poll: log once)
        try:
            self.store = default_store()
        except Exception as e:  # noqa: BLE001 - no default group / store
            self.store, self.error = None, f"{type(e).__name__}: {e}"

    def set(self, key: str, value: bytes) -> None:
        if self.store is None:
            return
        try:
            self.store.set(key, value)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"

    def get(self, key: str) -> dict | None:
        if self.store is None:
            return None
        try:
            if not self.store.check([key]):
                return None
            raw = self.store.get(key)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            self.store = None  # unreachable: stop trying (each try may block)
            return None
        rec, why = decode_record(raw)
        if rec is None and key not in self.ignored:
            self.ignored.add(key)
            logger.warning(
                "hf_pipeline: ignored the value under %r in the rendezvous store: %s, not a failure record of this "
                "library (something else wrote to the job's store)", key, why,
            )
        return rec

    def first_failure(self, key: str, record: bytes) -> None:
        """Keep the first one-sided failure under ``key`` (one per epoch: the groups since the last recovery),
        for ranks that only see its consequences later."""
        if self.store is None:
            return
        try:
            if self.store.add(f"{key}/count", 1) == 1:
                self.store.set(key, record)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
