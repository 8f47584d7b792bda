"""``mqnc calibrate``: measure this machine's fabric and write its profile (§4.3, Table 2).

Runs a short probe + route sweep on one transport, fits ``(T_probe, BW, turnaround)`` and
writes a fabric profile JSON that ``mqnc predict --fabric FILE``, the predicate and the demo
(``--profile FILE``) load; unless ``--no-bulk`` it also times one all-layer chunk pull
(fetch's ``T_pull``). The measuring and fitting are :mod:`mqnc.measure.calibrate`.
"""

from __future__ import annotations

import argparse
import json

from mqnc.measure.options import TRANSPORTS, ints_of

__all__ = ["register"]

DEFAULT_M_Q = "1,16,64,256,512,1024,2048,4096"
QUICK_M_Q = "1,64,512,1024"


def _run(args) -> int:
    # imported here: registering this command must not load torch (``mqnc --help``)
    from mqnc.measure.calibrate import calibrate
    from mqnc.measure.echo import exit_process

    m_qs = ints_of(args.m_q or (QUICK_M_Q if args.quick else DEFAULT_M_Q), "--m-q")
    reps = args.reps or (5 if args.quick else 15)
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
    out = args.out or f"fabric-{args.transport}.json"
    profile.save(out)
    if args.json:
        print(json.dumps({"profile": profile.to_dict(), "fit": res.to_dict(), "path": out}))
        return 0
    _print_fit(profile, res, raw, out)
    if args.transport == "gloo":
        exit_process(0)  # see mqnc.measure.echo.exit_process: gloo teardown at interpreter exit
    return 0


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
        print(
            "note: the intercept is below the measured probe (negative turnaround, stored as 0): "
            "this fabric's round trip is not affine in bytes at small M_q"
        )
    print(f"wrote {out} (use: mqnc predict --fabric {out} ...)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine's fabric (probe + route sweep) and write a profile JSON",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--transport", default="loopback", choices=list(TRANSPORTS))
    p.add_argument("--out", default=None, help="profile JSON (default fabric-<transport>.json)")
    p.add_argument("--m-q", default=None, help=f"route batch sizes (default {DEFAULT_M_Q})")
    p.add_argument("--quick", action="store_true", help=f"M_q {QUICK_M_Q}, 5 reps")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 15)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fit-min-rows", type=int, default=512)
    p.add_argument("--bulk-tokens", type=int, default=256, help="chunk of the bulk-pull timing")
    p.add_argument("--no-bulk", action="store_true", help="skip the bulk-pull timing")
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--name", default=None, help="profile name (default <transport>@<device>)")
    p.add_argument("--results", default=None, help="also append the records to this file")
    p.add_argument("--json", action="store_true", help="print the profile and fit as JSON")
    p.set_defaults(func=_run)
