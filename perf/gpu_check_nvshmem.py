"""GPU check of the NVSHMEM engine: two PEs on the one lent GPU (NVSHMEM's limited MPG mode).

Run by ``perf/gpu_check.sh`` (the lead's script) on a machine with a CUDA device and the
nvshmem4py wheels (``nvshmem4py-cu13`` and its ``nvidia-nvshmem-cu13``, carried as wheels, see
the device README)::

    python -m perf.gpu_check_nvshmem            # host-initiated and device-initiated puts
    python -m perf.gpu_check_nvshmem --quick    # fewer repetitions and batch sizes

What it checks and records (``$MQNC_RESULTS``, else the git-ignored
``perf/results/local.jsonl``; and ``$OUT/nvshmem_check.json`` when ``$OUT`` is set), for each
put path (``host``: nvshmem4py's stream-ordered
``put_signal``; ``device``: the Triton kernel calling ``nvshmemx_putmem_signal_nbi_block``):

1. **probe round trip**: a header-only put + signal there and back (``T_probe``, §4.3),
   p20/p50/p80 over the repetitions (bench ``probe``);
2. **route round trip over M_q**: ``M_q = B * 16`` rows of DeepSeek-V2-Lite (576-wide bf16
   queries out, the collapsed 1032-B/row partial back, §3.2, §5.3) for B in 1..64 against a
   2048-token chunk held by PE 1 (bench ``route``, x = M_q; these feed ``mqnc fit``);
3. **exactness of a routed partial**: the partial PE 0 receives vs the fp64 reference over the
   same chunk and vs a local kernel call (``mla`` bf16 and ``mla_lse`` bounds), errors
   printed and recorded.

Both PEs share one GPU, so puts go over the local transport: IBGDA needs NICs and two nodes
and is not exercised here. Exit status: 0 when every check passed, 1 when one failed, 2 when
no GPU or no nvshmem4py (nothing ran).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

L_CHUNK = 2048


def _geometry():
    from mqnc.model import PRESETS

    return PRESETS["deepseek-v2-lite"]


def _chunk(g, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(g.layers, L_CHUNK, g.d_qk, generator=gen)).to(torch.bfloat16)


# Over 60 lines: one PE's whole GPU check (bootstrap, probe, route sweep, exactness), run once
# on a lent GPU, in the order the log reports it.
def _worker(rank: int, port: int, device_put: bool, batches: list[int], reps: int, q) -> None:
    import torch
    from torch.distributed import TCPStore

    from mqnc.model import RopeSpec
    from mqnc.serving import ChunkInfo, Holder, Requester
    from mqnc.transport import slot_bytes_for
    from mqnc.transport.nvshmem import NvshmemTransport

    out: dict = {"rank": rank, "device_put": device_put}
    try:
        g = _geometry()
        scale = RopeSpec.from_preset("deepseek-v2-lite").softmax_scale
        store = TCPStore("127.0.0.1", port, 2, is_master=False)
        sb = slot_bytes_for(g, max_rows=max(batches) * g.heads)
        t = NvshmemTransport(
            rank, 2, store, slot_bytes=sb, lanes=1, device=0, device_put=device_put
        )
        out["signal_constants"] = t.consts
        if rank == 1:
            h = Holder(
                t,
                g,
                softmax_scale=scale,
                num_blocks=L_CHUNK // 64,
                device="cuda",
                streams=8,
                poll_s=0.5,
            )
            h.add_chunk(7, _chunk(g).cuda())
            t.barrier(60)
            h.serve_forever()
            out["holder_stats"] = dict(
                routes=h.stats.routes, probes=h.stats.probes, kernel_calls=h.stats.kernel_calls
            )
        else:
            req = Requester(t, g, softmax_scale=scale, timeout_s=60.0, device="cuda")
            req.register(ChunkInfo(7, L_CHUNK, 0, (1,)))
            t.barrier(60)
            import numpy as np

            for _ in range(10):
                req.probe(1)
            probes = [req.probe(1) for _ in range(reps)]
            out["probe_us"] = [float(x) for x in np.percentile(probes, [20, 50, 80])]
            gen = torch.Generator().manual_seed(1)
            route = {}
            for B in batches:
                qb = (0.5 * torch.randn(B, g.heads, g.d_qk, generator=gen)).to(torch.bfloat16)
                qb = qb.cuda()
                for _ in range(5):
                    req.route(7, qb, 3)
                rts = [req.route(7, qb, 3).record.total_us for _ in range(reps)]
                route[B * g.heads] = [float(x) for x in np.percentile(rts, [20, 50, 80])]
            out["route_us"] = route
            # exactness of one routed partial (layer 3, B = 4)
            from mqnc.reference import partial_attention_reference
            from mqnc.testing import TOLERANCES, compare
            from mqnc.triton_kernels import mla_decode_partial

            qe = (0.5 * torch.randn(4, g.heads, g.d_qk, generator=gen)).to(torch.bfloat16).cuda()
            part = req.route(7, qe, 3)
            kv = _chunk(g)[3]
            o_ref, lse_ref = partial_attention_reference(
                qe.cpu(), kv, torch.ones(4, L_CHUNK, dtype=torch.bool), scale
            )
            pool = kv.cuda().view(L_CHUNK // 64, 64, g.d_qk)
            bt = torch.arange(L_CHUNK // 64, dtype=torch.int32, device="cuda")[None].repeat(4, 1)
            lens = torch.full((4,), L_CHUNK, dtype=torch.int32, device="cuda")
            o_loc, lse_loc = mla_decode_partial(qe, pool, bt, lens, softmax_scale=scale)
            so, sl = compare(part.o, o_ref), compare(part.lse, lse_ref)
            s_loc = compare(part.o, o_loc)
            tol, tol_l = TOLERANCES[("mla", "bfloat16")], TOLERANCES[("mla_lse", "float32")]
            out["exact"] = dict(
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
            req.shutdown(1)
        t.close()
        out["ok"] = True
    except BaseException:
        out["ok"] = False
        out["error"] = traceback.format_exc()
    q.put(out)


def _run(device_put: bool, batches: list[int], reps: int, timeout_s: float) -> list[dict]:
    import torch.multiprocessing as mp

    from mqnc.transport.torchdist import free_port_store

    store = free_port_store(2)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, store.port, device_put, batches, reps, q))
        for r in range(2)
    ]
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
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            results.append({"ok": False, "error": f"PE process {p.pid} hung (killed)"})
    return results


# Over 60 lines: the options, spawning the two PEs and reporting their results, in order.
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per put path")
    ap.add_argument("--paths", default="host,device")
    args = ap.parse_args(argv)
    import torch

    from mqnc.transport.nvshmem import nvshmem_available

    if not nvshmem_available():
        print("gpu_check_nvshmem: SKIP (needs a CUDA device and nvshmem4py)")
        return 2
    batches = [1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    reps = 30 if args.quick else 200
    summary = {"device": torch.cuda.get_device_name(), "paths": {}}
    ok = True
    for path in args.paths.split(","):
        t0 = time.monotonic()
        res = _run(path == "device", batches, reps, args.timeout)
        req = next((r for r in res if r.get("rank") == 0), {})
        summary["paths"][path] = dict(results=res, wall_s=time.monotonic() - t0)
        good = len(res) == 2 and all(r.get("ok") for r in res) and req.get("exact", {}).get("ok")
        ok &= bool(good)
        print(f"[{path}] {'PASS' if good else 'FAIL'} in {time.monotonic() - t0:.1f} s")
        for r in res:
            if not r.get("ok"):
                print(r.get("error"))
        if req.get("probe_us"):
            print(f"  probe p20/p50/p80 us: {req['probe_us']}")
            for m_q, pct in req["route_us"].items():
                print(f"  route M_q={m_q}: p20/p50/p80 us {pct}")
            print(f"  exactness: {req.get('exact')}")
            try:
                from mqnc.measure import record

                variant = f"nvshmem-{path}-1gpu-2pe"
                record(
                    "probe",
                    variant,
                    0,
                    tuple(req["probe_us"]),
                    x_name="M_q",
                    transport="nvshmem",
                    backend="triton",
                )
                g = _geometry()
                for m_q, pct in req["route_us"].items():
                    record(
                        "route",
                        variant,
                        int(m_q),
                        tuple(pct),
                        x_name="M_q",
                        nbytes=int(m_q) * g.qp_row_bytes,
                        transport="nvshmem",
                        backend="triton",
                        extra=dict(chunk_tokens=L_CHUNK),
                    )
            except Exception as exc:  # recording must not hide the check's verdict
                print(f"  (results not recorded: {exc})")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "nvshmem_check.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    print("gpu_check_nvshmem:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
