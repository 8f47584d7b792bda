"""The demo's configuration: everything a run depends on (torch-free: ``mqnc demo --help``
reads its defaults)."""

from __future__ import annotations

import dataclasses

from mqnc.base.checks import check_int

__all__ = ["DemoConfig", "HFDemoConfig", "TRANSPORTS", "HF_TRANSPORTS", "REQUESTER", "LANES"]

TRANSPORTS = ("gloo", "loopback", "nvshmem")
HF_TRANSPORTS = ("gloo", "loopback")
REQUESTER = 0
"""The requester's rank; holders are ranks ``1..holders``."""
LANES = 8
"""Requests in flight per (requester, holder) pair: a routed wave sends at most this many."""


@dataclasses.dataclass
class DemoConfig:
    """Everything a run depends on; the defaults finish in under 2 minutes on 2 CPU cores."""

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
    steps: int = 2
    hidden: int = 256
    seed: int = 0
    transport: str = "gloo"
    force: str | None = None
    profile: str | None = None
    out: str = "mqnc-demo-out"
    block_size: int = 64
    timeout_s: float = 60.0
    device: str | None = None
    kill_holder: int | None = None
    kill_after_step: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "chunks", "min_tokens", "holders", "replicas", "steps", "hidden"):
            check_int(name, getattr(self, name), minimum=1)
        if self.max_tokens < self.min_tokens:
            raise ValueError(
                f"max_tokens: expected >= min_tokens ({self.min_tokens}), got {self.max_tokens}"
            )
        if self.replicas > self.holders:
            raise ValueError(f"replicas: expected <= holders ({self.holders}), got {self.replicas}")
        if self.chunks_per_agent > self.chunks:
            raise ValueError(
                f"chunks_per_agent: expected <= chunks ({self.chunks}), got {self.chunks_per_agent}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: expected one of {TRANSPORTS}, got {self.transport!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device: expected None, 'cpu' or 'cuda', got {self.device!r}")
        if self.force not in (None, "route", "fetch", "local"):
            raise ValueError(f"force: expected route, fetch or local, got {self.force!r}")
        if self.kill_holder is not None and not 1 <= self.kill_holder <= self.holders:
            raise ValueError(
                f"kill_holder: expected a holder rank in 1..{self.holders}, got {self.kill_holder}"
            )

    @property
    def agents(self) -> int:
        """Sub-agents in all: whole-chunk plus selection agents."""
        return self.whole_agents + self.selection_agents


@dataclasses.dataclass
class HFDemoConfig:
    """``mqnc demo --hf``: everything a run depends on; the defaults take about a minute on 2
    CPU cores (:mod:`mqnc.demo.hf`)."""

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
        choices = dict(
            kind=("deepseek_v2", "deepseek_v3"),
            dtype=("float32", "bfloat16"),
            transport=HF_TRANSPORTS,
            kernels=("triton", "torch"),
            force=(None, "route", "fetch", "local"),
        )
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        check_int("replicas", self.replicas, minimum=1, below=self.holders + 1)
        if self.kill_holder is not None and not 1 <= self.kill_holder <= self.holders:
            raise ValueError(
                f"kill_holder: expected a holder rank in 1..{self.holders}, got {self.kill_holder}"
            )
