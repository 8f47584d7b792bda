"""The ``mqnc`` command, the top layer: one subcommand module each, registered from
:data:`SUBCOMMANDS`.

Each entry names a module with a ``register(subparsers)`` function that adds its parser and
sets ``func`` (called with the parsed args, returns the exit status). Registering imports
neither torch nor triton (``mqnc --help`` stays fast and GPU-free; a test checks): a command
that runs kernels or transports imports what it runs inside its handler, after choosing the
kernel mode. Nothing else in the package imports this one.

Errors: a bad option is an argparse error naming the flag, under the usage of the subcommand
that was given it (an unknown one too: ``mqnc predict --bogus``; exit status 2); a ``ValueError``,
``TypeError`` or missing file raised while the command runs is printed as one line (exit
status 2), or with ``-v`` / ``--verbose`` as its traceback; ``-v`` also turns on the package's
log messages (``-vv``: debug).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from mqnc import __version__

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

SUBCOMMANDS = [
    "mqnc.cli.cmd_env",
    "mqnc.cli.cmd_selfcheck",
    "mqnc.cli.cmd_demo",
    "mqnc.cli.cmd_cost",
    "mqnc.cli.cmd_fit",
    "mqnc.cli.cmd_calibrate",
    "mqnc.cli.cmd_corpus",
    "mqnc.cli.cmd_serve",
    "mqnc.cli.cmd_kernel_report",
]

_VERBOSE_HELP = "show the traceback of an error and log what the command does (-vv: debug)"


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own usage error (its usage
    and ``mqnc <command>: error: unrecognized arguments: ...``, exit status 2), not the
    top-level parser's (argparse hands a subparser's leftovers up to ``mqnc``'s usage)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mqnc",
        description="Move the query, not the cache: kernels, transport and cost model for "
        "cross-instance latent (MLA) and sparse attention.",
    )
    parser.add_argument("--version", action="version", version=f"mqnc {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    for p in sub.choices.values():
        # accepted after the subcommand too; SUPPRESS keeps a -v given before it
        p.add_argument(
            "-v", "--verbose", action="count", default=argparse.SUPPRESS, help=_VERBOSE_HELP
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    _log_to_stderr(args.verbose)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `mqnc ... | head`: the reader left; say nothing more
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stdout until the process ends
        return 0
    except (ValueError, TypeError, FileNotFoundError) as exc:
        if args.verbose:
            traceback.print_exc()
        else:
            print(f"mqnc {args.command}: error: {exc} (-v shows the traceback)", file=sys.stderr)
        return 2


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"mqnc: {record.levelname.lower()}: {record.getMessage()}"
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


_handler: logging.Handler | None = None


def _log_to_stderr(verbose: int) -> None:
    """The package's loggers (``mqnc.*``) print to the current stderr: warnings always, info
    with ``-v``, debug with ``-vv``."""
    global _handler
    log = logging.getLogger("mqnc")
    if _handler is not None:
        log.removeHandler(_handler)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(_Formatter())
    log.addHandler(_handler)
    log.setLevel((logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)])
    log.propagate = False


if __name__ == "__main__":
    sys.exit(main())
