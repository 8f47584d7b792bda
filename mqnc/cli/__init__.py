"""The ``mqnc`` command, the top layer: one subcommand module each, registered from
:data:`SUBCOMMANDS`.

Each entry names a module with a ``register(subparsers)`` function that adds its parser and
sets ``func`` (called with the parsed args, returns the exit status). Registering imports
neither torch nor triton (``mqnc --help`` stays fast and GPU-free; a test checks): a command
that runs kernels or transports imports what it runs inside its handler, after choosing the
kernel mode. Nothing else in the package imports this one.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

SUBCOMMANDS = [
    "mqnc.cli.env",
    "mqnc.cli.selfcheck",
    "mqnc.cli.demo",
    "mqnc.cli.cost",
    "mqnc.cli.calibrate",
    "mqnc.cli.kernel_report",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mqnc",
        description="Move the query, not the cache: kernels, transport and cost model for "
        "cross-instance latent (MLA) and sparse attention.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"mqnc {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
