"""Host side of the attention kernels' FP8 cache: recognising an FP8 ``kv_pool``, checking its
layout and (``check_inputs``) the values of the entries a call attends.

An FP8 cache (``mqnc.model.kv_format``, DeepSeek-V3.2's entry as FlashMLA reads it) is a
``torch.uint8`` tensor (``torch.float8_e4m3fn`` is accepted and viewed as uint8: FlashMLA
passes its cache so) whose last dim holds one entry per token:

- fused: ``d_c`` e4m3fn latent bytes, ``d_c / 128`` float32 scales, ``d_r`` bfloat16 RoPE
  values (656 B for 512 + 64);
- split (FlashInfer's ``ckv`` / ``kpe``): ``kv_pool`` ``[.., d_c + 4 d_c / 128]`` (latent and
  scales), ``kpe_pool`` bfloat16 ``[.., d_r]``.

The kernels read the entries in place (``mla.tile._load_fp8_tile``). What they assume, and
where it is refused: every scale of an attended entry finite and > 0 and no latent byte a NaN
(``0x7F`` / ``0xFF``: a GPU decodes it as NaN, which the output would carry; Triton 3.9.0's
interpreter decodes it as 480), checked on the host by :func:`check_fp8_entries` when a call's
``check_inputs`` / ``check_indices`` is on (one host sync, over the entries the call attends
only: a pool's unused entries may hold anything). Off, such an entry is attended as read.
"""

from __future__ import annotations

import torch

from mqnc.triton_kernels._core.validate import check_tensor, dtype_name

__all__ = [
    "FP8_GROUP",
    "FP8_POOL_DTYPES",
    "is_fp8_pool",
    "as_bytes",
    "fp8_widths",
    "check_fp8_layout",
    "fp8_rope_view",
    "check_fp8_entries",
    "bad_fp8_entries",
    "raise_bad_fp8_entry",
    "dense_slots",
]

FP8_GROUP = 128
"""Latent values per float32 scale (``kv_format.FP8_E4M3.group``)."""

FP8_POOL_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def is_fp8_pool(kv_pool: object) -> bool:
    """Whether ``kv_pool`` is an FP8 cache (its dtype uint8 or float8_e4m3fn)."""
    return isinstance(kv_pool, torch.Tensor) and kv_pool.dtype in FP8_POOL_DTYPES


def as_bytes(kv_pool: torch.Tensor) -> torch.Tensor:
    """The uint8 view of an FP8 cache (a float8_e4m3fn tensor viewed; uint8 as is)."""
    return kv_pool if kv_pool.dtype == torch.uint8 else kv_pool.view(torch.uint8)


def fp8_widths(d_c: int, d_r: int) -> tuple[int, int]:
    """``(latent + scales bytes, fused entry bytes)`` of a ``d_c + d_r`` entry."""
    latent = d_c + 4 * (d_c // FP8_GROUP)
    return latent, latent + 2 * d_r


def check_fp8_layout(kv: torch.Tensor, kpe_pool, d_v: int, d_pe: int) -> None:
    """``kv`` (uint8 view of ``kv_pool``): 3 dims, unit stride inside an entry, entries of the
    FP8 width (fused, or latent + scales when ``kpe_pool`` is given), strides and offset in
    whole 4-byte words (the scales are float32, read in place); ``kpe_pool``: bf16
    ``[num_blocks, block_size, d_pe]``."""
    check_tensor("kv_pool", kv, ndim=3, contiguous_last=True)
    if d_v % FP8_GROUP:
        raise ValueError(
            f"d_v: expected a multiple of {FP8_GROUP} for an FP8 cache (one float32 scale per "
            f"{FP8_GROUP} latent values), got {d_v}"
        )
    latent, fused = fp8_widths(d_v, d_pe)
    want = latent if kpe_pool is not None else fused
    if kv.shape[2] != want:
        parts = f"{d_v} e4m3 latent bytes, {d_v // FP8_GROUP} float32 scales"
        parts += "" if kpe_pool is not None else f", {d_pe} bf16 RoPE values"
        raise ValueError(
            f"kv_pool: expected FP8 entries of {want} bytes ({parts}) on the last dim, got "
            f"shape {tuple(kv.shape)} (scales missing, or a 16-bit cache stored as bytes?)"
        )
    if kv.stride(0) % 4 or kv.stride(1) % 4 or kv.storage_offset() % 4:
        raise ValueError(
            f"kv_pool: expected strides and storage offset in whole 4-byte words (the float32 "
            f"scales are read in place), got strides {kv.stride()}, offset {kv.storage_offset()}"
        )
    if kpe_pool is not None:
        check_tensor("kpe_pool", kpe_pool, ndim=3, contiguous_last=True)
        if kpe_pool.dtype != torch.bfloat16:
            raise TypeError(
                f"kpe_pool: expected torch.bfloat16 RoPE rows beside an FP8 cache (the entry's "
                f"RoPE part is never quantized), got {dtype_name(kpe_pool.dtype)}"
            )
        check_tensor("kpe_pool", kpe_pool, shape=(*kv.shape[:2], d_pe))


def fp8_rope_view(kv: torch.Tensor, d_v: int) -> torch.Tensor:
    """The bf16 RoPE part of fused FP8 entries ``kv [.., 656]`` as a view ``[.., d_r]``."""
    return kv[..., fp8_widths(d_v, 0)[0] :].view(torch.bfloat16)


def dense_slots(
    pages: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The flat token slots (``page * block_size + offset``) a dense call attends: row ``r``'s
    token ``t < lens[r]`` lives in page ``pages[starts[r] + t // block_size]`` (a padded
    table flattened: ``starts = r * width``; CSR: ``kv_indptr[:-1]``)."""
    lens = lens.long()
    total = int(lens.sum())
    row = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    t = torch.arange(total, device=lens.device) - first[row]
    page = pages.long()[starts.long()[row] + t // block_size]
    return page * block_size + t % block_size


_CHUNK = 1 << 16  # entries gathered at a time by the check (43 MB of 656-byte entries)


def _fields(entries: torch.Tensor, d_c: int):
    """An ``[n, width]`` uint8 block of FP8 entries as ``(latent [n, G, 128] float32 decoded,
    scales [n, G] float32, RoPE [n, d_r] bfloat16 or None)``: the RoPE part when the entries
    carry it (the fused 656-byte format; split caches keep it in ``kpe_pool``)."""
    groups = d_c // FP8_GROUP
    end = d_c + 4 * groups
    lat = entries[:, :d_c].contiguous().view(torch.float8_e4m3fn).float()
    scale = entries[:, d_c:end].contiguous().view(torch.float32)
    rope = entries[:, end:].contiguous().view(torch.bfloat16) if entries.shape[1] > end else None
    return lat.view(-1, groups, FP8_GROUP), scale, rope


def _scale_ok(scale: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(scale) & (scale > 0)


def bad_fp8_entries(entries: torch.Tensor, d_c: int) -> torch.Tensor:
    """``[n]`` bool: which of the FP8 entries ``entries [n, width]`` (uint8) has a scale not
    finite and > 0, a NaN latent byte (``0x7F`` / ``0xFF``), a latent value whose product
    with its scale overflows float32 (past what the quantizer writes: it refuses
    ``|x| >= 248 * 2**120``) or, when the entry carries its RoPE part, a RoPE value not finite
    (an infinite ``k_pe`` would make its token vanish from the answer); no host sync. The one
    value predicate of every FP8 entry check (here, ``fp8.quant.check_entries``, the pools)."""
    lat, scale, rope = _fields(entries, d_c)
    amax = lat.abs().amax(2)  # NaN for a NaN byte
    bad = ~_scale_ok(scale).all(1) | amax.isnan().any(1) | ~torch.isfinite(amax * scale).all(1)
    if rope is not None:
        bad |= ~torch.isfinite(rope).all(1)
    return bad


def raise_bad_fp8_entry(name: str, entry: torch.Tensor, d_c: int, where: str, what: str = ""):
    """Raise the ``ValueError`` for one entry that :func:`bad_fp8_entries` flags: its first bad
    scale, else its first NaN latent byte, else its first group whose values overflow, else
    its first RoPE value not finite; ``where`` says which entry (``what``: words after "every
    scale", e.g. " of an attended FP8 entry")."""
    lat, scale, rope = (x[0] if x is not None else None for x in _fields(entry[None], d_c))
    wrong = ~_scale_ok(scale)
    if bool(wrong.any()):
        g = int(wrong.nonzero()[0, 0])
        raise ValueError(
            f"{name}: expected every scale{what} finite and > 0, got {scale[g].item()} "
            f"(scale {g} of {where})"
        )
    if bool(lat.isnan().any()):
        j = int(((entry[:d_c] & 0x7F) == 0x7F).nonzero()[0, 0])
        raise ValueError(
            f"{name}: expected no NaN latent byte (0x7F / 0xFF){what.replace(' of ', ' in ', 1)}, "
            f"got {int(entry[j]):#04x} at byte {j} of {where}"
        )
    amax = lat.abs().amax(1)
    over = ~torch.isfinite(amax * scale)
    if bool(over.any()):
        g = int(over.nonzero()[0, 0])
        raise ValueError(
            f"{name}: expected every latent value times its scale finite in float32 (the "
            f"quantizer's values stay below 248 * 2**120), got scale {scale[g].item()} with a "
            f"latent value {amax[g].item()} (group {g} of {where})"
        )
    j = int((~torch.isfinite(rope)).nonzero()[0, 0])
    raise ValueError(
        f"{name}: expected finite RoPE values (bf16 k_pe){what.replace(' of ', ' in ', 1)}, got "
        f"{rope[j].item()} at RoPE value {j} of {where}"
    )


def check_fp8_entries(
    kv: torch.Tensor, slots: torch.Tensor, d_v: int, kpe: torch.Tensor | None = None
) -> None:
    """The entries ``kv.reshape(-1, width)[slots]`` a call attends (``slots`` flat token ids,
    in range): :func:`bad_fp8_entries` false for each (scales, NaN bytes, overflow, the RoPE
    part when the entries carry it), and with a split cache the RoPE rows ``kpe`` (bf16
    ``[.., d_r]``) at those slots finite. One host sync (two when one is bad; gathered
    ``_CHUNK`` entries at a time: a batch's attended entries may be millions); a
    ``ValueError`` naming ``kv_pool`` (or ``kpe_pool``), the token slot and the field."""
    if slots.numel() == 0:
        return
    slots = slots.long()
    flat = kv.reshape(-1, kv.shape[-1])
    rope = None if kpe is None else kpe.reshape(-1, kpe.shape[-1])
    bad = torch.empty(slots.numel(), dtype=torch.bool, device=slots.device)
    for i in range(0, slots.numel(), _CHUNK):
        part = slots[i : i + _CHUNK]
        bad[i : i + _CHUNK] = bad_fp8_entries(flat[part], d_v)
        if rope is not None:
            bad[i : i + _CHUNK] |= ~torch.isfinite(rope[part]).all(1)
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0, 0])
    slot, count = int(slots[first]), int(bad.sum())
    where = f"token slot {slot}, {count} entries bad"
    if rope is not None and not bool(torch.isfinite(rope[slot]).all()):
        j = int((~torch.isfinite(rope[slot])).nonzero()[0, 0])
        raise ValueError(
            f"kpe_pool: expected finite RoPE values (bf16 k_pe) in an attended entry, got "
            f"{rope[slot, j].item()} at RoPE value {j} of {where}"
        )
    raise_bad_fp8_entry("kv_pool", flat[slot], d_v, where, " of an attended FP8 entry")
