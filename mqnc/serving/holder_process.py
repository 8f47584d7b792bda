"""One holder process of :class:`mqnc.serving.LocalHolders` over gloo:
``python -m mqnc.serving.holder_process SPEC``, ``SPEC`` a JSON object of
:func:`mqnc.serving.service.run_rank`'s arguments (``corpus`` path, ``rank``, ``world``,
``master``, ``kernels``, ``max_rows``, ``timeout_s``, ``device``; ``transport``, default
``"gloo"``).

The kernel mode comes with the environment the parent chose (``TRITON_INTERPRET``). The process
ends through ``os._exit`` once its output is flushed: the gloo engine keeps closed groups alive
until exit, and their destructors at interpreter shutdown can abort.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import NoReturn

import torch

from mqnc.serving.service import run_rank

__all__ = ["main", "run_then_exit"]


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m mqnc.serving.holder_process SPEC_JSON")
    spec = json.loads(argv[0])
    torch.set_num_threads(1)  # torch's spinning intra-op workers starve gloo's receive threads
    run_then_exit(
        lambda: run_rank(spec.pop("corpus"), None, transport=spec.pop("transport", "gloo"), **spec)
    )


def run_then_exit(call: Callable[[], object]) -> NoReturn:
    """Run ``call()``, then end the process through ``os._exit`` once its output is flushed.

    The exit status is 0, or 1 when ``call`` raised (its traceback printed to stderr first).
    Shared by the holder processes here and :mod:`mqnc.serving.tp_process`'s ranks (see the
    module docstring: gloo's groups must not be destroyed at interpreter exit).
    """
    rc = 0
    try:
        call()
    except BaseException:  # noqa: BLE001 - reported, then the exit status says it
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main(sys.argv[1:])
