"""The library's log messages and progress bars, following the settings users make for transformers.

Messages: :func:`get_logger` returns a logger under ``"hf_pipeline"``. That logger has its own
stderr handler (it does not propagate to the root logger, as transformers' own does not), and the
handler's threshold is transformers' verbosity *at the time of each message*:
``transformers.logging.set_verbosity_info()`` (or ``TRANSFORMERS_VERBOSITY=info``) shows the
library's informational messages, ``set_verbosity_error()`` hides its warnings too; the default
is transformers' default, warnings. A level set on ``logging.getLogger("hf_pipeline")`` by the
user applies as well (it is checked first).

Progress bars: :func:`progress_bar` is ``tqdm`` shown only when the caller asked for one and
neither ``transformers.logging.disable_progress_bar()`` nor ``HF_HUB_DISABLE_PROGRESS_BARS`` turned
bars off (:func:`progress_enabled`).

Example:
    >>> logger = get_logger(__name__)
    >>> logger.info("read %d shards", 3)     # shown after transformers.logging.set_verbosity_info()
    >>> with progress_bar(total=10, desc="train", enabled=is_main) as bar: ...
    >>> with StepProgress(total=100, log_every=10, enabled=is_main) as progress:
    ...     progress.step(step + 1, loss=loss, lr=lr)    # bar with ETA; a line every 10 steps
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

__all__ = ["StepProgress", "get_logger", "progress_bar", "progress_enabled"]

LIBRARY_LOGGER = "hf_pipeline"
_TRUE = {"1", "ON", "YES", "TRUE"}


class _TransformersVerbosity(logging.Filter):
    """Passes a record when transformers' current verbosity would show one of its level."""

    def filter(self, record: logging.LogRecord) -> bool:
        from transformers.utils import logging as hf_logging

        return record.levelno >= hf_logging.get_verbosity()


class _StderrHandler(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is now (pytest and notebooks replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _library_logger() -> logging.Logger:
    root = logging.getLogger(LIBRARY_LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.addFilter(_TransformersVerbosity())
        root.addHandler(handler)
        root.propagate = False
        if root.level == logging.NOTSET:
            # Every record reaches the handler, which applies transformers' verbosity when it is emitted
            # (a fixed level here would miss a later set_verbosity_*).
            root.setLevel(logging.DEBUG)
    return root


def get_logger(name: str = LIBRARY_LOGGER) -> logging.Logger:
    """A logger under ``"hf_pipeline"`` that follows transformers' verbosity.

    Args:
        name: the module's ``__name__`` (``"hf_pipeline.loading.weights"``, ...).
    """
    _library_logger()
    return logging.getLogger(name)


def progress_enabled(requested: bool = True) -> bool:
    """Whether to show a progress bar: ``requested`` and bars are not disabled for transformers / huggingface_hub.

    ``HF_HUB_DISABLE_PROGRESS_BARS`` is read now, not only when huggingface_hub was imported.
    """
    if not requested or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").upper() in _TRUE:
        return False
    from transformers.utils import logging as hf_logging

    return hf_logging.is_progress_bar_enabled()


def progress_bar(*, enabled: bool = True, **kwargs):
    """A ``tqdm.auto.tqdm`` bar, disabled unless :func:`progress_enabled` says ``enabled`` bars may show.

    Args:
        enabled: the caller's wish (``progress=``, rank 0 only, ...).
        kwargs: passed to ``tqdm`` (``total``, ``desc``, ``unit``, ...).
    """
    from tqdm.auto import tqdm

    return tqdm(disable=not progress_enabled(enabled), **kwargs)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


class StepProgress:
    """Progress of a loop of optimizer steps: a bar with ETA and the latest metrics, and a line every few steps.

    The bar (stderr, :func:`progress_bar`: hidden by ``bar=False``, ``--no-progress`` and the
    transformers / huggingface_hub switches) shows steps done, elapsed time, ETA and the metrics in
    its postfix. Independently of the bar, every ``log_every`` steps and at the last step one line
    goes to stdout, ``step     10  loss 2.3456  lr 3.00e-04  12.3 s  eta 01:50``, so logs and
    ``--no-progress`` runs still show the loss. The bar is redrawn once per step (metrics are set
    without a redraw of their own) and closed once, so its final state is printed once.

    Args:
        total: the step count the loop ends at.
        initial: steps already done (a resumed run); the ETA is measured from here.
        log_every: print a line every this many steps (0: never; the last step always prints).
        enabled: False prints nothing at all (ranks other than the main one).
        bar: show the bar (still subject to :func:`progress_enabled`).
        desc: the bar's label.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        log_every: int = 10,
        enabled: bool = True,
        bar: bool = True,
        desc: str = "train",
    ) -> None:
        self.total, self.initial, self.log_every, self.enabled = total, initial, log_every, enabled
        self._start = time.perf_counter()
        self._bar = progress_bar(
            total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, enabled=enabled and bar
        )

    def eta(self, done: int) -> float:
        """Seconds left at ``done`` steps, from the mean time per step so far."""
        ran = done - self.initial
        return (time.perf_counter() - self._start) / ran * (self.total - done) if ran > 0 else float("nan")

    def step(self, done: int, **metrics: Any) -> None:
        """Record step ``done`` (1-based) with its metrics (``loss=``, ``lr=``, ...)."""
        if not self.enabled:
            return
        self._bar.set_postfix({k: _short(v) for k, v in metrics.items()}, refresh=False)
        if done >= self.total:
            # The final state drawn once, by close(): update() would draw it too, and so would a line written before
            # close().
            self._bar.n = done
            self.close()
        else:
            self._bar.update(done - self._bar.n)
        if done == self.total or (self.log_every and (done - self.initial == 1 or done % self.log_every == 0)):
            parts = [f"step {done:5d}"] + [f"{k} {_short(v)}" for k, v in metrics.items()]
            eta = self.eta(done)
            parts.append(f"{time.perf_counter() - self._start:7.1f} s")
            if done < self.total and eta == eta:
                parts.append(f"eta {_clock(eta)}")
            self.write("  ".join(parts))

    def write(self, text: str) -> None:
        """Print a line to stdout without breaking the bar."""
        if self.enabled:
            self._bar.write(text, file=sys.stdout)
            sys.stdout.flush()

    def close(self) -> None:
        """Draw the bar's final state and stop it (again: nothing)."""
        self._bar.close()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2e}" if value and abs(value) < 1e-2 else f"{value:.4f}"
    return str(value)
