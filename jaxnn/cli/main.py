"""`jaxnn train|export|generate|predict|evaluate|profile|summary|serve`: the parser, and the one table from an error
to an exit status.

Exit status: 0 done (also when a resumed run had already finished); 2 bad input: one line, nothing written (every
`ValueError`: ConfigError, DataError, RunDirError, CheckpointError, ...); 1 a failure while working (one line: a
non-finite loss, a full disk); 128+N a run stopped by signal N after a checkpoint. Anything else is a bug in jaxnn
and keeps its traceback.

jax is imported only after the flags are parsed, because `--devices N` on a CPU-only machine must set the number
of simulated CPU devices before jax initialises its backends: nothing this module imports at its top loads jax.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn

from jaxnn._src import compile_cache, malloc
from jaxnn._src.storage import StorageError
from jaxnn.callbacks import NonFiniteError
from jaxnn.cli.inference import add_evaluate_parser, add_predict_parser, evaluate_main, predict_main
from jaxnn.cli.profile import add_profile_parser, profile_main
from jaxnn.cli.runs import add_export_parser, add_generate_parser, export_main, generate_main
from jaxnn.cli.serve import add_serve_parser, serve_main
from jaxnn.cli.summary import add_summary_parser, summary_main
from jaxnn.cli.train import train_main
from jaxnn.cli.train_flags import add_train_parser

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

# Errors that mean the work itself failed (the input was fine); every other ValueError is bad input.
FAILURES: tuple[type[BaseException], ...] = (NonFiniteError, StorageError)

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": train_main,
    "export": export_main,
    "generate": generate_main,
    "predict": predict_main,
    "evaluate": evaluate_main,
    "profile": profile_main,
    "summary": summary_main,
    "serve": serve_main,
}


class UsageError(ValueError):
    """Flags argparse refuses (a missing one, a choice not offered); reported like every other bad input."""


class _Parser(argparse.ArgumentParser):
    # argparse prints its usage text and exits itself; one `jaxnn: error:` line naming the command, and the
    # exit-status table, serve every command alike (subcommand parsers are made of this class too).
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxnn", description="jaxnn: train models with JAX on the host at hand.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_export_parser(sub)
    add_generate_parser(sub)
    add_predict_parser(sub)
    add_evaluate_parser(sub)
    add_profile_parser(sub)
    add_summary_parser(sub)
    add_serve_parser(sub)
    return parser


def exit_status(err: BaseException) -> int | None:
    """The exit status for an error a command raised, or None for one that is not the user's or the machine's."""
    if isinstance(err, FAILURES):
        return EXIT_FAILED
    if isinstance(err, ValueError):
        return EXIT_USAGE
    return None


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    # A warning on the terminal names its kind and says what to do; the source line Python adds (jaxnn's own
    # code, where it was raised) tells a user of the command nothing.
    return f"{category.__name__}: {message}\n"


# A `jaxnn train` run of at most this many steps keeps XLA's scratch in one block, so that its programs can be
# cached; a longer one splits it. Measured (docs/performance.md, "Host memory between steps"): the benchmark GPT's
# step compiles in about 4 s and runs 108 ms faster split (297 against 405 ms), so the split pays after ~40 steps.
SHORT_RUN_STEPS = 40
# jax's warning for each program XLA cannot serialise because its scratch is split: a long run chose the split.
_SPLIT_NOT_CACHED = r"Error writing persistent compilation cache entry for .*Multiple temp buffer allocations"


def split_scratch(args: argparse.Namespace) -> bool:
    """Whether this command's programs get XLA's scratch blocks: where its compilation cache is off, and for a
    `jaxnn train` run longer than SHORT_RUN_STEPS (or of epochs), whose steps gain more than a cache saves."""
    setting = "off" if getattr(args, "no_compile_cache", False) else getattr(args, "compile_cache", "auto")
    try:
        if compile_cache.resolve(setting) is None:
            return True
    except ValueError:  # the command reports a bad setting itself, with the rest of its flags
        return False
    steps = getattr(args, "steps", None)
    return args.command == "train" and (steps is None or steps > SHORT_RUN_STEPS)


def keep_host_memory(args: argparse.Namespace) -> str:
    """The command is a program, so it opts in to jaxnn's host-memory settings (jaxnn/_src/malloc.py) before jax
    starts (`JAXNN_MALLOC=0` keeps it from them)."""
    split = split_scratch(args)
    if split:
        warnings.filterwarnings("ignore", message=_SPLIT_NOT_CACHED)
    return malloc.keep_host_memory(split_scratch=split)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.formatwarning = _one_line_warning
    try:
        args = build_parser().parse_args(argv)
        keep_host_memory(args)
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:  # a second Ctrl-C after a run saved its checkpoint, or one outside a run
        print("jaxnn: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        status = exit_status(err)
        if status is None:
            raise
        print(f"jaxnn: error: {err}", file=sys.stderr)
        return status
