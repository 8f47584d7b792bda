"""The demo's configuration: everything a run depends on (torch-free: ``mqnc demo --help``
reads its defaults)."""

from __future__ import annotations

import dataclasses

from mqnc.base.checks import check_int, check_number
from mqnc.transport import ENGINES, names

__all__ = [
    "DemoConfig",
    "HFDemoConfig",
    "TRANSPORTS",
    "HF_TRANSPORTS",
    "KERNELS",
    "KV_DTYPES",
    "HolderStartupError",
    "REQUESTER",
    "LANES",
]

TRANSPORTS = tuple(sorted(names()))
"""The demo's engines: every engine of the registry (:mod:`mqnc.transport.registry`)."""
KERNELS = ("triton", "torch")
KV_DTYPES = {"bf16": "bf16", "fp8": "fp8_e4m3"}
"""``--kv-dtype`` -> the holders' cache format (``MLAGeometry.cache_dtype``): bf16 rows
(1152 B a token-layer) or DeepSeek-V3.2's FP8 entries (656 B, ``mqnc.model.kv_format``)."""
HF_TRANSPORTS = tuple(sorted(names(needs_gpu=False)))
"""The Hugging Face demo's engines: those that run on any machine."""
REQUESTER = 0
"""The requester's rank; holders are ranks ``1..holders``."""
LANES = 8
"""Requests in flight per (requester, holder) pair: a routed wave sends at most this many."""


class HolderStartupError(RuntimeError):
    """A holder failed or died before it served (the message names the holder and what it
    said); raised by the demo's cluster, here so that the CLI can name it without torch."""


@dataclasses.dataclass
class DemoConfig:
    """Everything a run depends on (checked here, torch-free; what needs torch, such as whether
    a CUDA device exists, :func:`mqnc.demo.run_demo` checks before any work).

    ``device`` None: ``"cuda"`` when a CUDA device exists, else ``"cpu"``. ``kernels`` None:
    ``"triton"`` (the compiled kernels) on ``"cuda"``, ``"torch"`` (the fp64 references rounded
    once, :mod:`mqnc.serving.compute`) on ``"cpu"``, where the Triton interpreter would time the
    interpreter, not the method. ``whole_agents``: agents reading ``chunks_per_agent`` chunks
    each at new offsets, split into teams (agents forked from one context, reading the same
    chunks at the same offsets) and given their chunks from the constants
    (:mod:`mqnc.demo.teams`). ``steps``: tokens every agent decodes; one by default, so that a
    chunk read by one agent costs route ``L`` calls (the fewest a decode pays: route's best
    case) and one read by a team of ``n`` agents ``n x L``. On the 2-core CPU of docs/demo.md
    (a call: a gloo round trip ~0.8-1 ms plus the holder's kernel call, ~0.85 ms and 0.22-0.28
    us a row x token; a fetch ~13-19 us a token) one reader's crossover falls at thousands of
    tokens or at none, past the default chunks' 256-512: route wins no read there, and the run
    names it with the numbers.
    ``topk``: entries each selection agent attends per layer and
    step, 1 .. ``chunks * min_tokens`` (the smallest corpus); a run without selection agents is
    ``selection_agents=0``. ``kill_after_step``: the step (0 .. ``steps - 1``) before which
    ``kill_holder`` is killed. ``compare``: after the decode, decode once more with every
    (chunk, agent) through the other of route and fetch (route for a ``local``), so that the
    model is measured on both primitives and the predicate's choice against the other; None:
    on unless ``force`` or the fault drill is given (True with either is an error).
    ``repeats``: how many times each decode runs, each from an empty pool; every call is then
    scored by its median over the repeats (the table, MAPE, the picture), each single decode's
    MAPE printed beside it (one decode's calls on a loaded 2-core machine spread by about as
    much as the goal allows). None: 5, or 1 under the fault drill (more with the
    drill is an error: a killed holder stays dead). ``kv_dtype``: the cache format the holders
    and the requester's pool keep (:data:`KV_DTYPES`): ``"fp8"`` quantizes every chunk to FP8
    entries when it enters a pool (fetched chunks move and splice as entries, re-prefilled ones
    are quantized), the cost model prices ``b_KV`` at 656 B, and answers are verified against
    fp64 over the dequantized cache with the quantization error reported apart; the agents'
    own suffixes stay bf16.
    """

    layers: int = 4
    chunks: int = 16
    min_tokens: int = 256
    max_tokens: int = 512
    holders: int = 2
    replicas: int = 1
    whole_agents: int = 3
    selection_agents: int = 1
    chunks_per_agent: int = 3
    topk: int = 256
    suffix_tokens: int = 16
    steps: int = 1
    hidden: int = 256
    seed: int = 0
    transport: str = "gloo"
    force: str | None = None
    profile: str | None = None
    out: str = "mqnc-demo-out"
    block_size: int = 64
    timeout_s: float = 60.0
    device: str | None = None
    kernels: str | None = None
    kill_holder: int | None = None
    kill_after_step: int = 0
    progress: bool = True
    compare: bool | None = None
    repeats: int | None = None
    kv_dtype: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("layers", "chunks", "min_tokens", "holders", "replicas", "steps", "hidden"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("whole_agents", "selection_agents", "suffix_tokens", "seed"):
            check_int(name, getattr(self, name), minimum=0)
        check_int("max_tokens", self.max_tokens, minimum=self.min_tokens)
        check_int("replicas", self.replicas, minimum=1, below=self.holders + 1)
        if self.agents < 1:
            raise ValueError(
                f"whole_agents + selection_agents: expected at least one agent, got "
                f"{self.whole_agents} + {self.selection_agents}"
            )
        if self.whole_agents:
            check_int("chunks_per_agent", self.chunks_per_agent, minimum=1, below=self.chunks + 1)
        if self.selection_agents:
            # every selection must fit in the smallest corpus the lengths can draw: a larger
            # top-k would be cut to the corpus, a smaller one is what the agent attends
            check_int("topk", self.topk, minimum=1, below=self.chunks * self.min_tokens + 1)
        check_int("block_size", self.block_size, minimum=16)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: expected a power of two >= 16, got {self.block_size}")
        _check_choices(
            self,
            transport=TRANSPORTS,
            device=(None, "cpu", "cuda"),
            kernels=(None, *KERNELS),
            force=(None, "route", "fetch", "local"),
            kv_dtype=tuple(KV_DTYPES),
        )
        if ENGINES[self.transport].needs_gpu and self.device == "cpu":
            raise ValueError(
                f"transport: {self.transport!r} runs on a CUDA device, got device='cpu'"
            )
        _check_run(self, steps=self.steps)

        if self.compare not in (None, True, False):
            raise ValueError(f"compare: expected a bool or None, got {self.compare!r}")
        if self.compare and (self.force is not None or self.kill_holder is not None):
            raise ValueError(
                "compare: the second decode runs the other primitive of the predicate's choice; "
                f"it applies without force and the fault drill, got force={self.force!r}, "
                f"kill_holder={self.kill_holder!r}"
            )
        if self.repeats is not None:
            check_int("repeats", self.repeats, minimum=1)
            if self.repeats > 1 and self.kill_holder is not None:
                raise ValueError(
                    f"repeats: the fault drill decodes once (its killed holder stays dead), got "
                    f"repeats={self.repeats} with kill_holder={self.kill_holder}"
                )

    @property
    def decode_repeats(self) -> int:
        """How many times each decode runs (:attr:`repeats`, resolved)."""
        if self.repeats is None:
            return 1 if self.kill_holder is not None else 5
        return self.repeats

    @property
    def calibration_rounds(self) -> int:
        """How many times the constants the profile lacks are measured: 3 when the decodes
        repeat (before the first repeat, after the middle one and after the last; the report
        predicts with the median of the three, robust to one slow spell), else 1. The run
        measures once whatever this says when its profile gives every term (nothing to
        measure)."""
        return 3 if self.decode_repeats > 1 else 1

    @property
    def comparing(self) -> bool:
        """Whether the run decodes a second time through the other primitive."""
        if self.compare is None:
            return self.force is None and self.kill_holder is None
        return self.compare

    @property
    def cache_dtype(self) -> str:
        """The geometry's ``cache_dtype`` of :attr:`kv_dtype`."""
        return KV_DTYPES[self.kv_dtype]

    @property
    def agents(self) -> int:
        """Sub-agents in all: whole-chunk plus selection agents."""
        return self.whole_agents + self.selection_agents


@dataclasses.dataclass
class HFDemoConfig:
    """``mqnc demo --hf``: everything a run depends on; the defaults take about a minute on 2
    CPU cores (:mod:`mqnc.demo.hf_demo`)."""

    kind: str = "deepseek_v2"
    dtype: str = "float32"
    context_tokens: int = 512
    chunk_tokens: int = 128
    prompt_tokens: int = 16
    new_tokens: int = 16
    holders: int = 2
    replicas: int = 1
    offset: int | None = 64
    transport: str = "gloo"
    kernels: str = "triton"
    force: str | None = None
    profile: str | None = None
    seed: int = 0
    out: str = "mqnc-demo-out"
    timeout_s: float = 300.0
    kill_holder: int | None = None
    kill_after_step: int = 0

    def __post_init__(self) -> None:
        for name in ("context_tokens", "chunk_tokens", "prompt_tokens", "new_tokens", "holders"):
            check_int(name, getattr(self, name), minimum=1)
        _check_choices(
            self,
            kind=("deepseek_v2", "deepseek_v3"),
            dtype=("float32", "bfloat16"),
            transport=HF_TRANSPORTS,
            kernels=("triton", "torch"),
            force=(None, "route", "fetch", "local"),
        )
        check_int("replicas", self.replicas, minimum=1, below=self.holders + 1)
        check_int("seed", self.seed, minimum=0)
        if self.offset is not None:
            check_int("offset", self.offset, minimum=0)
        _check_run(self, steps=self.new_tokens)


def _check_choices(cfg, **choices) -> None:
    """Each named field of ``cfg`` one of its allowed values."""
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"{name}: expected one of {allowed}, got {getattr(cfg, name)!r}")


def _check_run(cfg, *, steps: int) -> None:
    """The fields both demos share: the timeout, the profile (a file or a preset name), the
    output folder and the fault drill (a holder of ``1..holders`` killed after a step of
    ``[0, steps)``)."""
    check_number("timeout_s", cfg.timeout_s, positive=True)
    if cfg.profile is not None and (not isinstance(cfg.profile, str) or not cfg.profile):
        raise ValueError(f"profile: expected a file path or a preset name, got {cfg.profile!r}")
    if not isinstance(cfg.out, str) or not cfg.out:
        raise ValueError(f"out: expected a folder path, got {cfg.out!r}")
    if cfg.kill_holder is not None:
        check_int("kill_holder", cfg.kill_holder, minimum=1, below=cfg.holders + 1)
    check_int("kill_after_step", cfg.kill_after_step, minimum=0, below=steps)
