"""The library's exceptions, in one place, under one base class.

Every error the library raises on purpose derives from :class:`PipelineError`, so callers (and
the ``hf-pipeline`` CLI) can tell "the user asked for something that cannot be done" from a bug:
``except PipelineError`` catches the first; anything else escaping the library is the second.
Each class also keeps the builtin base it always had (``ValueError`` for bad arguments,
``RuntimeError`` for failures while running), so ``except ValueError`` code keeps working.

This module imports nothing from the package: every other module may raise these.
"""

from __future__ import annotations

from typing import Mapping

__all__ = [
    "AdapterError",
    "CLIError",
    "CheckpointChangedError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ConvertError",
    "InputError",
    "InputTypeError",
    "InternalError",
    "NoSuchAttribute",
    "PipelineBroken",
    "PipelineError",
    "PlanError",
    "RankError",
    "RecipeError",
    "ScheduleError",
    "ServerBusy",
    "ServingRequestError",
    "TraceError",
    "TrainingError",
    "UsageError",
    "is_user_error",
]


class PipelineError(Exception):
    """Base of every error the library raises on purpose; its message says what to change."""


class InputError(PipelineError, ValueError):
    """A bad argument or input value (an option of ``from_pretrained``, a call's inputs)."""


class AdapterError(InputError):
    """A PEFT adapter could not be loaded into a pipelined model on some rank (a tensor of the wrong shape, a
    module another rank holds): raised on every rank, naming the failing rank and the cause."""


class InputTypeError(InputError, TypeError):
    """An argument of the wrong type (``except TypeError`` and ``except ValueError`` both catch it)."""


class RecipeError(PipelineError, ValueError):
    """A recipe file is malformed or does not match the model it is applied to."""


class PlanError(PipelineError, ValueError):
    """The model cannot be split as requested."""


class ScheduleError(PipelineError, ValueError):
    """A schedule cannot run with the requested stages / microbatches."""


class CheckpointError(PipelineError, ValueError):
    """A checkpoint is missing, malformed or does not match the model."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint at the given path (nor in the local hub cache)."""


class CheckpointChangedError(CheckpointError):
    """A checkpoint's files changed while they were read (a save into it ran meanwhile): load it again."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A save target that is something else (a file where a checkpoint folder should go)."""


class ConvertError(PipelineError, ValueError):
    """A checkpoint conversion cannot be done as requested."""


class TraceError(PipelineError, RuntimeError):
    """The torch.export fallback cannot split (or run) this model."""


class RankError(PipelineError, RuntimeError):
    """Another rank failed; raised on every rank but the failing one(s).

    Attributes:
        rank: the first failing rank.
        ranks: every failing rank, ascending.
        original_type: name of the first failing rank's exception type (e.g. ``"ValueError"``).
        failures: ``{rank: (type name, message, label)}`` for every failing rank.
    """

    def __init__(self, message: str, *, failures: Mapping[int, tuple[str, str, str | None]]) -> None:
        super().__init__(message)
        self.failures = dict(sorted(failures.items()))
        self.ranks = tuple(self.failures)
        self.rank = self.ranks[0]
        self.original_type = self.failures[self.rank][0]

    def __reduce__(self):  # picklable (e.g. sent back from a worker process)
        return (_rebuild_rank_error, (str(self), self.failures))


def _rebuild_rank_error(message: str, failures: Mapping[int, tuple[str, str, str | None]]) -> RankError:
    return RankError(message, failures=failures)


class PipelineBroken(PipelineError, RuntimeError):
    """The process group can no longer be used after a failure inside a pipelined call."""


class UsageError(PipelineError, RuntimeError):
    """A call that cannot run in the model's or the process's current state (say, a second profile
    recording while one is active, or backpropagating a forward() that ran for inference)."""


class TrainingError(PipelineError, RuntimeError):
    """A training step produced something it cannot go on from (a non-finite gradient norm)."""


class ServingRequestError(InputError):
    """A request to the serving engine or its HTTP API that cannot be served as asked (``param``: the
    request field to change, as OpenAI's error objects name it)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class ServerBusy(PipelineError, RuntimeError):
    """The serving engine cannot take a request now: its queue is full (retry later) or it is draining
    to stop (``draining``)."""

    def __init__(self, message: str, *, draining: bool = False):
        super().__init__(message)
        self.draining = draining


class NoSuchAttribute(PipelineError, AttributeError):
    """A name the package (or one of its objects) does not have."""


class InternalError(PipelineError, RuntimeError):
    """An invariant of hf_pipeline itself broke: a bug in the library, not a mistake of the caller.

    It derives from :class:`PipelineError` so that every deliberate raise is the library's own, but
    the command line reports it with its traceback (see :func:`is_user_error`).
    """


def is_user_error(error: BaseException | type[BaseException]) -> bool:
    """Whether ``error`` (an exception or its class) is a mistake of the caller the library refused on
    purpose (one line for the CLI)."""
    cls = error if isinstance(error, type) else type(error)
    return issubclass(cls, PipelineError) and not issubclass(cls, InternalError)


class CLIError(PipelineError):
    """A command-line mistake: printed as one line, exit code 2."""
