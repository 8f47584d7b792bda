"""Everything the demo checks before any work starts: what the configuration alone cannot say
(a CUDA device for ``device="cuda"`` or NVSHMEM, the profile file, the output folder, the
plotting library), and the defaults that depend on the machine (device, kernels) resolved."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from mqnc.demo.config import DemoConfig
from mqnc.demo.profile_file import LoadedProfile, load_profile
from mqnc.transport import ENGINES, names

__all__ = ["Prepared", "default_kernels", "make_out", "prepare"]


def make_out(out: str) -> None:
    """Create the output folder ``out`` (a ``ValueError`` naming it when it is a file or not
    writable): checked before any work, so that a run never ends unable to write its result."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out: {out!r} exists and is not a folder")
    os.makedirs(out, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise ValueError(f"out: the folder {out!r} is not writable")


def default_kernels(device: str) -> str:
    """The MLA demo's kernels when ``--kernels`` is not given: ``"triton"`` on ``"cuda"``,
    ``"torch"`` (the fp64 references, rounded once) on ``"cpu"``, where Triton would be
    interpreted. (``mqnc demo --hf`` defaults to ``HFDemoConfig.kernels``, triton on both.)"""
    return "triton" if device == "cuda" else "torch"


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A checked run: the configuration with ``device`` and ``kernels`` resolved, and the
    loaded profile (None: calibrate everything)."""

    cfg: DemoConfig
    profile: LoadedProfile | None


def prepare(cfg: DemoConfig) -> Prepared:
    """Check what a run needs from this machine and resolve the machine-dependent defaults;
    raises ``ValueError`` / ``FileNotFoundError`` naming the argument (before any work)."""
    if not isinstance(cfg, DemoConfig):
        raise TypeError(f"cfg: expected a DemoConfig, got {type(cfg).__name__}")
    import torch  # here: the CLI's parser and DemoConfig stay torch-free

    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        raise ValueError(
            "device: 'cuda' asked for, but torch sees no CUDA device on this machine "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use --device cpu"
        )
    device = cfg.device or ("cuda" if cuda else "cpu")
    engine = ENGINES[cfg.transport]
    if engine.needs_gpu:
        if device != "cuda":
            host = " or ".join(repr(n) for n in sorted(names(needs_gpu=False)))
            raise ValueError(
                f"transport: {cfg.transport!r} needs {engine.requires}; this machine has device "
                f"{device!r}: use {host}"
            )
        why = engine.unavailable()
        if why is not None:
            raise ValueError(f"transport: {why}")
    kernels = cfg.kernels or default_kernels(device)
    profile = None if cfg.profile is None else load_profile(cfg.profile)
    make_out(cfg.out)
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "out: the demo draws measured against predicted with matplotlib, which is not "
            "installed: pip install 'mqnc[notebooks]'"
        )
    return Prepared(dataclasses.replace(cfg, device=device, kernels=kernels), profile)
