"""The serving primitives (§3, §5.3, §6.3): a holder that serves probe / route / fetch from its
paged pool, and a requester that probes, routes, fetches and re-prefills.

- :mod:`mqnc.serving.holder`: :class:`Holder`, the service loop (receive, check, answer).
- :mod:`mqnc.serving.batching`: the holder's dispatcher batching, one kernel call per group.
- :mod:`mqnc.serving.requester`: :class:`Requester`, the four primitives and the merge.
- :mod:`mqnc.serving.client`: the requester's lanes, request ids, send and wait.
- :mod:`mqnc.serving.route`: the route's request (checked, rotated, packed) and reply.
- :mod:`mqnc.serving.pool`: the paged pool (allocator, splice, partial attention over it),
  the holder's and the requester's.
- :mod:`mqnc.serving.policy`: the requester's fallback policy over replicas and primitives.
- :mod:`mqnc.serving.records`: chunk directory entries, partials and cost records.
- :mod:`mqnc.serving.compute`: the five kernel calls by the Triton kernels or their torch
  references (``kernels=`` on the holder, the requester and the pool).
- :mod:`mqnc.serving.corpus`: a context's latent cache as chunks placed on holder ranks; the
  corpus file (JSON manifest + safetensors).
- :mod:`mqnc.serving.service`: one rank of a holder / requester job under torchrun (what
  ``mqnc serve`` runs); :mod:`mqnc.serving.local`: a corpus' holders on this machine
  (threads, or gloo processes: :mod:`mqnc.serving.holder_process`).

Importing this package imports the kernels: on a CPU-only machine choose the interpreter first
(:func:`mqnc.base.use_interpreter_without_cuda`).
"""

from mqnc.serving.batching import HostedChunk
from mqnc.serving.client import RemoteError, RouteTimeout
from mqnc.serving.compute import KERNELS, kernel_ops
from mqnc.serving.corpus import ChunkSpec, Corpus
from mqnc.serving.holder import Holder, HolderStats
from mqnc.serving.local import LocalHolders
from mqnc.serving.policy import AllPrimitivesFailed
from mqnc.serving.pool import LocalChunks, PagedPool
from mqnc.serving.records import ChunkInfo, CostRecord, LocalChunk, Partial
from mqnc.serving.requester import Requester
from mqnc.serving.service import ServeContext, run_rank

__all__ = [
    "Holder",
    "HolderStats",
    "HostedChunk",
    "Requester",
    "ChunkInfo",
    "LocalChunk",
    "Partial",
    "CostRecord",
    "RouteTimeout",
    "RemoteError",
    "AllPrimitivesFailed",
    "PagedPool",
    "LocalChunks",
    "KERNELS",
    "kernel_ops",
    "Corpus",
    "ChunkSpec",
    "LocalHolders",
    "ServeContext",
    "run_rank",
]
