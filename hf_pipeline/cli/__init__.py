"""``hf-pipeline``: plan, generate, train, bench, convert and env from the command line.

    hf-pipeline plan PATH --stages 4 --dtype bf16 --batch 8 --seq 2048
    hf-pipeline generate --num-processes 2 "The function returns"
    hf-pipeline train --num-processes 2 --data notes.txt --output-dir my-model --steps 200
    hf-pipeline serve PATH --num-processes 2 --port 8000   # OpenAI-compatible HTTP API
    hf-pipeline convert PATH OUT --stages 4          # one safetensors file per stage
    hf-pipeline convert OUT BACK --merge            # standard shards again
    hf-pipeline bench --quick
    hf-pipeline env

``generate``, ``serve`` and ``train`` are collective programs: with ``--num-processes N`` (and, for several
hosts, ``--num-machines`` / ``--machine-rank`` / ``--main-process-ip`` / ``--main-process-port``, as
``accelerate launch``) the command starts N processes itself with torch's elastic launcher (as torchrun), each
running ``python -m hf_pipeline.cli <command> ...``; run under ``torchrun`` / ``accelerate launch``
yourself, it joins the job it is in. Without either it runs in one process, every stage local.

User mistakes (a missing path, a bad number, an impossible split) end with one line on stderr and
exit code 2, no traceback; ``HF_PIPELINE_TRACEBACK=1`` shows the traceback.

Lives here: ``parser`` (every command's options), ``launch`` (``--num-processes``, and the launched
processes ending with their launcher), ``rendezvous`` (one machine's rendezvous store, bound to one
address), ``arguments``
(what several commands read from their arguments) and one module per command group (``plan``
with ``convert``, ``generate``, ``serve``, ``train``, ``env`` with ``bench``); ``main`` and the decision
which errors are user mistakes are in this file. The command line is the top room: it may import
every other room of the package, and nothing in the package imports it.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from ..errors import CLIError, PipelineBroken, RankError, is_user_error
from .env import cmd_bench, cmd_env, env_info
from .generate import cmd_generate
from .launch import follow_launcher, launch
from .parser import PROG, build_parser
from .plan import cmd_convert, cmd_plan
from .serve import check_serve_extra, cmd_serve
from .train import cmd_train

__all__ = ["CLIError", "build_parser", "env_info", "main"]

_COMMANDS = {"plan": cmd_plan, "generate": cmd_generate, "train": cmd_train, "convert": cmd_convert, "env": cmd_env,
             "serve": cmd_serve}
# What a command needs installed beyond the package's dependencies (an extra): checked once, before it
# launches processes or loads anything, so a missing one is one line naming the extra.
_EXTRAS_CHECKS = {"serve": check_serve_extra}

# ------------------------------------------------------------------------------------ which errors are mistakes
# The library's errors decide (errors.is_user_error: a PipelineError that is not an InternalError),
# but for the two that report a failure while running (a RankError of a real fault, PipelineBroken).
_RUNNING_FAILURES = (RankError, PipelineBroken)


def _named_type(name: str) -> type | None:
    """The exception class a RankError names for another rank: the library's own (``hf_pipeline.errors``)
    or a builtin."""
    import builtins

    from .. import errors

    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def _is_user_error_type(cls: type) -> bool:
    """:func:`hf_pipeline.errors.is_user_error` but for the failures while running (another rank's error
    arrives as a class name). A builtin error is not one the library raised on purpose: a traceback."""
    return not issubclass(cls, _RUNNING_FAILURES) and is_user_error(cls)


def _is_user_error(e: BaseException) -> bool:
    """Errors the library raises for bad input (also when another rank raised one: a RankError naming it).

    Decided by the library's exception types; a RankError carries each failing rank's type by
    name, looked up as a class first (an unknown name is not a user mistake).
    """
    if isinstance(e, RankError):
        kinds = [_named_type(kind) for kind, _, _ in e.failures.values()]
        return all(cls is not None and _is_user_error_type(cls) for cls in kinds)
    return _is_user_error_type(type(e))


def _one_line(message: str) -> str:
    """The first line of ``message``, continued while it stops mid-sentence (a wrapped library message):
    lines are joined until one ends a sentence (``.``, ``!``, ``?``) or a blank line ends the paragraph."""
    kept: list[str] = []
    for line in message.strip().splitlines():
        if not line.strip():
            break
        kept.append(line.strip())
        if line.rstrip().endswith((".", "!", "?")) or len(kept) == 1 and not line.rstrip().endswith((":", ",")):
            break
    return " ".join(kept)


def _report(e: BaseException) -> None:
    # In a launched job every process gets the error (the failing one its own, the others a
    # RankError naming it); rank 0 says it once.
    if int(os.environ.get("RANK", "0") or 0) == 0:
        message = _one_line(str(e)) or type(e).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)


# ------------------------------------------------------------------------------------ main
def _run(argv: list[str]) -> int:
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in _EXTRAS_CHECKS:
        _EXTRAS_CHECKS[args.command]()
    if getattr(args, "num_processes", None) and args.num_processes > 1:
        return launch(args, argv)
    return _COMMANDS[args.command](args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-pipeline`` console script. Returns the exit code.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Example:
        >>> main(["plan", "path/to/llama", "--stages", "4"])
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    follow_launcher()  # a process of `--num-processes N` ends with its launcher (a no-op elsewhere)
    try:
        return _run(argv)
    except Exception as e:
        if not _is_user_error(e) or os.environ.get("HF_PIPELINE_TRACEBACK") == "1":
            raise
        _report(e)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if os.environ.get("WORLD_SIZE"):
            from ..distributed.context import destroy_distributed

            destroy_distributed()
