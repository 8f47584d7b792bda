"""mqnc: move the query, not the cache.

Triton kernels, transport and cost model for cross-instance latent (MLA) and sparse attention,
after Ma et al., "Move the Query, Not the Cache" (2026). Importing ``mqnc`` never touches a GPU.

Layout, bottom to top: a module imports its own subpackage and the layers below it, never one
above or beside it (``correctness/test_layout.py`` checks every import).

0. ``mqnc.base``: env switches, scalar argument checks, the kernel mode (no torch at import).
1. ``mqnc.triton_kernels`` (the folder ``triton_kernels/``): the Triton kernels, one folder
   per op family with its backends (``mla``: dense and sparse partial attention, tl and Gluon;
   ``merge``, ``splice``, ``fp8``, ``tp``, ``route``), the adapters to FlashMLA's and
   FlashInfer's layouts apart (``adapters``). ``mqnc.reference``: their fp64
   references. ``mqnc.testing``: the one comparison helper and its tolerance table.
2. ``mqnc.model``: MLA geometry and presets, the RoPE spec, absorption helpers and a small MLA
   model (§2, §3.3).
3. ``mqnc.transport``: the wire format and the transport engines (loopback, torch.distributed,
   NVSHMEM; §3.1-§3.2, §6). ``mqnc.cost``: fabric profiles, the cost model's terms, its fit and
   the route / fetch / local predicate (§4, §5; numpy only, no torch).
4. ``mqnc.serving``: the holder and the requester (§3, §5.3, §6.3); their arithmetic by the
   kernels or the torch references (``compute``); a context's cache as chunks on holders and
   its file (``corpus``); one rank of a torchrun job (``service``) and holders on this machine
   (``local``).
5. ``mqnc.measure``: the measurement harness ``perf/`` and ``mqnc calibrate`` share (echo
   holders, timing, the results file; §4.3). ``mqnc.integrations``: other people's models over
   holders (Hugging Face DeepSeek ``generate``, its exactness against transformers').
6. ``mqnc.demo``: the agentic fan-in, decided, executed, verified (§1, §6.3), and the same for a
   Hugging Face model (``mqnc demo --hf``). ``mqnc.plots``: the paper's figures from the model
   and the results file.
7. ``mqnc.cli``: the ``mqnc`` command (``mqnc corpus`` and ``mqnc serve`` among its commands).
"""

if __name__ != "mqnc":  # e.g. "mqnc.mqnc": a checkout named mqnc taken for the package
    raise ImportError(
        f"{__name__}: mqnc imported under another name from {__file__}: the folder holding it "
        "is a checkout of mqnc that Python took for the package (a namespace package, because "
        "the folder holding the checkout is on sys.path). Run from another folder (or from "
        "inside the checkout), or rename the checkout"
    )

__version__ = "0.1.0"
