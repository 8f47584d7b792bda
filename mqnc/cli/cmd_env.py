"""``mqnc env``: what a bug report needs (versions, device, kernel mode)."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import sys

from mqnc import __version__
from mqnc.base.runtime import device_name, kernel_mode, use_interpreter_without_cuda

__all__ = ["collect", "register"]


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def collect() -> dict:
    """Versions, device and kernel mode, as a dict (``mqnc env --json`` prints it)."""
    use_interpreter_without_cuda()
    import torch  # here: registering this command must not load torch (``mqnc --help``)

    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "mqnc": __version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "numpy": _version("numpy"),
        "einops": _version("einops"),
        "transformers": _version("transformers"),
        "nvshmem4py": _version("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py"),
        "nvidia_nvshmem": _version("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
        "cuda_core": _version("cuda-core"),
        "cuda_pathfinder": _version("cuda-pathfinder"),
        "cuda_available": torch.cuda.is_available(),
        "device": device_name(),
        "kernels": kernel_mode(),
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        info["capability"] = f"sm_{major}{minor}"
        info["cuda"] = torch.version.cuda
    from mqnc.triton_kernels.dispatch import Target, table_rows

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info["dispatch"] = table_rows(Target.of(device))
    return info


def _run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        rows = info.pop("dispatch")
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value if value is not None else '-'}")
        print("\nbackends on this device (mqnc.triton_kernels.dispatch; force one with "
              "MQNC_BACKEND=op=backend):")  # fmt: skip
        for row in rows:
            print(f"  {row['op']:<11} {row['backend']:<6} {row['kernel']}: {row['status']}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "env",
        help="print versions, device and kernel mode (for bug reports)",
        description="Print the versions of Python, mqnc, torch, triton and the optional "
        "packages, the device, and whether kernels run compiled or under Triton's "
        "interpreter: paste it into bug reports.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_run)
