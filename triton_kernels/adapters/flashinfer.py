"""FlashInfer's calling conventions over mqnc's kernels: adapters, not copies of the kernels.

- **MLA paged attention**: :class:`BatchMLAPagedAttentionWrapper` (FlashInfer's class, its
  ``__init__`` / ``plan`` / ``run`` flow unchanged) over :func:`plan_mla_paged_attention` /
  :func:`mla_paged_attention` (the same call as functions). Split query rows ``q_nope
  [N, H, 512]`` + ``q_pe [N, H, 64]`` and split caches ``ckv_cache [num_pages, page_size,
  512]`` + ``kpe_cache [num_pages, page_size, 64]``, read in place
  through their own pointers and strides (the kernels' ``SPLIT`` switch: no 576-wide copy is
  ever made), over a CSR page table ``kv_indptr [B + 1]`` / ``kv_indices [nnz]`` with
  ``kv_len [B]`` (read in place too: ``CSR``), any page size (1 included). ``N = B * s_q``
  query rows, the ``s_q`` rows of a request consecutive (FlashInfer's ``qo_indptr`` with equal
  steps; ragged query counts are not supported), ``causal`` as FlashMLA's (bottom-right).
  An FP8 ``ckv_cache`` (uint8 latent bytes + float32 scales, 528 B per token for 512; bf16
  ``kpe_cache``) is read in place the same way and dequantized in registers.
- **Merges** (``flashinfer.merge_state``, ``merge_state_in_place``, ``merge_states``):
  base-2 lse, states ``[seq_len, num_states, H, D]`` for ``merge_states``, and the in-place
  ``mask``; all through :func:`mqnc.triton_kernels.merge_partials` /
  :func:`~mqnc.triton_kernels.merge_partials_into` with ``layout="BMHD"`` and ``base2=True``
  (the merge kernel works in base 2 itself: nothing converted, masked rows untouched).

**LSE base.** FlashInfer's lse is base 2; every function here takes and returns base 2. The
MLA adapter returns ``o`` alone unless ``return_lse`` (FlashInfer's default) and converts the
kernel's natural-log lse on the way out (``lse / ln 2``, one small elementwise op) unless
``return_lse_base_on_e`` (FlashInfer's flag for the natural log); the merges convert nothing.
An empty row's lse is ``-inf``. The rest of mqnc is natural log (``lse_from_base2`` /
``lse_to_base2`` convert). The wrapper's ``float_workspace_buffer`` is accepted and not used
(the split-KV partials are allocated per run).
"""

from __future__ import annotations

import math

import torch

from mqnc.triton_kernels._core.execution import new_output
from mqnc.triton_kernels._core.validate import (
    argument_names,
    check_flags,
    check_int,
    check_same_device,
    check_softmax_scale,
    check_tensor,
    dtype_name,
)
from mqnc.triton_kernels.fp8.cache import is_fp8_pool
from mqnc.triton_kernels.merge.partials import lse_to_base2, merge_partials, merge_partials_into
from mqnc.triton_kernels.mla.decode import PagedLayout, checked_plan
from mqnc.triton_kernels.mla.plan import AttentionPlan

__all__ = [
    "BatchMLAPagedAttentionWrapper",
    "mla_paged_attention",
    "plan_mla_paged_attention",
    "FlashInferMLAPlan",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]


_LN2 = math.log(2.0)


def _to_base2_in_place(lse: torch.Tensor) -> torch.Tensor:
    """A natural-log float32 ``lse`` converted to base 2 in place (``lse_to_base2``'s division:
    the same bits) and returned."""
    return lse.div_(_LN2)


class FlashInferMLAPlan:
    """:func:`mla_paged_attention` planned once (FlashInfer's ``plan()``); ``run`` takes the
    call's tensors (same shapes, dtypes, strides, device: compared with the plan's, host
    metadata only), checks no value, never syncs."""

    def __init__(self, plan: AttentionPlan, return_lse: bool, lse_base_e: bool = False) -> None:
        self.plan = plan
        # run()'s shape errors name this layout's arguments (the plan binds them in this order)
        plan.names = ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "kv_indices", "kv_indptr",
                      "kv_len")  # fmt: skip
        self.num_splits = plan.num_splits
        self._return_lse, self._lse_base_e = return_lse, lse_base_e

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len, *, out=None):
        """``o [N, H, 512]``, and ``lse [N, H]`` when planned with ``return_lse`` (base 2, or
        the natural log with ``return_lse_base_on_e``). ``out``: ``(o, lse)``, contiguous
        tensors of those shapes (``o`` in the query dtype, ``lse`` float32), written in place
        (the lse in the planned base, converted in place) and returned."""
        o, lse = self.plan.run(
            q_nope, ckv_cache, kv_indptr, kv_indices, kv_len, q_pe=q_pe, kpe_pool=kpe_cache, out=out
        )
        if out is not None and not self._lse_base_e:
            lse = _to_base2_in_place(lse)
        if not self._return_lse:
            return o
        if out is not None or self._lse_base_e:
            return o, lse
        return o, lse_to_base2(lse)


# the kernels' checks, named as FlashInfer's callers know the arguments
_MLA_NAMES = {"q": "q_nope", "kv_pool": "ckv_cache", "kpe_pool": "kpe_cache", "kv_lens": "kv_len",
              "lens": "kv_len"}  # fmt: skip


def plan_mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    sm_scale: float,
    causal: bool = False,
    return_lse: bool = False,
    return_lse_base_on_e: bool = False,
    num_splits: int | None = None,
    check_inputs: bool = True,
    max_kv_len: int | None = None,
) -> FlashInferMLAPlan:
    """Plan :func:`mla_paged_attention` once for these tensors' shapes (checks and the split
    choice); ``plan.run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len)``."""
    check_flags(causal=causal, return_lse=return_lse, return_lse_base_on_e=return_lse_base_on_e)
    check_tensor("q_nope", q_nope, ndim=3)
    check_tensor("q_pe", q_pe, ndim=3)
    check_tensor("kv_indptr", kv_indptr, ndim=1)
    check_tensor("ckv_cache", ckv_cache, ndim=3)
    check_tensor("kpe_cache", kpe_cache, ndim=3)
    B, N = kv_indptr.shape[0] - 1, q_nope.shape[0]
    if B < 1 or N < B or N % B:
        raise ValueError(
            f"q_nope: expected N = B * s_q query rows, s_q >= 1, for B = {B} requests "
            f"(kv_indptr has B + 1 entries; equal query counts per request), got N = {N}"
        )
    with argument_names(_MLA_NAMES):
        plan, _ = checked_plan(
            q_nope,
            ckv_cache,
            kv_indices,
            kv_len,
            kv_indptr,
            softmax_scale=sm_scale,
            d_v=q_nope.shape[-1] if is_fp8_pool(ckv_cache) else ckv_cache.shape[-1],
            num_splits=num_splits,
            check_inputs=check_inputs,
            q_pe=q_pe,
            kpe_pool=kpe_cache,
            layout=PagedLayout(csr=True, s_q=N // B, causal=causal),
            max_kv_len=max_kv_len,
        )
    return FlashInferMLAPlan(plan, return_lse, return_lse_base_on_e)


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    sm_scale: float,
    causal: bool = False,
    return_lse: bool = False,
    return_lse_base_on_e: bool = False,
    num_splits: int | None = None,
    check_inputs: bool = True,
    max_kv_len: int | None = None,
):
    """Partial absorbed-MLA attention in FlashInfer's MLA layout (the holder's compute, §3.3).

    Parameters
    ----------
    q_nope : torch.Tensor
        ``[N, H, d_ckv]`` (``d_ckv = 512``): the absorbed latent part of the query rows,
        ``N = B * s_q``, a request's rows consecutive. bf16 / fp16 / fp32, unit last stride.
    q_pe : torch.Tensor
        ``[N, H, d_kpe]`` (64): the rotated rope part, same dtype.
    ckv_cache : torch.Tensor
        ``[num_pages, page_size, d_ckv]``: the latent cache (also the value), same dtype. Or
        FP8 (uint8 / float8_e4m3fn): ``[num_pages, page_size, d_ckv + 4 d_ckv / 128]``, the
        e4m3 latent bytes and their float32 scales (528 B for 512; ``mqnc.model.kv_format``),
        dequantized in registers to the query dtype; ``kpe_cache`` is then bf16.
    kpe_cache : torch.Tensor
        ``[num_pages, page_size, d_kpe]``: the rope cache.
    kv_indptr : torch.Tensor
        ``[B + 1]`` int32: request ``b``'s pages are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    kv_indices : torch.Tensor
        ``[nnz]`` int32 page ids.
    kv_len : torch.Tensor
        ``[B]`` int32 entries per request (FlashInfer's ``kv_len_arr``), the new tokens
        included.
    sm_scale : float
        The model's softmax scale, required.
    causal : bool
        With ``s_q > 1``: token ``i`` of a request attends its first ``kv_len - s_q + i + 1``
        entries (see ``adapters.flashmla``).
    return_lse : bool
        Also return the lse (FlashInfer's default: False, ``o`` alone).
    return_lse_base_on_e : bool
        The lse as the natural log (the kernels' own) instead of FlashInfer's base 2.
    num_splits, check_inputs, max_kv_len
        As in :func:`mqnc.triton_kernels.mla_decode_partial_csr`.

    Returns
    -------
    o : torch.Tensor
        ``[N, H, d_ckv]`` in the query dtype.
    lse : torch.Tensor
        ``[N, H]`` float32, **base 2** unless ``return_lse_base_on_e`` (only with
        ``return_lse``).
    """
    plan = plan_mla_paged_attention(
        q_nope,
        q_pe,
        ckv_cache,
        kpe_cache,
        kv_indptr,
        kv_indices,
        kv_len,
        sm_scale=sm_scale,
        causal=causal,
        return_lse=return_lse,
        return_lse_base_on_e=return_lse_base_on_e,
        num_splits=num_splits,
        check_inputs=check_inputs,
        max_kv_len=max_kv_len,
    )
    return plan.run(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``merge_states``: ``v [seq_len, num_states, H, D]``, base-2 ``s
    [seq_len, num_states, H]`` float32 -> ``(v [seq_len, H, D], s [seq_len, H])``, base 2."""
    return merge_partials(v, s, layout="BMHD", base2=True)


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's ``merge_state``: two states ``v [seq_len, H, D]``, base-2 ``s [seq_len,
    H]`` -> the merged ``(v, s)``, base 2 (``v_b`` / ``s_b`` as ``v_a`` / ``s_a``: shape, dtype,
    device)."""
    check_tensor("v_a", v_a, ndim=3)
    check_tensor("s_a", s_a, ndim=2, dtypes=(torch.float32,))
    check_tensor("v_b", v_b, dtypes=(v_a.dtype,), shape=tuple(v_a.shape))
    check_tensor("s_b", s_b, dtypes=(s_a.dtype,), shape=tuple(s_a.shape))
    check_same_device(v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)
    return merge_partials(
        torch.stack([v_a, v_b]), torch.stack([s_a, s_b]), layout="MBHD", base2=True
    )


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """FlashInfer's ``merge_state_in_place``: ``(v, s) <- merge((v, s), (v_other, s_other))``,
    base-2 ``s``; ``mask [seq_len]`` bool merges only the rows where it is true, leaving the
    others untouched (a captured CUDA graph skipping its padding)."""
    names = {"o_acc": "v", "lse_acc": "s", "o_new": "v_other", "lse_new": "s_other"}
    with argument_names(names):
        merge_partials_into(v, s, v_other, s_other, mask=mask, base2=True)


_BACKENDS = ("auto", "fa2", "fa3")
_BUFFERS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")


class BatchMLAPagedAttentionWrapper:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` (``flashinfer.mla``) on mqnc's kernels:
    its ``__init__`` / ``plan`` / ``run`` flow runs unchanged after changing the import line.

    ``plan()`` takes the batch's CSR page table and lengths (FlashInfer's host-side step: it
    reads ``qo_indptr`` on the host, as FlashInfer does); the first ``run()`` after it makes
    mqnc's plan (:func:`plan_mla_paged_attention`: every check, the value checks of the page
    table and lengths included, and the split choice) for the tensors it is given, and later
    runs on tensors of the same shapes, strides, dtypes and device (the other layers of the
    step) reuse it: no check, no host sync.

    Differences from FlashInfer: ``qo_indptr`` must have equal steps (``s_q`` query rows per
    request; the kernels take one query count for every request: ragged counts are refused by
    name); ``float_workspace_buffer`` is accepted (any tensor; its device must be the inputs')
    and not used (mqnc's split-KV partials are allocated per run, or come from a CUDA graph's
    pool); ``backend`` may be ``"auto"``, ``"fa2"`` or ``"fa3"`` (all the same kernels here);
    the intra-kernel profiler is FlashInfer's (``use_profiler`` / ``profiler_buffer`` refused);
    ``run``'s ``kv_len`` / ``page_table`` (FlashInfer's cutlass-backend arguments) must be None;
    an empty row's lse is ``-inf``; ``causal`` with ``s_q > 1`` is FlashMLA's bottom-right rule
    (token ``i`` of a request attends its first ``kv_len - s_q + i + 1`` entries).

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        Any tensor, on the inputs' device: accepted for FlashInfer's signature, not used.
    use_cuda_graph : bool
        As FlashInfer's: ``plan()`` copies ``qo_indptr``, ``kv_indptr``, ``kv_indices`` and
        ``kv_len_arr`` into the buffers given here (int32, on the workspace's device; the
        ``kv_indices`` buffer may be longer than the table) and ``run`` reads them there, so a
        run captured in a CUDA graph reads the values of the latest ``plan()`` on replay. The
        first run after a ``plan()`` checks the new values (one host sync), unless it is being
        captured: a capture keeps the plan made by an earlier run (mqnc's plan of these
        buffers, whose ``run`` neither syncs nor checks) or makes one without the value
        checks. The batch size (the buffers' shapes) stays that of the capture.
    qo_indptr, kv_indptr, kv_indices, kv_len_arr : torch.Tensor or None
        Those buffers: ``[B + 1]``, ``[B + 1]``, ``[>= nnz]``, ``[B]`` int32; required with
        ``use_cuda_graph``, ignored without it (as FlashInfer's).
    backend : str
        ``"auto"``, ``"fa2"`` or ``"fa3"``.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_len_arr: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        check_tensor("float_workspace_buffer", float_workspace_buffer)
        check_flags(use_cuda_graph=use_cuda_graph)
        if not isinstance(backend, str):
            raise TypeError(
                f"backend: expected a str, one of {_BACKENDS}, got {type(backend).__name__}"
            )
        if backend not in _BACKENDS:
            raise ValueError(
                f"backend: expected one of {_BACKENDS} (FlashInfer's FlashAttention backends, "
                f"all mqnc's kernels here), got {backend!r}; pass backend='auto'"
            )
        self.device = float_workspace_buffer.device
        self._float_workspace_buffer = float_workspace_buffer
        self._use_cuda_graph = use_cuda_graph
        buffers = dict(zip(_BUFFERS, (qo_indptr, kv_indptr, kv_indices, kv_len_arr), strict=True))
        if use_cuda_graph:
            for name, buf in buffers.items():
                check_tensor(name, buf, ndim=1, dtypes=(torch.int32,))
                if buf.device != self.device:
                    raise ValueError(
                        f"{name}: expected the workspace's device {self.device} (a CUDA graph "
                        f"buffer), got {buf.device}"
                    )
        self._buffers = buffers
        self._planned: dict | None = None
        self._plan: FlashInferMLAPlan | None = None
        self._plan_key = None
        self._checked = False

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        page_size: int,
        causal: bool,
        sm_scale: float,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        use_profiler: bool = False,
    ) -> None:
        """Plan the batch (FlashInfer's ``plan``).

        Parameters
        ----------
        qo_indptr : torch.Tensor
            ``[B + 1]`` int32, equal steps: ``arange(B + 1) * s_q`` (decode: ``s_q = 1``).
        kv_indptr : torch.Tensor
            ``[B + 1]`` int32: request ``b``'s pages are
            ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.
        kv_indices : torch.Tensor
            ``[nnz]`` int32 page ids.
        kv_len_arr : torch.Tensor
            ``[B]`` int32 entries per request, the new tokens included.
        num_heads, head_dim_ckv, head_dim_kpe, page_size : int
            Query heads, the latent (512) and rope (64) widths, the cache's page size (any
            power of two); ``run``'s tensors must have them.
        causal : bool
            With ``s_q > 1``: token ``i`` attends its request's first ``kv_len - s_q + i + 1``
            entries.
        sm_scale : float
            The model's softmax scale.
        q_data_type, kv_data_type : torch.dtype
            ``run``'s ``q_nope`` / ``ckv_cache`` dtypes.
        use_profiler : bool
            Must be False (the profiler is FlashInfer's).
        """
        check_flags(causal=causal, use_profiler=use_profiler)
        if use_profiler:
            _refuse_profiler("use_profiler", "False", "True")
        for name, value in (("num_heads", num_heads), ("head_dim_ckv", head_dim_ckv),
                            ("head_dim_kpe", head_dim_kpe), ("page_size", page_size)):  # fmt: skip
            check_int(name, value, minimum=1)
        with argument_names({"softmax_scale": "sm_scale"}):
            check_softmax_scale(sm_scale)
        for name, value in (("q_data_type", q_data_type), ("kv_data_type", kv_data_type)):
            if not isinstance(value, torch.dtype):
                raise TypeError(f"{name}: expected a torch.dtype, got {type(value).__name__}")
        check_tensor("qo_indptr", qo_indptr, ndim=1)
        check_tensor("kv_indptr", kv_indptr, ndim=1, shape=(qo_indptr.shape[0],))
        check_tensor("kv_indices", kv_indices, ndim=1)
        check_tensor("kv_len_arr", kv_len_arr, ndim=1, shape=(qo_indptr.shape[0] - 1,))
        steps = qo_indptr.tolist()  # (a host read, as FlashInfer's plan makes)
        s_q = steps[1] - steps[0] if len(steps) > 1 else 0
        if (
            len(steps) < 2
            or steps[0] != 0
            or s_q < 1
            or any(b - a != s_q for a, b in zip(steps, steps[1:], strict=False))
        ):
            shown = steps if len(steps) <= 8 else steps[:8] + ["..."]
            raise ValueError(
                f"qo_indptr: expected equal steps from 0 (arange(B + 1) * s_q, s_q >= 1: the "
                f"kernels take one query count for every request), got {shown}; pad the "
                f"requests to one query count or plan each count as its own batch"
            )
        tables = dict(zip(_BUFFERS, (qo_indptr, kv_indptr, kv_indices, kv_len_arr), strict=True))
        if self._use_cuda_graph:
            for name, t in tables.items():
                buf = self._buffers[name]
                if buf.shape[0] < t.shape[0] or (name != "kv_indices" and buf.shape != t.shape):
                    want = f">= {t.shape[0]}" if name == "kv_indices" else t.shape[0]
                    raise ValueError(
                        f"{name}: expected a use_cuda_graph buffer of {want} entries for this "
                        f"plan, got {buf.shape[0]} (the buffer given to the wrapper)"
                    )
                buf[: t.shape[0]].copy_(t, non_blocking=True)
                tables[name] = buf  # (kv_indices whole: the kernels read the rows' pages only)
        else:
            tables = {name: t.to(self.device, non_blocking=True) for name, t in tables.items()}
        self._planned = dict(
            tables=tables, s_q=s_q, num_heads=num_heads, head_dim_ckv=head_dim_ckv,
            head_dim_kpe=head_dim_kpe, page_size=page_size, causal=causal, sm_scale=sm_scale,
            q_data_type=q_data_type, kv_data_type=kv_data_type,
        )  # fmt: skip
        self._checked = False  # (the next run checks the new tables, unless captured)
        if not self._use_cuda_graph:
            self._plan, self._plan_key = None, None

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        profiler_buffer: torch.Tensor | None = None,
        kv_len: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        return_lse_base_on_e: bool = False,
    ):
        """Attention of the planned batch (FlashInfer's ``run``).

        Parameters
        ----------
        q_nope : torch.Tensor
            ``[N, num_heads, head_dim_ckv]``, ``N = B * s_q`` (``qo_indptr[-1]``), a request's
            rows consecutive; ``q_data_type``.
        q_pe : torch.Tensor
            ``[N, num_heads, head_dim_kpe]``, same dtype.
        ckv_cache : torch.Tensor
            ``[num_pages, page_size, head_dim_ckv]``, ``kv_data_type`` (FP8: as in
            :func:`mla_paged_attention`).
        kpe_cache : torch.Tensor
            ``[num_pages, page_size, head_dim_kpe]``.
        out : torch.Tensor or None
            ``[N, num_heads, head_dim_ckv]`` in ``q_nope``'s dtype, on its device: written in
            place and returned.
        lse : torch.Tensor or None
            ``[N, num_heads]`` float32, on ``q_nope``'s device: written in place (in the base
            returned).
        return_lse : bool
            Also return the lse.
        profiler_buffer : None
            FlashInfer's profiler; must be None.
        kv_len, page_table : None
            FlashInfer's cutlass-backend arguments; must be None (the lengths and pages are
            ``plan()``'s).
        return_lse_base_on_e : bool
            The lse as the natural log instead of base 2.

        Returns
        -------
        o : torch.Tensor
            ``[N, num_heads, head_dim_ckv]`` in ``q_nope``'s dtype (``out`` when given).
        lse : torch.Tensor
            ``[N, num_heads]`` float32, **base 2** unless ``return_lse_base_on_e`` (natural
            log); only with ``return_lse``. ``-inf`` for a row with nothing to attend.
        """
        p = self._planned
        if p is None:
            raise ValueError("plan: expected plan() to be called before run(), got no plan")
        check_flags(return_lse=return_lse, return_lse_base_on_e=return_lse_base_on_e)
        _no_cutlass_or_profiler(profiler_buffer, kv_len=kv_len, page_table=page_table)
        _check_as_planned(p, q_nope, q_pe, ckv_cache, kpe_cache)
        check_same_device(q_nope=q_nope, float_workspace_buffer=self._float_workspace_buffer)
        _check_outputs(q_nope, out, lse)
        t = p["tables"]
        args = (q_nope, q_pe, ckv_cache, kpe_cache, t["kv_indptr"], t["kv_indices"],
                t["kv_len_arr"])  # fmt: skip
        o, lse_k = _run_into(self._mqnc_plan(args), args, out, lse, base2=not return_lse_base_on_e)
        return (o, lse_k) if return_lse else o

    def _mqnc_plan(self, args: tuple) -> FlashInferMLAPlan:
        """mqnc's plan for ``args`` (``run``'s tensors and the planned tables): the one made by an
        earlier run when its key (scale, causal, the four tensors' shapes, strides, dtypes and
        devices) matches and the tables' values were checked since the latest ``plan()``, else a
        new one (:func:`plan_mla_paged_attention`, natural-log lse: ``run`` converts it). A run
        being captured in a CUDA graph cannot sync: it keeps the plan it has when the key
        matches (the buffers' shapes are fixed), or makes one without the value checks."""
        p = self._planned
        key = (p["sm_scale"], p["causal"]) + tuple(
            (tuple(x.shape), x.stride(), x.dtype, x.device) for x in args[:4]
        )
        if self._plan is None or key != self._plan_key or not self._checked:
            capturing = args[0].is_cuda and torch.cuda.is_current_stream_capturing()
            if not (capturing and self._plan is not None and key == self._plan_key):
                with argument_names({"kv_len": "kv_len_arr"}):
                    self._plan = plan_mla_paged_attention(
                        *args,
                        sm_scale=p["sm_scale"],
                        causal=p["causal"],
                        return_lse=True,
                        return_lse_base_on_e=True,
                        check_inputs=not capturing,
                    )
                self._plan_key = key
            self._checked = not capturing
        return self._plan


def _refuse_profiler(name: str, expected: str, got: str) -> None:
    """FlashInfer's intra-kernel profiler asked for (``use_profiler`` / ``profiler_buffer``):
    a ``ValueError`` naming the argument, ``expected`` and ``got`` as the message shows them."""
    raise ValueError(
        f"{name}: expected {expected} (the intra-kernel profiler is FlashInfer's; "
        f"mqnc's kernels have none), got {got}; drop {name}"
    )


def _no_cutlass_or_profiler(profiler_buffer: object, **cutlass: object) -> None:
    """``run``'s FlashInfer-only arguments absent: ``profiler_buffer`` (the profiler) and the
    cutlass backend's ``kv_len`` / ``page_table`` (here the lengths and pages are ``plan()``'s),
    else a ``ValueError`` naming the argument."""
    if profiler_buffer is not None:
        _refuse_profiler("profiler_buffer", "None", "a tensor")
    for name, t in cutlass.items():
        if t is not None:
            raise ValueError(
                f"{name}: expected None (FlashInfer's cutlass-backend argument; here the "
                f"lengths and pages are plan()'s kv_len_arr and kv_indices), got a "
                f"{type(t).__name__}; pass them to plan()"
            )


def _check_as_planned(
    planned: dict,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
) -> None:
    """``run``'s tensors against the wrapper's ``plan()`` config (``planned``): ``q_nope [N,
    num_heads, head_dim_ckv]`` and ``q_pe [N, num_heads, head_dim_kpe]`` with ``N = B * s_q``,
    ``ckv_cache [num_pages, page_size, *]``, ``kpe_cache [*, *, head_dim_kpe]``; ``q_nope`` of
    ``q_data_type`` and ``ckv_cache`` of ``kv_data_type`` (a ``TypeError``); the rest of the
    shapes and dtypes are :func:`plan_mla_paged_attention`'s checks."""
    p = planned
    N, H = (p["tables"]["qo_indptr"].shape[0] - 1) * p["s_q"], p["num_heads"]
    check_tensor("q_nope", q_nope, ndim=3, shape=(N, H, p["head_dim_ckv"]))
    check_tensor("q_pe", q_pe, ndim=3, shape=(N, H, p["head_dim_kpe"]))
    check_tensor("ckv_cache", ckv_cache, ndim=3)
    check_tensor("kpe_cache", kpe_cache, ndim=3, shape=(None, None, p["head_dim_kpe"]))
    for name, t, want in (("q_nope", q_nope, p["q_data_type"]),
                          ("ckv_cache", ckv_cache, p["kv_data_type"])):  # fmt: skip
        if t.dtype != want:
            raise TypeError(
                f"{name}: invalid dtype, expected {dtype_name(want)} (as planned), got "
                f"{dtype_name(t.dtype)}"
            )
    if ckv_cache.shape[1] != p["page_size"]:
        raise ValueError(
            f"ckv_cache: expected page_size {p['page_size']} (as planned: [num_pages, "
            f"page_size, head_dim_ckv]), got shape {tuple(ckv_cache.shape)}"
        )


def _check_outputs(q_nope: torch.Tensor, out: object, lse: object) -> None:
    """``run``'s ``out`` (``q_nope``'s shape and dtype) and ``lse`` (``[N, num_heads]``
    float32), each on ``q_nope``'s device, where given."""
    shape = tuple(q_nope.shape)
    if out is not None:
        check_tensor("out", out, dtypes=(q_nope.dtype,), shape=shape)
        check_same_device(q_nope=q_nope, out=out)
    if lse is not None:
        check_tensor("lse", lse, dtypes=(torch.float32,), shape=shape[:2])
        check_same_device(q_nope=q_nope, lse=lse)


def _run_into(
    plan: FlashInferMLAPlan,
    args: tuple,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    *,
    base2: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``plan.run(*args)`` (a natural-log plan) written into ``out`` / ``lse`` where given: the
    kernels write a given contiguous one directly and new tensors otherwise, copied into a given
    strided one after the lse's conversion to base 2 (in place, with ``base2``).

    Returns
    -------
    o : torch.Tensor
        ``[N, H, d_ckv]`` in ``q_nope``'s dtype (``out`` when given).
    lse : torch.Tensor
        ``[N, H]`` float32, base 2 with ``base2``, else the natural log (``lse`` when given).
    """
    q_nope = args[0]
    shape, dev = tuple(q_nope.shape), q_nope.device
    direct = [x if x is not None and x.is_contiguous() else None for x in (out, lse)]
    o, lse_k = plan.run(*args, out=(
        direct[0] if direct[0] is not None else new_output(shape, q_nope.dtype, dev),
        direct[1] if direct[1] is not None else new_output(shape[:2], torch.float32, dev),
    ))  # fmt: skip
    if base2:
        _to_base2_in_place(lse_k)
    if out is not None and direct[0] is None:
        o = out.copy_(o)
    if lse is not None and direct[1] is None:
        lse_k = lse.copy_(lse_k)
    return o, lse_k
