"""GPU check of the NVSHMEM engine: two PEs on the one lent GPU (NVSHMEM's limited MPG mode).

Run by ``perf/gpu_check.sh`` on a machine with a CUDA device and nvshmem4py (carried as a
wheel and installed offline by ``perf/install_wheels.py``)::

    python -m perf.gpu_check_nvshmem                    # host- and device-initiated puts
    python -m perf.gpu_check_nvshmem --quick            # fewer repetitions and batch sizes
    python -m perf.gpu_check_nvshmem --transport gloo --tiny   # the dry run, on a CPU

What it checks and records (where every benchmark records: ``--out FILE``, else with
``--record`` the repository's ``perf/results/results.jsonl``, else ``$MQNC_RESULTS``, else the
git-ignored ``perf/results/local.jsonl``; a summary in ``--summary``, default
``$OUT/logs/nvshmem_check.json`` when ``$OUT`` is set, rewritten after each path), for each put
path (``host``: nvshmem4py's
stream-ordered ``put_signal``; ``device``: the Triton kernel calling
``nvshmemx_putmem_signal_nbi_block``):

1. **probe round trip**: a header-only put + signal there and back (``T_probe``, §4.3),
   p20/p50/p80 over the repetitions (bench ``probe``);
2. **route round trip over M_q**: ``M_q = B * 16`` rows of DeepSeek-V2-Lite (576-wide bf16
   queries out, the collapsed 1032-B/row partial back, §3.2, §5.3) for B in 1..64 against a
   2048-token chunk held by PE 1 (bench ``route``, x = M_q; these feed ``mqnc fit``);
3. **exactness of a routed partial**: the partial PE 0 receives vs the fp64 reference over the
   same chunk and vs a local kernel call (``mla`` bf16 and ``mla_lse`` bounds), errors
   printed and recorded.

Every record says which wait path each PE's waits took (``extra.wait_path``: the engine's
``wait_paths``, device-side polls of one slot on the requester, of several on the holder) and
how it was timed (``extra.timing``: the host clock around each whole round trip).

Both PEs share one GPU: two processes, two CUDA contexts, which the GPU **time-slices** (no
MPS), so a round trip includes context switches and is an upper bound, not the fabric's
latency; puts go over the local transport, IBGDA (NICs, two nodes) is not exercised here. The
first run on an H200 gave ~4 ms probes at 4096 rounds per device-side poll, flat in M_q:
``--poll-spins 4096,64`` runs every put path again at 64 rounds (records ``...-spins64``), which
tells the two readings apart: if a probe is two polls' worth of spinning (each round a volatile
load and a reduction: 4096 of them take milliseconds) it falls with the rounds; if it is two
time slices of the other context, it does not.
``--transport gloo`` runs the very same two-PE check over the gloo engine (the CPU dry run:
argument parsing, the workers, the records). Exit status: 0 when every check passed, 1 when
one failed, 2 when there is no GPU or no nvshmem4py (nothing ran).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from mqnc.measure.options import bench_parser, finish, int_list, parse_bench_args, positive_float

L_CHUNK = 2048


def _geometry():
    from mqnc.model import PRESETS

    return PRESETS["deepseek-v2-lite"]


def _chunk(g, tokens, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(g.layers, tokens, g.d_qk, generator=gen)).to(torch.bfloat16)


def _transport(kind: str, rank: int, port: int, slot_bytes: int, device_put: bool, spins: int):
    if kind == "gloo":
        from mqnc.transport.torchdist import TorchDistTransport

        return TorchDistTransport.connect(rank, 2, port, slot_bytes=slot_bytes, lanes=1)
    from torch.distributed import TCPStore

    from mqnc.transport.nvshmem import NvshmemTransport

    store = TCPStore("127.0.0.1", port, 2, is_master=False)
    return NvshmemTransport(
        rank, 2, store, slot_bytes=slot_bytes, lanes=1, device=0, device_put=device_put,
        poll_spins=spins,
    )  # fmt: skip


DEFAULT_SPINS = 1 << 12  # NvshmemTransport's poll_spins default


def _variant(transport: str, path: str, spins: int) -> str:
    """A record's variant: ``nvshmem-host-1gpu-2pe``, ``-spins64`` added off the default."""
    tail = "" if spins == DEFAULT_SPINS or transport != "nvshmem" else f"-spins{spins}"
    return f"{transport}-{path}-1gpu-2pe{tail}"


def _exactness(req, g, scale, tokens, B, gen, dev) -> dict:
    """One routed partial (layer 3) vs the fp64 reference and a local kernel call."""
    import torch

    from mqnc.reference import partial_attention_reference
    from mqnc.testing import TOLERANCES, compare
    from mqnc.triton_kernels import mla_decode_partial

    qe = (0.5 * torch.randn(B, g.heads, g.d_qk, generator=gen)).to(torch.bfloat16).to(dev)
    part = req.route(7, qe, 3)
    kv = _chunk(g, tokens)[3]
    o_ref, lse_ref = partial_attention_reference(
        qe.cpu(), kv, torch.ones(B, tokens, dtype=torch.bool), scale
    )
    pool = kv.to(dev).view(tokens // 64, 64, g.d_qk)
    bt = torch.arange(tokens // 64, dtype=torch.int32, device=dev)[None].repeat(B, 1)
    lens = torch.full((B,), tokens, dtype=torch.int32, device=dev)
    o_loc, _ = mla_decode_partial(qe, pool, bt, lens, softmax_scale=scale)
    so, sl = compare(part.o, o_ref), compare(part.lse, lse_ref)
    s_loc = compare(part.o, o_loc)
    tol, tol_l = TOLERANCES[("mla", "bfloat16")], TOLERANCES[("mla_lse", "float32")]
    return dict(
        o_vs_fp64=so.max_abs,
        o_rms_rel=so.rms_rel,
        lse_vs_fp64=sl.max_abs,
        o_vs_local_call=s_loc.max_abs,
        ok=bool(
            so.max_abs <= tol.atol
            and so.rms_rel <= tol.rms_rtol
            and sl.max_abs <= tol_l.atol
            and s_loc.max_abs <= tol.atol
        ),
    )


# Over 60 lines: one PE's whole check (transport, holder or requester, probe, route sweep,
# exactness), run once per put path, in the order the log reports it.
def _worker(rank: int, port: int, cfg: dict, q) -> None:
    out: dict = {"rank": rank, "device_put": cfg["device_put"]}
    try:
        from mqnc.base.runtime import use_interpreter_without_cuda

        use_interpreter_without_cuda()
        import numpy as np
        import torch

        from mqnc.base.runtime import kernel_device
        from mqnc.model import RopeSpec
        from mqnc.serving import ChunkInfo, Holder, Requester
        from mqnc.transport import slot_bytes_for

        g, tokens, batches, reps = _geometry(), cfg["tokens"], cfg["batches"], cfg["reps"]
        dev = kernel_device()
        scale = RopeSpec.from_preset("deepseek-v2-lite").softmax_scale
        sb = slot_bytes_for(g, max_rows=max(batches + [cfg["exact_b"]]) * g.heads)
        t = _transport(cfg["transport"], rank, port, sb, cfg["device_put"], cfg["spins"])
        out["signal_constants"] = getattr(t, "consts", None)
        out["poll_spins"] = getattr(t, "poll_spins", None)  # each device-side poll's bound
        if rank == 1:
            h = Holder(t, g, softmax_scale=scale, num_blocks=tokens // 64, device=dev, poll_s=0.5)
            h.add_chunk(7, _chunk(g, tokens).to(dev))
            t.barrier(60)
            h.serve_forever()
            out["holder_stats"] = dict(
                routes=h.stats.routes, probes=h.stats.probes, kernel_calls=h.stats.kernel_calls
            )
        else:
            req = Requester(t, g, softmax_scale=scale, timeout_s=30.0, device=dev)
            req.register(ChunkInfo(7, tokens, 0, (1,)))
            t.barrier(60)
            for _ in range(3 if cfg["warmup"] is None else cfg["warmup"]):
                req.probe(1)
            probes = [req.probe(1) for _ in range(reps)]
            out["probe_us"] = [float(x) for x in np.percentile(probes, [20, 50, 80])]
            gen = torch.Generator().manual_seed(1)
            route = {}
            for B in batches:
                qb = (0.5 * torch.randn(B, g.heads, g.d_qk, generator=gen)).to(torch.bfloat16)
                qb = qb.to(dev)
                for _ in range(2 if cfg["warmup"] is None else cfg["warmup"]):
                    req.route(7, qb, 3)
                rts = [req.route(7, qb, 3).record.total_us for _ in range(reps)]
                route[B * g.heads] = [float(x) for x in np.percentile(rts, [20, 50, 80])]
            out["route_us"] = route
            out["exact"] = _exactness(req, g, scale, tokens, cfg["exact_b"], gen, dev)
            req.shutdown(1)
        # NVSHMEM: device-side polls by path; gloo waits on its receive thread's condition
        out["wait_paths"] = dict(getattr(t, "wait_paths", None) or {"host-condition": t.name})
        t.close()
        out["ok"] = True
    except BaseException:
        out["ok"] = False
        out["error"] = traceback.format_exc()
    q.put(out)
    q.close()
    q.join_thread()
    os._exit(0)  # no transport destructor under a service thread still blocked


def _run(cfg: dict, timeout_s: float) -> list[dict]:
    import torch.multiprocessing as mp

    from mqnc.transport.torchdist import free_port_store

    store = free_port_store(2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store.port, cfg, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + timeout_s
    while len(results) < 2 and time.monotonic() < deadline:
        try:
            results.append(q.get(timeout=1.0))
        except Exception:
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:  # the joins share what is left of the bound (plus 2 s), not 5 s each
        p.join(max(0.5, deadline + 2.0 - time.monotonic()))
        if p.is_alive():
            p.kill()
            results.append({"ok": False, "error": f"PE process {p.pid} hung (killed)"})
    return results


def _record(req: dict, holder: dict, cfg: dict, out) -> None:
    from mqnc.measure import record

    put = "device" if cfg["device_put"] else "host"
    variant = _variant(cfg["transport"], put, cfg["spins"])
    extra = dict(
        chunk_tokens=cfg["tokens"],
        wait_path={"requester": req.get("wait_paths"), "holder": holder.get("wait_paths")},
        poll_spins=req.get("poll_spins"),
        pes=(
            "2 PEs on 1 GPU: two CUDA contexts, time-sliced"
            if cfg["transport"] == "nvshmem"
            else "2 processes on 1 host (gloo, the dry run)"
        ),
        timing={"method": "host-clock", "what": "one whole round trip", "samples": cfg["reps"]},
    )
    backend = "triton" if cfg["transport"] == "nvshmem" else "interpreter"
    transport = cfg["transport"]
    record("probe", variant, 0, tuple(req["probe_us"]), x_name="M_q", transport=transport,
           backend=backend, extra=extra, path=out)  # fmt: skip
    g = _geometry()
    for m_q, pct in req["route_us"].items():
        record("route", variant, int(m_q), tuple(pct), x_name="M_q",
               nbytes=int(m_q) * g.qp_row_bytes, transport=transport, backend=backend,
               extra=extra, path=out)  # fmt: skip


def _report(path: str, res: list[dict], wall: float, cfg: dict, out) -> bool:
    req = next((r for r in res if r.get("rank") == 0), {})
    holder = next((r for r in res if r.get("rank") == 1), {})
    good = len(res) == 2 and all(r.get("ok") for r in res) and req.get("exact", {}).get("ok")
    print(f"[{path}] {'PASS' if good else 'FAIL'} in {wall:.1f} s")
    for r in res:
        if not r.get("ok"):
            print(r.get("error"))
    if req.get("probe_us"):
        print(f"  probe p20/p50/p80 us: {req['probe_us']}")
        for m_q, pct in req["route_us"].items():
            print(f"  route M_q={m_q}: p20/p50/p80 us {pct}")
        print(f"  exactness: {req.get('exact')}")
        print(f"  wait paths: requester {req.get('wait_paths')}, holder {holder.get('wait_paths')}")
        try:
            _record(req, holder, cfg, out)
        except Exception as exc:  # noqa: BLE001 - recording must not hide the check's verdict
            print(f"  (results not recorded: {exc})")
    return bool(good)


def main(argv=None) -> int:
    ap = bench_parser(
        __doc__,
        reps="200, 30 with --quick, 3 with --tiny",
        warmup="3 probes and 2 routes per batch",
        tiny=True,
    )
    ap.add_argument("--timeout", type=positive_float, default=40.0, help="seconds per put path")
    ap.add_argument("--paths", default="host,device", help="put paths: host, device")
    ap.add_argument("--transport", default="nvshmem", choices=("nvshmem", "gloo"))
    ap.add_argument("--summary", default=None, help="JSON summary (default $OUT/...)")
    ap.add_argument(
        "--poll-spins",
        type=int_list,
        default=[DEFAULT_SPINS],
        help="rounds per device-side poll, a comma list: every put path at each (nvshmem)",
    )
    args = parse_bench_args(ap, argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - {"host", "device"}:
        raise ValueError(f"--paths: expected names out of host, device, got {args.paths!r}")
    if args.transport == "nvshmem":
        from mqnc.transport.nvshmem import nvshmem_available

        if not nvshmem_available():
            print("gpu_check_nvshmem: SKIP (needs a CUDA device and nvshmem4py)")
            return 2
    else:
        paths = ["host"]  # the gloo engine has one put path
        if len(args.poll_spins) > 1:
            print("gloo: no device-side polls; one run (--poll-spins applies to nvshmem)")
        args.poll_spins = args.poll_spins[:1]
    cfg = dict(
        transport=args.transport,
        tokens=128 if args.tiny else L_CHUNK,
        batches=[1] if args.tiny else ([1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64]),
        reps=args.reps or (3 if args.tiny else (30 if args.quick else 200)),
        warmup=args.warmup,
        exact_b=1 if args.tiny else 4,
    )
    from mqnc.base.runtime import device_name

    summary = {"device": device_name(), "transport": args.transport, "paths": {}}
    # in $OUT/logs (packed into logs.tgz): the device tool brings back at most 8 files of $OUT
    where = args.summary or (
        os.path.join(os.environ["OUT"], "logs", "nvshmem_check.json")
        if os.environ.get("OUT")
        else None
    )
    ok = True
    for spins, path in ((n, p) for n in args.poll_spins for p in paths):  # the default first
        t0 = time.monotonic()
        run = {**cfg, "device_put": path == "device", "spins": spins}
        res = _run(run, args.timeout)
        key = path if spins == DEFAULT_SPINS else f"{path}-spins{spins}"
        summary["paths"][key] = dict(results=res, wall_s=time.monotonic() - t0)
        ok &= _report(key, res, time.monotonic() - t0, run, args.out)
        if where:  # after each path: a step killed at its cap keeps what it found
            os.makedirs(os.path.dirname(where) or ".", exist_ok=True)
            with open(where, "w") as f:
                json.dump(summary, f, indent=1, default=str)
    finish(args)
    print("gpu_check_nvshmem:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
