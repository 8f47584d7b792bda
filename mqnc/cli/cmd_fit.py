"""``mqnc fit RESULTS``: a fabric's constants from a results file, one fit per route sweep.

A results file may hold sweeps of several machines, transports, row sizes and versions (every
benchmark run appends). One fit over all of them describes none, so the records are grouped by
device, transport (the record's variant), row size ``q + p`` and commit
(:func:`mqnc.cost.fit_groups`), and each group is fitted and printed on its own row.

``--save FILE`` writes one sweep's fabric as a machine profile (:class:`mqnc.cost.MachineProfile`,
the versioned schema), which ``mqnc predict --fabric FILE`` and ``mqnc demo --profile FILE``
read: the sweep named by ``--group LABEL``, else, among the sweeps
left by ``--transport`` / ``--device`` / ``--commit``, the newest one at the model's row size
(:func:`mqnc.cost.newest_group`). A negative fitted turnaround is reported (it is not a time:
see :class:`mqnc.cost.FitResult`) and saved as 0.
"""

from __future__ import annotations

import json
import logging

from mqnc.cost import MachineProfile, fit_groups, newest_group
from mqnc.measure.options import hidden_alias, model_arg, positive_float, positive_int

__all__ = ["register"]

log = logging.getLogger(__name__)

_FITTED = ("t_probe_us", "bw_gbps", "turnaround_us")
"""The fabric terms a fit gives (what a saved profile's ``sources`` name)."""


def _select(groups: list, args) -> list:
    """The sweeps the filters leave (``--group``, ``--transport``, ``--device``, ``--commit``)."""
    if args.group is not None:
        named = [g for g in groups if g.label == args.group]
        if not named:
            raise ValueError(
                f"--group: no sweep {args.group!r}; expected one of {[g.label for g in groups]}"
            )
        return named
    left = [
        g
        for g in groups
        if (args.transport is None or g.variant == args.transport)
        and (args.device is None or args.device.lower() in g.device.lower())
        and (args.commit is None or g.commit.startswith(args.commit))
    ]
    if not left:
        raise ValueError(
            "--transport/--device/--commit: no sweep matches; the file holds "
            + ", ".join(f"{g.label} ({g.device}, commit {g.commit})" for g in groups)
        )
    return left


def _run(args) -> int:
    for flag, value in (("--name", args.name), ("--link-peak-gbps", args.link_peak_gbps)):
        if value is not None and not args.save:
            raise ValueError(f"{flag}: only applies with --save FILE (it names what is saved)")
    geometry = args.model
    groups = fit_groups(
        args.results,
        qp_row_bytes=geometry.qp_row_bytes,
        route_bench=args.route_bench,
        probe_bench=args.probe_bench,
        fit_min_rows=args.fit_min_rows,
        amortised_min_rows=args.amortised_min_rows,
    )
    log.info(
        "%s: %d route sweeps from %d device(s) and %d commit(s)",
        args.results,
        len(groups),
        len({g.device for g in groups}),
        len({g.commit for g in groups}),
    )
    shown = _select(groups, args)
    saved = None
    if args.save:
        saved = newest_group(shown, geometry.qp_row_bytes) if args.group is None else shown[0]
        if saved.fit is None:
            raise ValueError(f"--group: {saved.label} cannot be fitted ({saved.error})")
        if saved.fit.t_probe_us <= 0:
            raise ValueError(
                f"--save: {saved.label} has no probe record and a negative intercept "
                f"({saved.fit.intercept_us:.1f} us), which cannot be its T_probe; record its "
                "probe (perf.bench_route does) or choose another with --group"
            )
        extra = {} if args.link_peak_gbps is None else {"link_peak_gbps": args.link_peak_gbps}
        fabric = saved.fit.to_fabric(
            args.name or saved.label,
            description=f"fit of {args.results}: {saved.label}, {saved.device}, "
            f"commit {saved.commit}, {saved.date}",
            **extra,
        )
        MachineProfile(fabric, sources=dict.fromkeys(_FITTED, f"mqnc fit: {saved.label}")).save(
            args.save
        )
    if args.json:
        out = {g.label: dict(g.to_dict(), saved=g is saved) for g in shown}
        print(json.dumps(out, indent=2))
    else:
        _print_table(args, shown, saved, geometry.qp_row_bytes)
    _warn(shown)
    return 0


def _print_table(args, groups: list, saved, qp_row_bytes: int) -> None:
    am_head = f"MAPE>={args.amortised_min_rows}"
    width = max(24, *(len(g.label) + 1 for g in groups))
    print(
        f"  {'sweep':<{width}} {'T_probe':>8} {'BW':>7} {'turn':>7} {am_head:>10}"
        f" {'MAPE all':>9} {'affine>=':>9} {'aff all':>8} {'n':>4}"
    )
    print(f"  {'':<{width}} {'(us)':>8} {'(GB/s)':>7} {'(us)':>7}")
    for g in groups:
        mark = ">" if g is saved else " "
        r = g.fit
        if r is None:
            print(f"{mark} {g.label:<{width}} no fit: {g.error}")
            continue
        probe = f"{r.t_probe_us:8.2f}" + ("" if r.probe_measured else "*")
        print(
            f"{mark} {g.label:<{width}} {probe} {r.bw_gbps:7.2f} {r.turnaround_us:7.1f} "
            f"{100 * r.mape_amortised:9.1f}% {100 * r.mape_full:8.1f}% "
            f"{100 * r.mape_amortised_affine:8.1f}% {100 * r.mape_full_affine:7.1f}% "
            f"{r.n_points:4d}"
        )
    devices = sorted({g.device for g in groups})
    commits = sorted({g.commit for g in groups})
    print(f"  one fit per sweep; devices: {'; '.join(devices)}; commits: {', '.join(commits)}")
    if any(g.fit is not None and not g.fit.probe_measured for g in groups):
        print("  * no probe record: T_probe is the intercept, turnaround not separable")
    if saved is not None:
        rule = (
            "named by --group"
            if args.group is not None
            else f"the newest sweep at the model's {qp_row_bytes} B row; "
            "--group LABEL picks another"
        )
        print(f"> saved {args.save}: {saved.label} ({rule})")


def _warn(groups: list) -> None:
    negative = [g for g in groups if g.fit is not None and g.fit.turnaround_us < 0]
    if negative:
        log.warning(
            "negative turnaround in %s: the fitted intercept lies below the measured probe. "
            "That is not a time (a holder cannot answer a batch faster than an empty probe): "
            "the round trip is not affine in M_q over the fitted points (noise on a loaded "
            "machine, or a slope that changes with size), or the probe ran under other load. "
            "A saved profile stores turnaround 0; more --reps, or --fit-min-rows, may help.",
            ", ".join(f"{g.label} ({g.fit.turnaround_us:.1f} us)" for g in negative),
        )
    below_zero = [
        g
        for g in groups
        if g.fit is not None and not g.fit.probe_measured and g.fit.intercept_us < 0
    ]
    if below_zero:
        log.warning(
            "negative intercept without a probe record in %s: a round trip at M_q -> 0 cannot "
            "take negative time, so the intercept is no T_probe; the round trip is not affine "
            "in M_q over the fitted points. Record the probe (bench 'probe') beside the sweep.",
            ", ".join(f"{g.label} ({g.fit.intercept_us:.1f} us)" for g in below_zero),
        )
    failed = [g for g in groups if g.fit is None]
    if failed:
        log.warning("not fitted: %s", "; ".join(f"{g.label}: {g.error}" for g in failed))


def register(subparsers) -> None:
    """Add ``fit`` to the ``mqnc`` command."""
    p = subparsers.add_parser(
        "fit",
        help="fit fabric constants from a results file, one fit per sweep (§4.3)",
        description="Fit T_probe, BW and the turnaround of every route sweep in a results "
        "file: records are grouped by device, transport, row size q+p and commit, and each "
        "group is fitted on its own row. --save writes one sweep's fabric profile (for "
        "mqnc predict --fabric and mqnc demo --profile): the one named by --group, else the "
        "newest sweep at the model's row size among those --transport, --device and --commit "
        "leave. A negative turnaround is reported (it is not a time) and saved as 0.",
    )
    p.add_argument("results", help="JSON-lines results file (perf/results/results.jsonl)")
    p.add_argument(
        "--model",
        type=model_arg,
        default="deepseek-v2-lite",
        metavar="NAME|CONFIG",
        help="model whose q+p the rows carry: preset or Hugging Face config.json "
        "(default deepseek-v2-lite)",
    )
    p.add_argument("--group", default=None, metavar="LABEL", help="only this sweep (its label)")
    hidden_alias(p, "--variant", "group")
    p.add_argument("--transport", default=None, help="only sweeps of this transport (variant)")
    p.add_argument("--device", default=None, help="only sweeps whose device name contains this")
    p.add_argument("--commit", default=None, help="only sweeps of this commit (a prefix)")
    p.add_argument("--save", default=None, metavar="FILE", help="write a fabric profile JSON")
    p.add_argument("--name", default=None, help="name of the saved profile (default its label)")
    p.add_argument(
        "--link-peak-gbps", type=positive_float, default=None, help="store a link peak, GB/s"
    )
    p.add_argument(
        "--fit-min-rows",
        type=positive_int,
        default=512,
        help="fit slope and intercept over M_q >= this (default 512)",
    )
    p.add_argument(
        "--amortised-min-rows",
        type=positive_int,
        default=512,
        help="amortised-regime MAPE threshold (default 512)",
    )
    p.add_argument("--route-bench", default="route", help="bench of round trips (default route)")
    p.add_argument("--probe-bench", default="probe", help="bench of probes (default probe)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_run)
