"""fp64 references of RoPE encoding, the delta rotation and the splice (§2.2 of the paper).

Kernels: ``mqnc.triton_kernels.splice.rotate`` (:func:`rope_splice`, :func:`rope_rotate`; FP8
entries of ``mqnc.model.kv_format``: :func:`fp8_splice_reference`, only their bf16 RoPE part
rotated).

``R(p)`` rotates pair ``i`` of the ``d_r`` rope dims (pair members per
:meth:`mqnc.model.RopeSpec.pair_indices`, interleaved or half) by the angle
``p * inv_freq[i]``::

    x1' = x1 cos(p f_i) - x2 sin(p f_i)        x2' = x2 cos(p f_i) + x1 sin(p f_i)

Encoding at position ``p`` is ``attention_factor * R(p)`` (the model's cos/sin carry YaRN's
factor); the delta rotation that re-homes a cached entry is the pure ``R(delta)``. Angles are
formed in float64 from the model's float32 frequencies (exact products for ``|p| < 2**29``)
and cos/sin are taken in float64.

``rope`` is read for ``inv_freq``, ``rope_dim``, ``attention_factor`` and ``pair_indices()``
only: a :class:`mqnc.model.RopeSpec`, or anything with those (the references sit below the
model layer and import it for type checking only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from einops import rearrange

if TYPE_CHECKING:  # annotations only: the references never import the model layer at run time
    from mqnc.model.rope import RopeSpec

__all__ = [
    "rope_angles_reference",
    "rope_encode_reference",
    "rope_delta_reference",
    "rope_rotate_reference",
    "rope_splice_reference",
    "fp8_rope_rotate_reference",
    "fp8_splice_reference",
    "interleaved_to_half",
    "half_to_interleaved",
]


def rope_angles_reference(positions: torch.Tensor | int, rope: RopeSpec) -> torch.Tensor:
    """Angles ``positions[..., None] * inv_freq``, float64, shape ``[*positions.shape, d_r/2]``."""
    p = torch.as_tensor(positions)
    if p.is_floating_point() or p.is_complex():
        raise TypeError(f"positions: expected an integer tensor or int, got dtype {p.dtype}")
    f = torch.tensor(rope.inv_freq, dtype=torch.float64, device=p.device)
    return p.to(torch.float64)[..., None] * f


def _rotate(x_pe: torch.Tensor, angles: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    if x_pe.shape[-1] != rope.rope_dim:
        raise ValueError(
            f"x: expected the last dim to be rope_dim = {rope.rope_dim}, got {tuple(x_pe.shape)}"
        )
    x = x_pe.to(torch.float64)
    first, second = rope.pair_indices()
    i1 = torch.tensor(first, device=x.device)
    i2 = torch.tensor(second, device=x.device)
    x1, x2 = x[..., i1], x[..., i2]
    c, s = torch.cos(angles).to(x.device), torch.sin(angles).to(x.device)
    out = torch.empty(
        torch.broadcast_shapes(x.shape, (*c.shape[:-1], x.shape[-1])),
        dtype=x.dtype,
        device=x.device,
    )
    out[..., i1] = x1 * c - x2 * s
    out[..., i2] = x2 * c + x1 * s
    return out


def rope_encode_reference(
    x_pe: torch.Tensor, positions: torch.Tensor | int, rope: RopeSpec
) -> torch.Tensor:
    """Encode un-rotated rope dims at ``positions`` as the model does: ``a * R(p) x``, float64.

    Parameters
    ----------
    x_pe : torch.Tensor
        ``[..., d_r]`` un-rotated ``k_pe`` or ``q_pe`` (any float dtype), pairs in ``rope.layout``.
    positions : torch.Tensor or int
        Integer positions broadcastable to ``x_pe.shape[:-1]``.
    rope : RopeSpec

    Returns
    -------
    torch.Tensor
        ``[..., d_r]`` float64, same layout.
    """
    return _rotate(x_pe, rope_angles_reference(positions, rope), rope) * rope.attention_factor


def rope_delta_reference(
    x_pe: torch.Tensor, delta: torch.Tensor | int, rope: RopeSpec
) -> torch.Tensor:
    """The pure rotation ``R(delta) x`` of already-encoded rope dims ``[..., d_r]``, float64."""
    return _rotate(x_pe, rope_angles_reference(delta, rope), rope)


def rope_rotate_reference(
    x: torch.Tensor, delta: torch.Tensor | int, rope: RopeSpec
) -> torch.Tensor:
    """Reference of :func:`mqnc.triton_kernels.splice.rotate.rope_rotate`, float64.

    ``x [..., d_c + d_r]`` (576 wide): the first ``d_c`` dims unchanged, the last ``d_r``
    rotated by ``R(delta)``; ``delta`` an int or integer tensor broadcastable to
    ``x.shape[:-1]`` (a prefix shape such as ``[B]`` for ``x [B, H, 576]`` is right-padded).
    """
    d_r = rope.rope_dim
    out = x.to(torch.float64).clone()
    if isinstance(delta, torch.Tensor):
        delta = delta.reshape(*delta.shape, *([1] * (x.dim() - 1 - delta.dim())))
    out[..., -d_r:] = rope_delta_reference(out[..., -d_r:], delta, rope)
    return out


def rope_splice_reference(
    chunk: torch.Tensor,
    pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    delta: torch.Tensor | int,
    rope: RopeSpec,
) -> torch.Tensor:
    """Reference of :func:`mqnc.triton_kernels.splice.rotate.rope_splice`: the pool after the
    splice.

    Parameters
    ----------
    chunk : torch.Tensor
        ``[L, ct, d_c + d_r]`` the chunk's cache entries for all layers, rope dims encoded at
        the chunk's old positions.
    pool : torch.Tensor
        ``[L, num_blocks, block_size, d_c + d_r]`` the requester's paged pool (not modified).
    slot_mapping : torch.Tensor
        ``[ct]`` integer: token ``t`` goes to flattened slot ``slot_mapping[t]`` of each layer
        (block ``slot // block_size``, offset ``slot % block_size``).
    delta : int or torch.Tensor
        New minus old position, one int or ``[ct]`` integer.
    rope : RopeSpec

    Returns
    -------
    torch.Tensor
        float64 copy of ``pool`` with the rows written: first ``d_c`` dims equal to the chunk's,
        last ``d_r`` equal to ``R(delta[t])`` of the chunk's (both in float64).
    """
    # every layer's pool as one row per slot (block-major), written at the chunk's slots
    out = rearrange(pool.to(torch.float64).clone(), "l n b d -> l (n b) d")
    if isinstance(delta, torch.Tensor):
        delta = delta.reshape(1, -1)
    rows = rope_rotate_reference(chunk, delta, rope)
    out[:, slot_mapping.long()] = rows
    return rearrange(out, "l (n b) d -> l n b d", n=pool.shape[1])


def fp8_rope_rotate_reference(
    entries: torch.Tensor, delta: torch.Tensor | int, rope: RopeSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rotation of FP8 cache entries (``mqnc.model.kv_format``: latent e4m3 bytes,
    float32 scales, then ``d_r`` bf16 RoPE values), split where the splice treats it apart.

    Parameters
    ----------
    entries : torch.Tensor
        ``[..., W]`` uint8, ``W = d_c + 4 d_c / 128 + 2 d_r`` (656 for 512 + 64), the RoPE
        part encoded at the old positions.
    delta : int or torch.Tensor
        As in :func:`rope_rotate_reference` (broadcast against ``entries.shape[:-1]``).
    rope : RopeSpec

    Returns
    -------
    prefix : torch.Tensor
        ``[..., W - 2 d_r]`` uint8: latent and scale bytes, unchanged (a copy).
    rotated : torch.Tensor
        ``[..., d_r]`` float64: ``R(delta)`` of the bf16 RoPE values.
    """
    if entries.dtype != torch.uint8:
        raise TypeError(f"entries: expected uint8 FP8 entries, got {entries.dtype}")
    tail = 2 * rope.rope_dim
    if entries.dim() == 0 or entries.shape[-1] <= tail:
        raise ValueError(
            f"entries: expected more than 2 * rope_dim = {tail} bytes on the last dim, got "
            f"shape {tuple(entries.shape)}"
        )
    x_pe = entries[..., -tail:].contiguous().view(torch.bfloat16)
    if isinstance(delta, torch.Tensor):
        delta = delta.reshape(*delta.shape, *([1] * (entries.dim() - 1 - delta.dim())))
    return entries[..., :-tail].clone(), rope_delta_reference(x_pe, delta, rope)


def fp8_splice_reference(
    chunk: torch.Tensor,
    pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    delta: torch.Tensor | int,
    rope: RopeSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`mqnc.triton_kernels.splice.rotate.rope_splice` over FP8 entries: the pool
    after the splice, its bytes and its RoPE values.

    Parameters
    ----------
    chunk : torch.Tensor
        ``[L, ct, W]`` uint8 FP8 entries of all layers, RoPE encoded at the old positions.
    pool : torch.Tensor
        ``[L, num_blocks, block_size, W]`` uint8 (not modified).
    slot_mapping, delta, rope
        As in :func:`rope_splice_reference`.

    Returns
    -------
    entries : torch.Tensor
        ``[L, num_blocks, block_size, W]`` uint8: ``pool`` with the written slots' latent and
        scale bytes equal to the chunk's (their RoPE bytes left as the pool's: compare those
        through ``rotated``).
    rotated : torch.Tensor
        ``[L, num_blocks, block_size, d_r]`` float64: every slot's RoPE values, ``R(delta[t])``
        of the chunk's where written, the pool's bf16 values elsewhere.
    """
    L, nb, bs, w = pool.shape
    if isinstance(delta, torch.Tensor):
        delta = delta.reshape(1, -1)  # one per token, the same for every layer
    prefix, rows = fp8_rope_rotate_reference(chunk, delta, rope)
    flat = pool.clone().reshape(L, nb * bs, w)
    out = flat[..., -2 * rope.rope_dim :].contiguous().view(torch.bfloat16).to(torch.float64)
    slots = slot_mapping.long()
    flat[:, slots, : prefix.shape[-1]] = prefix
    out[:, slots] = rows
    return flat.reshape(L, nb, bs, w), out.reshape(L, nb, bs, -1)


def interleaved_to_half(x: torch.Tensor) -> torch.Tensor:
    """Permute rope dims ``[..., d_r]`` from interleaved pairs to halves:
    ``(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)`` (what DeepSeek's Hugging Face code
    does before ``rotate_half``)."""
    return rearrange(x, "... (i pair) -> ... (pair i)", pair=2)


def half_to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_half`."""
    return rearrange(x, "... (pair i) -> ... (i pair)", pair=2)
