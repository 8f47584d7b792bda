"""``mqnc calibrate``: measure this machine's fabric and write its profile (§4.3, Table 2).

Runs a short probe + route sweep on one transport, fits ``(T_probe, BW, turnaround)`` and
writes a machine profile JSON (:class:`mqnc.cost.MachineProfile`: the fabric, with what it was
measured with) that ``mqnc predict --fabric FILE``, the predicate and the demo
(``--profile FILE``) load; unless ``--no-bulk`` it also times one all-layer chunk pull
(fetch's ``T_pull``). The measuring and fitting are :mod:`mqnc.measure.calibrate`.
"""

from __future__ import annotations

import json
import logging

from mqnc.measure.options import (
    int_list,
    model_arg,
    nonnegative_int,
    positive_int,
)
from mqnc.transport import ENGINES, names

__all__ = ["register"]

log = logging.getLogger(__name__)

DEFAULT_M_Q = [1, 16, 64, 256, 512, 1024, 2048, 4096]
QUICK_M_Q = [1, 64, 512, 1024]
DESCRIPTION = (
    "Measure this machine's fabric: a short probe + route sweep on one transport (host-side "
    "echo holder), a fit of T_probe, BW and the turnaround, and, unless --no-bulk, one timed "
    "all-layer chunk pull (fetch's T_pull). Writes a fabric profile JSON that "
    "mqnc predict --fabric FILE and mqnc demo --profile FILE load."
)


def _csv(values: list[int]) -> str:
    return ",".join(map(str, values))


def _run(args) -> int:
    # imported here: registering this command must not load torch (``mqnc --help``)
    from mqnc.measure.calibrate import calibrate
    from mqnc.measure.ranks import exit_process

    m_qs = args.m_q or (QUICK_M_Q if args.quick else DEFAULT_M_Q)
    reps = args.reps or (5 if args.quick else 15)
    out = args.out or f"fabric-{args.transport}.json"
    log.info(
        "calibrate %s: M_q %s, %d reps, %d warm-up, model %s -> %s",
        args.transport,
        _csv(m_qs),
        reps,
        args.warmup,
        args.model.name,
        out,
    )
    profile, res, raw = calibrate(
        args.transport,
        m_qs=m_qs,
        model=args.model,
        reps=reps,
        warmup=args.warmup,
        fit_min_rows=args.fit_min_rows,
        bulk_tokens=None if args.no_bulk else args.bulk_tokens,
        name=args.name,
        results=args.results,
        progress=not args.json,
    )
    _machine_profile(profile, args.transport).save(out)
    if args.json:
        print(json.dumps({"profile": profile.to_dict(), "fit": res.to_dict(), "path": out}))
        return 0
    _print_fit(profile, res, raw, out)
    if ENGINES[args.transport].exit_directly:
        exit_process(0)  # see mqnc.measure.ranks.exit_process: gloo teardown at interpreter exit
    return 0


def _machine_profile(fabric, transport: str):
    """The fabric as a machine profile (the versioned schema every calibration writes): what
    it was measured with and where its terms came from."""
    from mqnc.base.runtime import device_name
    from mqnc.cost import MachineProfile

    terms = ("t_probe_us", "bw_gbps", "turnaround_us", "bulk_bw_gbps", "host_fixed_us")
    measured = [k for k in (*terms, "host_per_row_us") if getattr(fabric, k) is not None]
    return MachineProfile(
        fabric,
        measured_with=dict(transport=transport, device_name=device_name()),
        sources=dict.fromkeys(measured, f"mqnc calibrate --transport {transport}"),
    )


def _print_fit(profile, res, raw: dict, out: str) -> None:
    pts = ", ".join(f"{m}: {us:.0f}" for m, us in raw["route"])
    print(f"probe (sig_rt) p50 {raw['probe_us']:.1f} us; route p50 (us) by M_q {{{pts}}}")
    print(
        f"fit: T_probe {res.t_probe_us:.1f} us, BW {res.bw_gbps:.3g} GB/s, turnaround "
        f"{res.turnaround_us:.1f} us (intercept {res.intercept_us:.1f} us); MAPE "
        f"{100 * res.mape_amortised:.1f}% (M_q >= {res.amortised_min_rows}), "
        f"{100 * res.mape_full:.1f}% (all)"
    )
    if profile.bulk_bw_gbps is not None:
        print(f"bulk pull: {profile.bulk_bw_gbps:.3g} GB/s")
    if res.turnaround_us < 0:
        log.warning(
            "negative turnaround (%.1f us): the intercept is below the measured probe, which "
            "is not a time (a holder cannot answer faster than an empty probe); the round trip "
            "is not affine in M_q at small M_q on this fabric. Stored as 0.",
            res.turnaround_us,
        )
    print(f"wrote {out} (use: mqnc predict --fabric {out} ...)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine's fabric (probe + route sweep) and write a profile JSON",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--transport",
        default="loopback",
        choices=names(),
        help="engine to measure (default loopback; nvshmem: see perf/gpu_check_nvshmem.py)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="profile JSON to write (default fabric-<transport>.json)",
    )
    p.add_argument(
        "--m-q",
        type=int_list,
        default=None,
        help=f"comma-separated route batch sizes (default {_csv(DEFAULT_M_Q)})",
    )
    p.add_argument("--quick", action="store_true", help=f"M_q {_csv(QUICK_M_Q)} and 5 repetitions")
    p.add_argument("--reps", type=positive_int, default=None, help="timed repetitions (default 15)")
    p.add_argument(
        "--warmup", type=nonnegative_int, default=3, help="untimed repetitions (default 3)"
    )
    p.add_argument(
        "--fit-min-rows",
        type=positive_int,
        default=512,
        help="fit the slope over M_q >= this (default 512)",
    )
    p.add_argument(
        "--bulk-tokens",
        type=positive_int,
        default=256,
        help="chunk tokens of the bulk-pull timing (default 256)",
    )
    p.add_argument("--no-bulk", action="store_true", help="skip the bulk-pull timing")
    p.add_argument(
        "--model",
        type=model_arg,
        default="deepseek-v2-lite",
        metavar="NAME|CONFIG",
        help="model preset or Hugging Face config.json giving the row size "
        "(default deepseek-v2-lite)",
    )
    p.add_argument("--name", default=None, help="profile name (default <transport>@<device>)")
    p.add_argument(
        "--results", default=None, metavar="FILE", help="also append the records to FILE"
    )
    p.add_argument("--json", action="store_true", help="print the profile and fit as JSON")
    p.set_defaults(func=_run)
