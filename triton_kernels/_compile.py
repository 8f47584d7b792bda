"""Compile kernels for a real GPU target without a GPU, and read their resource usage.

The interpreter accepts code the GPU compiler rejects, so the test suite also builds every
kernel for sm_90 (Hopper, the lent H200) at its production block sizes and bf16, through
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``, then reads registers,
stack and local memory (spills) with the ``cuobjdump`` that Triton's wheel ships, and the
SASS with ``nvdisasm``/``cuobjdump -sass`` (HMMA/HGMMA for tensor-core work).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mqnc.base.env import interpreting

__all__ = ["KernelResources", "compile_for", "cuobjdump_path"]


@dataclasses.dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    stack: int
    local: int
    shared: int
    mma: tuple[str, ...]

    @property
    def spills(self) -> bool:
        return self.local > 0 or self.stack > 0


def cuobjdump_path() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_for(spec: dict, arch: int = 90) -> KernelResources:
    """Compile one ``compile_specs()`` entry for ``sm_<arch>`` and read its resource usage."""
    src = ASTSource(
        fn=spec["fn"], signature=spec["signature"], constexprs=spec.get("constexprs", {})
    )
    options = {k: spec[k] for k in ("num_warps", "num_stages") if k in spec}
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run(
            [cuobjdump_path(), "-res-usage", path], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [cuobjdump_path(), "-sass", path], capture_output=True, text=True, check=True
        ).stdout

    def field(key: str) -> int:
        m = re.search(rf"\b{key}:(\d+)", usage)
        if m is None:
            raise RuntimeError(f"cuobjdump -res-usage gave no {key} for {spec['name']}:\n{usage}")
        return int(m.group(1))

    mma = tuple(sorted(set(re.findall(r"\b(HGMMA|HMMA|IMMA)\b", sass))))
    return KernelResources(
        name=spec["name"],
        registers=field("REG"),
        stack=field("STACK"),
        local=field("LOCAL"),
        shared=int(kernel.metadata.shared),
        mma=mma,
    )


def compile_all(arch: int = 90) -> list[dict]:
    """Compile every ``compile_specs()`` entry of every kernel module; one dict per kernel.

    Must run with ``TRITON_INTERPRET`` unset (under the interpreter ``@triton.jit`` yields
    interpreted functions that cannot be compiled); the test suite calls it in a subprocess.
    A kernel that fails to compile is reported with its error instead of raising.
    """
    import importlib

    from mqnc.triton_kernels import KERNEL_MODULES

    out = []
    for module in KERNEL_MODULES:
        mod = importlib.import_module(f"mqnc.triton_kernels.{module}")
        for spec in mod.compile_specs():
            try:
                out.append({"ok": True, **dataclasses.asdict(compile_for(spec, arch))})
            except Exception as exc:  # noqa: BLE001 - reported to the caller, which fails the test
                out.append(
                    {"ok": False, "name": spec["name"], "error": f"{type(exc).__name__}: {exc}"}
                )
    return out


if __name__ == "__main__":
    import json
    import sys

    if interpreting():
        sys.exit("unset TRITON_INTERPRET to compile for a GPU target")
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
