"""The ``mqnc`` command: one subcommand per module, registered from :data:`SUBCOMMANDS`.

Each entry names a module with a ``register(subparsers)`` function that adds its parser and
sets ``func`` (called with the parsed args, returns the exit status). Command modules import
torch / triton inside their handlers, so ``mqnc --help`` stays fast and GPU-free.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

SUBCOMMANDS = [
    "mqnc.env",
    "mqnc.selfcheck",
    "mqnc.demo",
    "mqnc.costcli",
    "mqnc.calibrate",
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
