"""Dense paged absorbed-MLA decode partial in Gluon for sm_90: opt-in, unverified on a GPU.

The holder's compute (§3.3 of the paper) over FlashMLA's layout, written in Triton's Gluon
(``triton.experimental.gluon``: explicit layouts, shared memory, TMA, mbarriers and async
warpgroup MMA). Nothing in the default path calls it: it is a candidate until a GPU run checks
it against fp64 and times it against the default ``tl`` path (``perf/gpu_gluon.sh``,
docs/gluon-decode.md). Gluon kernels do not run in the Triton interpreter: on a CPU, under
the interpreter, or on a GPU other than sm_90 :func:`mla_decode_gluon` checks its inputs and
then raises ``RuntimeError``. ``import mqnc`` never imports Gluon (the kernel lives in the
private ``mla.gluon_kernels``, imported when a launch or a compile needs it).

Schedule (one CTA = 64 query heads of one query row and one split of its cache; 8 warps, two
warpgroups; 128 heads = two CTAs side by side on grid axis 0, reading the same pages, the
second from L2):

- **Q** ``[64, 576]`` is loaded once by TMA (nine 64 x 64 boxes) and stays in shared memory.
- **KV ring**: ``STAGES`` stages of ``BLOCK_N`` cache entries (one 64-entry page per stage at
  ``block_n=64``, two stages; two pages in one stage at ``block_n=128``), each page nine TMA
  boxes of 64 x 64 bf16 (128-byte swizzle) on one mbarrier per stage. At ``block_n=64`` the
  next block's TMA loads are issued while this block's ``QK^T`` runs and have the softmax and
  the ``PV`` product to land.
- **QK^T**: two async ``warpgroup_mma`` (latent K = 512 and rope K = 64) into a ``[64,
  BLOCK_N]`` fp32 score tile laid out ``warps_per_cta [4, 2]``: each warpgroup computes the
  scores of its own ``BLOCK_N / 2`` entries (at ``block_n=128`` its own 64-entry page, as
  FlashMLA's warpgroups do), so no warpgroup recomputes another's product (redundancy 1.0:
  the SASS's HGMMA multiply-accumulates equal ``64 x BLOCK_N x (576 + 512)`` per block).
- **Softmax**: online, base 2 (the scale pre-multiplied by log2 e), fp32 running max and
  denominator; entries past the row's length masked; the row max across both warpgroups.
- **P exchange**: ``P`` in bf16 (as FlashMLA rounds it) is stored to shared memory over the
  stage's rope tile (read by ``QK^T`` already): each warpgroup writes its entries' columns,
  both read all of ``P``.
- **PV**: one async ``warpgroup_mma`` of ``P [64, BLOCK_N]`` by the stage's latent tile
  ``[BLOCK_N, 512]`` into the ``[64, 512]`` fp32 accumulator, ``warps_per_cta [4, 2]``: each
  warpgroup accumulates its own half of the 512 output columns over all entries of the block.
- **Tail**: value rows past the row's length in its last page are zeroed in shared memory once
  (the pool's padding may hold NaN; ``0 x NaN`` would reach the output).
- **Split-KV**: split ``s`` of ``S`` attends ``ceil(ceil(n / BLOCK_N) / S)`` blocks of the row
  (``mla.decode``'s rule); ``S > 1`` writes fp32 partials ``[S, R, H, 512]`` / ``[S, R, H]``
  that the package's merge kernel combines (``merge.partials.merge_launch``), ``S = 1`` writes the
  outputs directly. ``num_splits=None``: ``_core.grid.choose_num_splits`` at one CTA per SM (the
  kernel's 221,720 B of shared memory).

Where ``schedule="sync"`` is not FlashMLA's schedule, and why: both warpgroups run one
instruction stream, so they meet at the row-max reduction and at the ``P`` exchange instead of
see-sawing (one warpgroup's softmax under the other's MMA); the ``wgmma`` waits leave no group
in flight (a loop-carried in-flight accumulator made ptxas serialize every HGMMA of the loop:
40 waits instead of 2, seen under triton 3.6.0), so the overlap is the TMA prefetch under the
block's MMAs and softmax, the row-sum under ``PV``, and the page-id load and TMA issue under
``QK^T``. At ``block_n=128`` (each warpgroup its own page, FlashMLA's split) two pages fill all
shared memory left beside Q, so that variant has one stage and loads the next block only after
``PV``: a comparison point for the GPU check.

``schedule="seesaw"`` is FlashMLA's see-saw, warp-specialized (``gl.warp_specialize``; 12
warps, 168 registers at launch, 222,608 B of shared memory): a split's pages are paired, page A
in buffer 0 and page B in buffer 1, loaded by a one-warp TMA partition as soon as both
consumers release a buffer. Warpgroup 0 (the default partition, 4 warps, 240 registers)
computes ``QK^T`` of page A (HGMMA 64x64x16, its own page) while warpgroup 1 (a 4-warp worker,
240 registers) computes page B's; warpgroup 0's softmax publishes A's row max, row sum and
``P_A`` (over A's rope tile) through shared memory and an mbarrier; warpgroup 1 issues its
half of ``P_A V_A``, and while it runs takes the pair's max from A's and its own scores and
publishes ``P_B`` and the pair's max; each warpgroup
rescales its own 256 output columns (``[64, 256]`` fp32, 128 registers a thread) and
accumulates ``P_A V_A`` and ``P_B V_B`` into them (HGMMA 64x256x16). So warpgroup 1's softmax
runs under warpgroup 0's ``P_A V_A``, and warpgroup 0's ``QK^T`` of the next page under
warpgroup 1's ``PV``. Every wgmma wait waits for all of its warpgroup's groups (ptxas
serializes the loop otherwise, as in the sync schedule); warpgroup 1 computes its softmax
between issuing its ``P_A V_A`` and that wait. The buffers are indexed through an opaque
zero (inline asm) so the compiler recomputes the 72 wgmma descriptors per pair instead of
hoisting and spilling them. Each 64 x 64 box arrives on its own mbarrier and ``QK^T`` is
issued box by box as they land (FlashMLA's fine-grained TMA / GEMM overlap). Not yet
FlashMLA's: no third buffer.

Inputs: bf16 only, 576-wide rows (512 latent + 64 rope), page size 64, one KV head.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from mqnc.triton_kernels._core.execution import interpreted
from mqnc.triton_kernels._core.grid import choose_num_splits, device_limits
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.validate import (
    check_flags,
    check_num_splits,
    check_same_device,
    check_softmax_scale,
    check_tensor,
)
from mqnc.triton_kernels.merge.partials import merge_launch
from mqnc.triton_kernels.mla.plan import split_outputs, split_strides

__all__ = [
    "mla_decode_gluon",
    "gluon_decode_launches",
    "gluon_supported",
    "choose_splits",
    "descriptor_layout",
    "seesaw_kernel",
    "BLOCK_H",
    "BLOCK_NS",
    "LOG2E",
    "SCHEDULES",
    "PAGE",
    "D_QK",
    "D_V",
]

PAGE = 64  # FlashMLA's page size, the only one this kernel reads
D_QK = 576
D_V = 512
BLOCK_H = 64
BLOCK_NS = (64, 128)  # entries per block: 64 (two-stage ring, the candidate) or 128
SCHEDULES = ("sync", "seesaw")
LOG2E = 1.4426950408889634


def _stages(block_n: int) -> int:
    return 2 if block_n == 64 else 1


def gluon_supported(device: torch.device) -> str | None:
    """None when the Gluon kernel can launch on ``device``, else why not (a sentence)."""
    if interpreted(device):
        return "Gluon kernels need a CUDA sm_90 device; the Triton interpreter runs none"
    if device.type != "cuda":
        return f"Gluon kernels need a CUDA sm_90 device, the tensors are on {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the Gluon MLA kernel is written for sm_90 (Hopper), this GPU is sm_{major}{minor}"
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return f"triton {triton.__version__} has no triton.experimental.gluon"
    return None


@dataclasses.dataclass(frozen=True)
class _Checked:
    q3: torch.Tensor  # [R, H, 576], rows of 576 with unit stride, 16-byte aligned
    kv2: torch.Tensor  # [num_pages * 64, 576] view of the cache
    table: torch.Tensor
    lens: torch.Tensor
    b: int
    s_q: int
    scale: float


def _check(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, num_splits, block_n,
           schedule="sync"):  # fmt: skip
    check_tensor("q", q, ndim=4, dtypes=(torch.bfloat16,))
    b, s_q, h, d = q.shape
    if d != D_QK:
        raise ValueError(f"q: expected [b, s_q, h_q, {D_QK}] (512 latent + 64 rope), got {d}")
    check_tensor("kv_cache", kv_cache, dtypes=(torch.bfloat16,))
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv = kv_cache[:, :, 0]
    elif kv_cache.dim() == 3:
        kv = kv_cache
    else:
        raise ValueError(
            f"kv_cache: expected [num_pages, {PAGE}, 1, {D_QK}] or [num_pages, {PAGE}, {D_QK}], "
            f"got {tuple(kv_cache.shape)}"
        )
    if tuple(kv.shape[1:]) != (PAGE, D_QK):
        raise ValueError(
            f"kv_cache: expected pages of {PAGE} entries of {D_QK}, got {tuple(kv_cache.shape)}"
        )
    sp, se, sd = kv.stride()
    if sd != 1 or sp != PAGE * se or se % 8 or kv.data_ptr() % 16:
        raise ValueError(
            f"kv_cache: expected its entries as rows of one 2-D tensor (strides (64 * s, s, 1), "
            f"s a multiple of 8, 16-byte aligned; TMA reads it in place), got strides "
            f"{kv.stride()}"
        )
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,))
    if block_table.shape[0] != b or cache_seqlens.shape[0] != b:
        raise ValueError(
            f"block_table / cache_seqlens: expected {b} rows (q's batch), got "
            f"{block_table.shape[0]} / {cache_seqlens.shape[0]}"
        )
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table: expected unit stride on dim 1, got {block_table.stride()}")
    check_same_device(q=q, kv_cache=kv_cache, block_table=block_table, cache_seqlens=cache_seqlens)
    scale = check_softmax_scale(softmax_scale)
    check_flags(causal=causal)
    check_num_splits(num_splits)
    if block_n not in BLOCK_NS:
        raise ValueError(f"block_n: expected one of {BLOCK_NS}, got {block_n!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if schedule == "seesaw" and block_n != 64:
        raise ValueError(f"block_n: the see-saw schedule pairs 64-entry pages, got {block_n}")
    q3 = q.reshape(b * s_q, h, d)
    if q3.stride(2) != 1 or q3.stride(0) != h * q3.stride(1) or q3.stride(1) % 8:
        q3 = q3.contiguous()
    if q3.data_ptr() % 16:
        q3 = q3.clone()
    kv2 = kv.as_strided((kv.shape[0] * PAGE, D_QK), (se, 1))
    return _Checked(q3, kv2, block_table, cache_seqlens, b, s_q, scale)


def choose_splits(
    rows: int, heads: int, max_blocks: int, block_n: int, device, min_tiles: int = 1
) -> int:
    """The split count: ``_core.grid.choose_num_splits`` for this kernel at one CTA per SM (its
    shared memory), the two head blocks of a 128-head row sharing each page's DRAM read; at
    least ``min_tiles`` blocks a split (the see-saw's 2: a page pair)."""
    head_blocks = triton.cdiv(heads, BLOCK_H)
    limits = device_limits(device)
    return choose_num_splits(
        rows * head_blocks,
        triton.cdiv(max_blocks * PAGE, block_n),
        min_tiles=min_tiles,
        tile_bytes=block_n * D_QK * 2 // head_blocks,
        in_bytes=BLOCK_H * D_QK * 2,
        out_bytes=BLOCK_H * (D_V * 2 + 4),
        split_out_bytes=BLOCK_H * (D_V * 4 + 4),
        merge_ctas=BLOCK_H * -(-D_V * 4 // 512),
        slots=limits.sms,
        sms=limits.sms,
    )


def descriptor_layout():
    """The shared-memory layout of every TMA box the kernels read: 64 bf16 wide (128 bytes), the
    128-byte swizzle."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def _descriptors(q3: torch.Tensor, kv2: torch.Tensor):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = descriptor_layout()
    R, H, _ = q3.shape
    q_desc = TensorDescriptor(q3, [R * H, D_QK], [q3.stride(1), 1], [BLOCK_H, 64], layout)
    kv_desc = TensorDescriptor(kv2, list(kv2.shape), list(kv2.stride()), [64, 64], layout)
    return q_desc, kv_desc


def _kernel(schedule: str, block_n: int, out: str):
    """The Gluon kernel of a schedule, its launch name and its own constexprs and options."""
    from mqnc.triton_kernels.mla import gluon_kernels

    if schedule == "seesaw":
        return seesaw_kernel(out)
    st = _stages(block_n)
    name = f"mla_decode_gluon[bfloat16,64x{block_n},w8,s{st},out={out}]"
    return (
        gluon_kernels.gluon_mla_decode_kernel,
        name,
        dict(BLOCK_N=block_n, STAGES=st, num_warps=8),
    )


def seesaw_kernel(out: str, s_q: int = 1, causal: bool = False, split_cache: bool = False):
    """The see-saw kernel, its launch name (``out``: ``"bf16"`` unsplit, ``"fp32-split"``;
    ``s_q`` query tokens a sequence and ``causal``, constexprs of the kernel, named when not the
    default) and its options; ``split_cache``: the variant over FlashInfer's ``ckv`` / ``kpe``
    (``gluon_mla_seesaw_split_kernel``, opt-in until a GPU verifies it)."""
    from mqnc.triton_kernels.mla import gluon_kernels

    extra = (f",sq={s_q}" if s_q > 1 else "") + (",causal" if causal else "")
    schedule = "seesaw-split" if split_cache else "seesaw"
    name = f"mla_decode_gluon[bfloat16,64x64,{schedule},w4+4+1,out={out}{extra}]"
    fn = gluon_kernels.gluon_mla_seesaw_split_kernel if split_cache else (
        gluon_kernels.gluon_mla_seesaw_kernel
    )  # fmt: skip
    return fn, name, dict(num_warps=4)


def gluon_decode_launches(
    c: _Checked, *, causal: bool, num_splits: int | None, block_n: int, schedule: str = "sync"
) -> tuple[torch.Tensor, torch.Tensor, list[Launch]]:
    """The outputs ``o [R, H, 512]`` (bf16), ``lse [R, H]`` (fp32, natural log) and the
    launches that write them (the Gluon kernel, then the merge kernel when split), for checked
    inputs; nothing launches here."""

    R, H, _ = c.q3.shape
    max_blocks = c.table.shape[1]
    if num_splits is None:
        pair = 2 if schedule == "seesaw" else 1
        num_splits = choose_splits(R, H, max_blocks, block_n, c.q3.device, pair)
    o, lse, o_part, lse_part = split_outputs(R, H, D_V, c.q3.dtype, c.q3.device, num_splits)
    if R * H == 0:
        return o, lse, []
    q_desc, kv_desc = _descriptors(c.q3, c.kv2)
    fn, name, options = _kernel(schedule, block_n, "fp32-split" if num_splits > 1 else "bf16")
    kernel = Launch(
        name=name,
        kernel=fn,
        grid=(R * triton.cdiv(H, BLOCK_H), num_splits),
        args=(
            q_desc,
            kv_desc,
            c.table,
            c.lens,
            o_part,
            lse_part,
            H,
            max_blocks,
            c.table.stride(0),
            num_splits,
            *split_strides(o_part, lse_part),
            c.scale * LOG2E,
        ),
        kwargs=dict(S_Q=c.s_q, CAUSAL=causal, **options),
    )
    launches = [kernel]
    if num_splits > 1:
        launches.append(merge_launch(o_part, lse_part, o, lse))
    return o, lse, launches


def mla_decode_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool = False,
    num_splits: int | None = None,
    block_n: int = 64,
    schedule: str = "sync",
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense paged partial attention in FlashMLA's layout, by the Gluon kernel (module
    docstring: the schedule). Opt-in and unverified until a GPU run checks it against fp64.

    Parameters
    ----------
    q : torch.Tensor
        ``[b, s_q, h_q, 576]`` bf16 absorbed query rows (512 latent + 64 rope), unit stride on
        the last dim.
    kv_cache : torch.Tensor
        ``[num_pages, 64, 1, 576]`` (FlashMLA's) or ``[num_pages, 64, 576]`` bf16, its entries
        rows of one 2-D tensor (read in place by TMA).
    block_table : torch.Tensor
        ``[b, max_blocks]`` int32 page ids, one row per sequence (shared by its ``s_q`` rows);
        entries past a row's length are never read.
    cache_seqlens : torch.Tensor
        ``[b]`` int32 entries per sequence, at most ``64 * max_blocks``.
    softmax_scale : float
        The model's scale, required.
    causal : bool
        FlashMLA's rule: query token ``i`` of ``s_q`` attends the first
        ``cache_seqlens[b] - s_q + i + 1`` entries.
    num_splits : int or None
        Splits of each row's cache (None: the split policy, one CTA per SM).
    block_n : int
        ``"sync"``: 64 (two-stage TMA ring) or 128 (each warpgroup its own page, one stage);
        ``"seesaw"``: 64.
    schedule : str
        ``"sync"`` (8 warps in one instruction stream) or ``"seesaw"`` (warp-specialized,
        FlashMLA's see-saw; module docstring).
    check_inputs : bool
        Check every length against the table's capacity (one device sync).

    Returns
    -------
    o : torch.Tensor
        ``[b, s_q, h_q, 512]`` bf16.
    lse : torch.Tensor
        ``[b, h_q, s_q]`` float32, natural log, contiguous (FlashMLA's); ``-inf`` for a row with
        nothing to attend (``o = 0`` there).

    Raises
    ------
    TypeError, ValueError
        A bad argument, named.
    RuntimeError
        No CUDA sm_90 device (a CPU, the interpreter, another GPU) or no Gluon in this triton.
    """
    c = _check(
        q,
        kv_cache,
        block_table,
        cache_seqlens,
        softmax_scale,
        causal,
        num_splits,
        block_n,
        schedule,
    )
    why = gluon_supported(q.device)
    if why is not None:
        raise RuntimeError(f"mla_decode_gluon: {why}; the default path is mla_decode_with_kvcache")
    if check_inputs and c.lens.numel():
        lo, hi = int(c.lens.min()), int(c.lens.max())
        if lo < 0 or hi > c.table.shape[1] * PAGE:
            raise ValueError(
                f"cache_seqlens: expected 0 .. {c.table.shape[1] * PAGE} (block_table's "
                f"capacity), got {lo} .. {hi}"
            )
    o, lse, launches = gluon_decode_launches(
        c, causal=causal, num_splits=num_splits, block_n=block_n, schedule=schedule
    )
    for launch in launches:
        launch()
    h = q.shape[2]
    o4 = o.view(c.b, c.s_q, h, D_V)
    return o4, lse.view(c.b, c.s_q, h).transpose(1, 2).contiguous()
