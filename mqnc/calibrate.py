"""``mqnc calibrate``: measure this machine's fabric and write its profile (§4.3, Table 2).

Runs a short probe + route sweep on one transport (the echo fabric of ``perf/_harness.py``:
rank 0 here, one echo holder; ``sig_rt`` and ``full_rt`` exactly as ``perf/bench_route.py``
times them), fits ``(T_probe, BW, turnaround)`` with :func:`mqnc.costmodel.fit` (the probe
is the measured ``sig_rt``; ``BW`` the large-``M_q`` slope; turnaround = intercept - probe)
and writes a :class:`~mqnc.fabric.FabricProfile` JSON that ``mqnc predict --fabric FILE``, the
predicate and the demo (``--profile FILE``) load. Unless ``--no-bulk``, it also times one
contiguous all-layer chunk pull and stores its rate as ``bulk_bw_gbps`` (fetch's
``T_pull``), so that the profile prices fetch on the same machine.

The measuring code lives in the repository's ``perf/`` folder (the benchmarks share it); the
command finds it next to the installed ``mqnc`` package (an editable install or a checkout)
and says so when it is missing. The default sweep takes a few seconds on loopback and about
10-20 s on gloo (process start included) on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["register", "calibrate"]

DEFAULT_M_Q = "1,16,64,256,512,1024,2048,4096"
QUICK_M_Q = "1,64,512,1024"


def _harness():
    """Import ``perf._harness`` (adding the checkout holding ``mqnc/`` to ``sys.path``)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "perf" / "_harness.py").exists():
        raise FileNotFoundError(
            f"calibrate: needs the repository's perf/ folder next to the mqnc package "
            f"(looked in {root}); run it from a checkout installed with `pip install -e .`"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from perf import _harness

    return _harness


def calibrate(
    transport: str = "loopback",
    *,
    m_qs=(1, 16, 64, 256, 512, 1024, 2048, 4096),
    model: str = "deepseek-v2-lite",
    reps: int = 15,
    warmup: int = 3,
    fit_min_rows: int = 512,
    bulk_tokens: int | None = 256,
    name: str | None = None,
    results: str | None = None,
    progress: bool = False,
):
    """Measure and fit this machine's fabric on ``transport``.

    Parameters
    ----------
    transport : str
        ``"loopback"`` or ``"gloo"`` (``"nvshmem"`` raises: its benchmark is
        ``perf/gpu_check_nvshmem.py``).
    m_qs : sequence of int
        Route batch sizes (at least two distinct; the fit uses ``M_q >= fit_min_rows`` when
        two such sizes exist, all points otherwise).
    model : str
        Geometry preset giving ``q + p`` (2184 B/row for DeepSeek-V2-Lite).
    reps, warmup : int
        Timed and untimed repetitions per point (p50 of the timed ones is fitted).
    fit_min_rows : int
        As in :func:`mqnc.costmodel.fit` (also the amortised-MAPE threshold).
    bulk_tokens : int or None
        Chunk tokens of the bulk-pull measurement (``None``: skip it).
    name : str or None
        Profile name (default ``"<transport>@<device>"``).
    results : str or None
        Also append the probe/route records to this results file (``bench_route``'s format).

    Returns
    -------
    (FabricProfile, FitResult, dict)
        The profile, the fit, and the raw measurements (``probe_us``, ``route`` as
        ``[(M_q, p50_us)]``, ``bulk`` as ``(bytes, p50_us)`` or None).
    """
    H = _harness()
    from mqnc.costmodel import fit
    from mqnc.runtime import device_name
    from perf._results import time_fn
    from perf.bench_route import measure

    if transport not in ("loopback", "gloo", "nvshmem"):
        raise ValueError(f"transport: expected loopback, gloo or nvshmem, got {transport!r}")
    m_qs = sorted({int(m) for m in m_qs})
    if len(m_qs) < 2 or m_qs[0] < 1:
        raise ValueError(f"m_q: expected at least two distinct sizes >= 1, got {m_qs}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps: expected an int >= 1, got {reps!r}")
    g = H.geometry_of(model)
    H.one_intra_op_thread()
    slot = H.HDR + max(m_qs) * max(g.q_row_bytes, g.p_row_bytes)
    bulk_bytes = g.chunk_bytes(bulk_tokens) if bulk_tokens else 0
    try:
        fabric = H.EchoFabric(
            transport, holders=1, slot_bytes=max(slot, H.HDR + bulk_bytes), chunk_bytes=bulk_bytes
        )
    except H.Unavailable as exc:
        raise ValueError(f"transport: {exc}") from None
    with fabric:
        probe, sweeps = measure(
            fabric,
            g,
            m_qs,
            [g.qp_row_bytes],
            reps=reps,
            warmup=warmup,
            out=results,
            write=results is not None,
            progress=progress,
        )
        bulk = None
        if bulk_bytes:
            msg = fabric.message(H.OP_CHUNK, H.HDR, bulk_bytes)
            pb = time_fn(lambda: fabric.round_trip(1, msg), warmup=warmup, reps=reps, cuda=False)
            bulk = (bulk_bytes, pb[1])
    route = sweeps[g.qp_row_bytes]
    res = fit(route, qp_row_bytes=g.qp_row_bytes, probe_us=probe[1], fit_min_rows=fit_min_rows)
    dev = device_name()
    extra = {}
    if bulk is not None:
        extra["bulk_bw_gbps"] = bulk[0] / (bulk[1] * 1e-6) / 1e9
    profile = res.to_fabric(
        name or f"{transport}@{dev}",
        description=f"{transport} echo fabric on {dev} (host-side put + signal, §3.2 sig_rt / "
        f"full_rt), {g.name} rows q+p = {g.qp_row_bytes} B",
        source=f"mqnc calibrate --transport {transport}: M_q {m_qs}, {reps} reps, p50; fit "
        f"over M_q >= {fit_min_rows}"
        + (f"; bulk pull of {bulk_tokens} tokens x {g.layers} layers" if bulk else ""),
        **extra,
    )
    return profile, res, {"probe_us": probe[1], "route": route, "bulk": bulk}


def _run(args) -> int:
    H = _harness()
    m_qs = H.ints_of(args.m_q or (QUICK_M_Q if args.quick else DEFAULT_M_Q), "--m-q")
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
    if args.transport == "gloo":
        H.exit_process(0)  # see perf._harness.exit_process: gloo teardown at interpreter exit
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine's fabric (probe + route sweep) and write a profile JSON",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--transport", default="loopback", choices=["loopback", "gloo", "nvshmem"])
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
