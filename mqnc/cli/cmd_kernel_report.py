"""``mqnc kernel-report``: the kernels' static performance report at the production goal shapes
(compiled launch-exact for sm_90 without a GPU; every time a PREDICTION), see
:mod:`mqnc.measure.kernel_report`."""

from __future__ import annotations

__all__ = ["register"]


def _run(args) -> int:
    from mqnc.measure.kernel_report import run  # here: registering must not load triton

    return run(args)


def register(sub) -> None:
    from mqnc.measure.kernel_report import add_args  # torch-free at import

    p = sub.add_parser(
        "kernel-report",
        help="predicted sm_90 resources, waves and times of the kernels at the goal shapes",
        description=(
            "Compile every goal shape's launches for sm_90 exactly as launched (no GPU needed; "
            "compiled mode, TRITON_INTERPRET=0, set unless given) and print registers, spills, "
            "CTAs per SM, waves, bytes, the SASS load / MMA mix and the predicted time at the "
            "copy ceiling; --measured joins the benchmarks' --goals records."
        ),
    )
    add_args(p)
    p.set_defaults(func=_run)
