"""``mqnc demo``: the agentic fan-in over a partitioned corpus (:mod:`mqnc.demo`), decided,
executed, verified and reported."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from mqnc.demo import DemoConfig, HFDemoConfig, HolderStartupError, run_demo, run_hf_demo
from mqnc.demo.config import HF_TRANSPORTS, KERNELS, KV_DTYPES, TRANSPORTS
from mqnc.demo.preflight import default_kernels
from mqnc.transport import describe

__all__ = ["register"]

_INT_OPTIONS = (
    "layers",
    "chunks",
    "min_tokens",
    "max_tokens",
    "holders",
    "replicas",
    "whole_agents",
    "selection_agents",
    "chunks_per_agent",
    "topk",
    "steps",
    "seed",
)


# the options `mqnc demo --hf` takes (as HFDemoConfig's fields); the others are an error there
_HF_OPTIONS = dict(
    transport="transport",
    force="force",
    profile="profile",
    out="out",
    holders="holders",
    replicas="replicas",
    seed="seed",
    steps="new_tokens",
    kernels="kernels",
    kill_holder="kill_holder",
    kill_after_step="kill_after_step",
)


def _hf_config(args) -> HFDemoConfig:
    """``mqnc demo --hf KIND``'s configuration from the demo's own options where they apply."""
    given = [
        k
        for k, v in vars(args).items()
        if k in {f.name for f in dataclasses.fields(DemoConfig)}
        and k not in _HF_OPTIONS
        and k != "progress"
        and v is not None
    ]
    if given:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in sorted(given))
        raise ValueError(f"--hf: {flags} apply to the MLA demo only (not to --hf)")
    # --transport and --out have the same defaults in both demos; the others default to None
    fields = {
        field: getattr(args, name)
        for name, field in _HF_OPTIONS.items()
        if getattr(args, name, None) is not None
    }
    return HFDemoConfig(kind=args.hf, **fields)


_DEVICE_ROUTE_OPTIONS = ("layers", "chunks", "min_tokens", "max_tokens", "seed", "device", "out")


def _device_route_config(args) -> DemoConfig:
    """``--device-route``'s configuration: the corpus options it takes (the agents' options,
    which it does not use, kept valid for the corpus given)."""
    d = DemoConfig()
    given = {k: getattr(args, k) for k in _DEVICE_ROUTE_OPTIONS if getattr(args, k) is not None}
    chunks = given.get("chunks", d.chunks)
    smallest = chunks * given.get("min_tokens", d.min_tokens)
    return DemoConfig(
        **given,
        topk=max(1, min(d.topk, smallest)),
        chunks_per_agent=max(1, min(d.chunks_per_agent, chunks - 1)),
    )


def _run(args) -> int:
    try:
        if args.kill_after_step is not None and args.kill_holder is None:
            raise ValueError("--kill-after-step: applies to the fault drill only (--kill-holder R)")
        if args.hf:
            run_hf_demo(_hf_config(args))
            return 0
        if args.device_route:
            from mqnc.demo.run import run_device_route

            if args.kv_dtype is not None:
                raise ValueError("--kv-dtype: applies to the MLA demo only (not --device-route)")

            run_device_route(_device_route_config(args))
            return 0
        fields = {f.name for f in dataclasses.fields(DemoConfig)}
        cfg = DemoConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
        run_demo(cfg)
    except (AssertionError, HolderStartupError) as exc:
        print(f"mqnc demo: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    d = DemoConfig()
    p = subparsers.add_parser(
        "demo",
        help="agentic fan-in over a partitioned corpus: decide, execute, verify, report",
        description="The paper's motivating workload: a corpus of chunks prefilled through a "
        "small MLA model and partitioned over holders; sub-agents decode through it (which "
        "chunks they read, and how many share each, planned from the measured constants: the "
        "chunks nearest the crossover), the predicate picks route, fetch or "
        "local per (chunk, agent) and the report prints each pick beside the predicted cost of "
        "every path, the choice is executed, every answer is checked against an fp64 "
        "reference, and the measured cost of each primitive is reported beside the model's "
        "prediction (demo.json and a PNG in --out).",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=d.transport,
        help=f"{describe(TRANSPORTS)} (default {d.transport})",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="where pools and kernels live (default: cuda when available)",
    )
    p.add_argument(
        "--kernels",
        choices=KERNELS,
        default=None,
        help="what computes on the holders and the requester: the Triton kernels (on cpu, "
        "the Triton interpreter), or their fp64 torch references rounded once (default: the "
        f"MLA demo {default_kernels('cuda')} on cuda, {default_kernels('cpu')} on cpu; --hf: "
        f"{HFDemoConfig.kernels} on both (on cpu, the Triton interpreter))",
    )
    p.add_argument(
        "--force",
        choices=("route", "fetch", "local"),
        default=None,
        help="run every (chunk, agent) through one primitive",
    )
    p.add_argument("--profile", default=None, help="fabric profile JSON (else calibrate at start)")
    p.add_argument(
        "--kv-dtype",
        dest="kv_dtype",
        choices=tuple(KV_DTYPES),
        default=None,
        help="the cache format holders and the requester keep: bf16 rows (1152 B a token-layer) "
        "or fp8, DeepSeek-V3.2's 656-byte FP8 entries (quantized when a chunk enters a pool; "
        "answers verified against fp64 over the dequantized cache, the quantization error "
        f"reported apart; default {d.kv_dtype})",
    )
    p.add_argument("--out", default=d.out, help="folder for demo.json and the PNG")
    for name in _INT_OPTIONS:
        flag = f"--{name.replace('_', '-')}"
        p.add_argument(flag, dest=name, type=int, default=None, help=f"default {getattr(d, name)}")
    _add_decode_options(p)
    _add_instead(p)
    p.set_defaults(func=_run)


def _add_decode_options(p) -> None:
    """The options of how the decodes run: the fault drill, the progress lines, the comparison
    decode and the repeats."""
    p.add_argument(
        "--kill-holder",
        dest="kill_holder",
        type=int,
        default=None,
        help="kill this holder rank before --kill-after-step (fault drill)",
    )
    p.add_argument("--kill-after-step", dest="kill_after_step", type=int, default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    p.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the decode, decode again with every (chunk, agent) through the other of "
        "route and fetch, so that the model is measured on both (default: on, except with "
        "--force or the fault drill)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="run each decode this many times, each from an empty pool, and score every call "
        "by its median over them; each single decode's MAPE is printed beside (default 5; 1 "
        "in the fault drill)",
    )


def _add_instead(p) -> None:
    """The options that run another demo instead: ``--hf`` and ``--device-route``."""
    p.add_argument(
        "--hf",
        nargs="?",
        const="deepseek_v2",
        choices=("deepseek_v2", "deepseek_v3"),
        default=None,
        help="instead: a Hugging Face DeepSeek model (deepseek_v2 when no class is named) "
        "generating with its context on the holders, checked against its own generate; takes "
        f"--transport ({' or '.join(HF_TRANSPORTS)}), --kernels, --force, --profile, --out, "
        "--holders, --replicas, --seed, --steps (new tokens) and the fault drill",
    )
    p.add_argument(
        "--device-route",
        dest="device_route",
        action="store_true",
        help="instead: the corpus routed over the device route (a resident holder kernel, the "
        "requester's put and wait-then-merge kernels; one-shot and interpreted on a CPU), every "
        "layer checked against fp64 and timed (docs/device-route.md); takes --layers, --chunks, "
        "--min-tokens, --max-tokens, --seed, --device, --out",
    )
