"""``mqnc selfcheck``: run every kernel once against its fp64 reference and say what was verified
(the checks are :mod:`mqnc.cli.kernel_checks`); exits non-zero if any exceeds its bound."""

from __future__ import annotations

from mqnc.base.runtime import device_name, kernel_mode, use_interpreter_without_cuda

__all__ = ["CHECKS", "register"]

CHECKS = (
    "merge",
    "dense partial attention",
    "sparse partial attention",
    "splice",
    "query rotation",
)
"""What ``mqnc selfcheck`` runs, in order, and its help lists (names of
:data:`mqnc.cli.kernel_checks.CHECKS`; here so that registering the command loads no torch)."""


def _run(args) -> int:
    use_interpreter_without_cuda()
    # imported here, after the kernel mode is chosen (and so that registering loads no torch)
    from mqnc.cli.kernel_checks import run_checks

    try:
        lines = run_checks(CHECKS)
    except AssertionError as exc:
        print(f"FAILED: {exc}")
        return 1
    print(f"mqnc self-check on {device_name()} (kernels {kernel_mode()}):")
    for line in lines:
        print(f"  ok  {line}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "selfcheck",
        help="run each kernel once against its fp64 reference",
        description=f"Run every kernel ({', '.join(CHECKS)}) once on small inputs, in float32 "
        "and bfloat16, against its fp64 reference and say what was verified; exit status 1 if "
        "any result exceeds its tolerance.",
    )
    p.set_defaults(func=_run)
