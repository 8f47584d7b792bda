"""The delta-rotation splice and the query rotation (§2.2, §3.2 of the paper).

Re-homing a cached chunk to a new offset (fetch's position-adaptation tax, §2.2, §7) copies its
entries of all ``L`` layers into the requester's paged pool and rotates their 64 decoupled-RoPE
dims by ``R(delta)``, ``delta = new - old`` position. The paper measured this splice at
~2.8-3.1 ms per chunk on an H100, ~80% of it a launch-bound per-layer rotation; here it is one
launch for all layers (grid: token tiles x layers). The requester-side counterpart is
:func:`rope_rotate`: rotating the query by the opposite delta before routing keeps the holder
position-oblivious (§3.2).

Numerics. The first ``d_c`` dims (the latent ``c_KV``) are copied bit-exactly (same dtype in
and out, a load and a store). The rope dims are rotated in float32 and rounded once to the pool
dtype. Angles reach ``delta * inv_freq ~ 1e5`` rad at the positions a 160k-context model sees,
where a float32 angle is off by up to ``ulp(1e5) / 2 = 4e-3`` rad; so each program forms the
angle in float64 (``delta`` is an integer and ``inv_freq`` a float32 value: the product is exact
for ``|delta| < 2**29``), reduces it mod pi/2 in float64 (two-constant Cody-Waite), and only then
evaluates float32 minimax polynomials for cos/sin of the reduced angle (see ``_cos_sin``: no
libdevice call, so no stack frame on sm_90, and the interpreter evaluates the same formulas;
the GPU compile fuses multiply-adds into ``fma.rn``, at least as accurate, not bit-identical). The
angle error is then ~2e-7 rad whatever the delta. The float64 work is 32 angles per token per
program, negligible next to the copy.

Frequencies are plain numbers: ``rope`` is any object with the attributes of
:class:`RopeFrequencies` (``inv_freq``, ``rope_dim``, ``layout``), e.g. the package's
``RopeSpec`` (DeepSeek's float32 values, YaRN included); the kernel layer imports nothing of
the model layer. The pure ``R(delta)`` carries no YaRN cos/sin factor (it was applied at
encoding).

FP8 entries (``mqnc.model.kv_format``: ``d_c`` e4m3 latent bytes, ``d_c / 128`` float32
scales, ``d_r`` bf16 RoPE values; 656 B at 512 + 64) take the same kernel: a uint8 chunk and
pool are read as bf16 (:func:`fp8_entry_views`), so the latent and the scales are the
``D_NOPE = 264`` values copied bit for bit (16-bit loads and stores move bit patterns, NaN
payloads included) and the RoPE part is the 64 bf16 values rotated as in a bf16 cache (the
same bound). The 328-value rows' strides reach the kernel in 16-byte units (``ROW_ALIGN = 8``)
so that it keeps 128-bit accesses (the JIT only sees a stride's divisibility by 16 elements);
the 16-bit variants pass ``ROW_ALIGN = 1`` and compile as before. The persistent grid splices
FP8 entries alike.

:func:`rope_splice` and :func:`rope_rotate` are declared (signature, docstring, fake) in ``ops``,
with :class:`RopeFrequencies`; this module is their ``"triton"`` implementation.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from mqnc.triton_kernels._core.execution import bf16_rne_in_software, check_launchable, new_output
from mqnc.triton_kernels._core.grid import sm_count
from mqnc.triton_kernels._core.launch import Launch
from mqnc.triton_kernels._core.numerics import round_to
from mqnc.triton_kernels._core.op import byte_range
from mqnc.triton_kernels._core.validate import (
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
    dtype_name,
)
from mqnc.triton_kernels.fp8.quant import GROUP, entry_bytes
from mqnc.triton_kernels.ops import PlainRope, RopeFrequencies, rope_rotate, rope_splice

__all__ = [
    "rope_splice",
    "rope_rotate",
    "RopeFrequencies",
    "PlainRope",
    "splice_launch",
    "persistent_splice",
    "fp8_entry_views",
]

_HALF_PI_HI = 1.5707963267948966  # float64 nearest pi/2
_HALF_PI_LO = 6.123233995736766e-17  # pi/2 - _HALF_PI_HI
_TWO_OVER_PI = 2.0 / math.pi
_MAX_ABS_DELTA = 2**31 - 1  # exact float64 angles need |delta| < 2**29; accurate to 2**31

_FP8 = "fp8_e4m3"  # the FP8 cache format's name (mqnc.model.kv_format)

BLOCK_T = 8  # tokens per program (4 warps; registers in docs/kernels.md, from _sm90_table)
BLOCK_D = 128  # latent dims per copy step
NUM_WARPS = 4


@triton.jit
def _cos_sin(ang, HALF_PI_HI: tl.constexpr, HALF_PI_LO: tl.constexpr, TWO_OVER_PI: tl.constexpr):
    """float32 (cos, sin) of float64 angles of any size.

    The angle is reduced in float64 to ``r = ang - k * pi/2`` in ``[-pi/4, pi/4]`` (two-constant
    Cody-Waite: the error stays ~1e-16 * |k| rad), then cos/sin of ``r`` are float32 minimax
    polynomials (Cephes ``sinf``/``cosf``, ~1 ulp on ``[-pi/4, pi/4]``) and the quadrant
    ``k mod 4`` picks signs and swaps. Written out rather than ``tl.cos``/``tl.sin`` because
    libdevice's ``cosf``/``sinf`` carry a Payne-Hanek branch for huge arguments whose local
    array costs 32 bytes of stack per thread on sm_90, and because it makes the interpreter and
    the GPU compute the same thing.
    """
    k = tl.floor(ang * TWO_OVER_PI + 0.5)
    r = ((ang - k * HALF_PI_HI) - k * HALF_PI_LO).to(tl.float32)
    q = k.to(tl.int64) & 3
    z = r * r
    sin_r = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r
    cos_r = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z
    cos_r = cos_r - 0.5 * z + 1.0
    swap = (q & 1) == 1
    c = tl.where(swap, sin_r, cos_r)
    s = tl.where(swap, cos_r, sin_r)
    c = tl.where((q == 1) | (q == 2), -c, c)
    s = tl.where(q >= 2, -s, s)
    return c, s


@triton.jit
def _splice_tile(
    pid_t,
    layer,
    SRC,
    DST,
    SLOTS,
    DELTA,
    INV_FREQ,
    LAYER_OFF,
    T,
    delta_scalar,
    block_size,
    stride_sl,
    stride_st,
    stride_dl,
    stride_db,
    stride_ds,
    D_NOPE: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    DELTA_PER_TOKEN: tl.constexpr,
    LAYER_TABLE: tl.constexpr,
    LAYER_ALIGN: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BF16_RNE: tl.constexpr,
    HALF_PI_HI: tl.constexpr,
    HALF_PI_LO: tl.constexpr,
    TWO_OVER_PI: tl.constexpr,
):
    """Token tile ``pid_t`` of layer ``layer`` (int64): copy D_NOPE dims, rotate D_ROPE dims
    by delta (what one program of :func:`_rope_splice_kernel` does).

    The five strides come in units of ``ROW_ALIGN`` elements (16 bytes for FP8 entries of
    656 B, whose 328-element rows the JIT cannot see are 16-byte aligned; 1 otherwise), so the
    compiler knows every row's alignment and keeps 128-bit loads and stores; each is scaled
    after an int64 product (no int32 overflow)."""
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    if HAS_SLOTS:
        slot = tl.load(SLOTS + offs_t, mask=mask_t, other=0).to(tl.int64)
    else:
        slot = offs_t.to(tl.int64)
    src_row = SRC + layer * stride_sl * ROW_ALIGN + offs_t.to(tl.int64) * stride_st * ROW_ALIGN
    if LAYER_TABLE:
        # offsets in units of LAYER_ALIGN elements (16 bytes when the layers allow it): the
        # compiler then knows each row's 16-byte alignment and keeps 128-bit stores
        layer_start = tl.load(LAYER_OFF + layer) * LAYER_ALIGN
    else:
        layer_start = layer * stride_dl * ROW_ALIGN
    within = (slot // block_size) * stride_db + (slot % block_size) * stride_ds  # int64
    dst_row = DST + (layer_start + within * ROW_ALIGN)

    # The latent c_KV: a bit-exact copy (load and store in the same dtype).
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in tl.static_range(0, D_NOPE, BLOCK_D):
        m = mask_t[:, None] & (d0 + offs_d[None, :] < D_NOPE)
        x = tl.load(src_row[:, None] + (d0 + offs_d[None, :]), mask=m)
        tl.store(dst_row[:, None] + (d0 + offs_d[None, :]), x, mask=m)

    # The rope dims: pair i rotated by delta * inv_freq[i].
    HALF: tl.constexpr = D_ROPE // 2
    offs_p = tl.arange(0, HALF)
    if INTERLEAVED:
        i1 = 2 * offs_p
        i2 = 2 * offs_p + 1
    else:
        i1 = offs_p
        i2 = offs_p + HALF
    if DELTA_PER_TOKEN:
        d = tl.load(DELTA + offs_t, mask=mask_t, other=0).to(tl.float64)
    else:
        d = tl.zeros([BLOCK_T], dtype=tl.float64) + delta_scalar
    f = tl.load(INV_FREQ + offs_p)  # float64 holding the model's float32 frequencies
    c, s = _cos_sin(d[:, None] * f[None, :], HALF_PI_HI, HALF_PI_LO, TWO_OVER_PI)
    x1 = tl.load(src_row[:, None] + (D_NOPE + i1[None, :]), mask=mask_t[:, None]).to(tl.float32)
    x2 = tl.load(src_row[:, None] + (D_NOPE + i2[None, :]), mask=mask_t[:, None]).to(tl.float32)
    y1 = x1 * c - x2 * s
    y2 = x2 * c + x1 * s
    tl.store(
        dst_row[:, None] + (D_NOPE + i1[None, :]),
        round_to(y1, DST.dtype.element_ty, BF16_RNE),
        mask=mask_t[:, None],
    )
    tl.store(
        dst_row[:, None] + (D_NOPE + i2[None, :]),
        round_to(y2, DST.dtype.element_ty, BF16_RNE),
        mask=mask_t[:, None],
    )


# The token count and a scalar delta vary from call to call: not specialised (delta = 1 or a
# token count of 1 would otherwise each compile a separate variant at run time).
@triton.jit(do_not_specialize=["T", "delta_scalar"])
def _rope_splice_kernel(
    SRC,
    DST,
    SLOTS,
    DELTA,
    INV_FREQ,
    LAYER_OFF,
    T,
    delta_scalar,
    block_size,
    stride_sl,
    stride_st,
    stride_dl,
    stride_db,
    stride_ds,
    D_NOPE: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    DELTA_PER_TOKEN: tl.constexpr,
    LAYER_TABLE: tl.constexpr,
    LAYER_ALIGN: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BF16_RNE: tl.constexpr,
    HALF_PI_HI: tl.constexpr,
    HALF_PI_LO: tl.constexpr,
    TWO_OVER_PI: tl.constexpr,
):
    """One program per (token tile, layer): copy D_NOPE dims, rotate D_ROPE dims by delta.

    ``LAYER_TABLE``: layer ``l``'s pool starts ``LAYER_OFF[l] * LAYER_ALIGN`` elements from
    ``DST`` (one tensor per layer, vLLM's and SGLang's caches), instead of ``l * stride_dl``."""
    _splice_tile(
        tl.program_id(0),
        tl.program_id(1).to(tl.int64),
        SRC,
        DST,
        SLOTS,
        DELTA,
        INV_FREQ,
        LAYER_OFF,
        T,
        delta_scalar,
        block_size,
        stride_sl,
        stride_st,
        stride_dl,
        stride_db,
        stride_ds,
        D_NOPE,
        D_ROPE,
        BLOCK_T,
        BLOCK_D,
        INTERLEAVED,
        HAS_SLOTS,
        DELTA_PER_TOKEN,
        LAYER_TABLE,
        LAYER_ALIGN,
        ROW_ALIGN,
        BF16_RNE,
        HALF_PI_HI,
        HALF_PI_LO,
        TWO_OVER_PI,
    )


@triton.jit(do_not_specialize=["T", "delta_scalar", "n_tiles", "n_work"])
def _rope_splice_persistent_kernel(
    SRC,
    DST,
    SLOTS,
    DELTA,
    INV_FREQ,
    LAYER_OFF,
    T,
    delta_scalar,
    block_size,
    n_tiles,
    n_work,
    stride_sl,
    stride_st,
    stride_dl,
    stride_db,
    stride_ds,
    D_NOPE: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    DELTA_PER_TOKEN: tl.constexpr,
    LAYER_TABLE: tl.constexpr,
    LAYER_ALIGN: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BF16_RNE: tl.constexpr,
    HALF_PI_HI: tl.constexpr,
    HALF_PI_LO: tl.constexpr,
    TWO_OVER_PI: tl.constexpr,
):
    """A persistent grid (the SMs times a few programs): program ``p`` splices the work items
    ``w = p, p + P, p + 2P, ...`` of the ``n_work = n_tiles * L`` (token tile, layer) pairs,
    ``w = layer * n_tiles + tile`` (consecutive programs read consecutive source rows), each
    as one program of :func:`_rope_splice_kernel` does."""
    step = tl.num_programs(0)
    w = tl.program_id(0).to(tl.int64)  # (a tensor in both modes: the interpreter's range is not)
    for _ in range(tl.program_id(0), n_work, step):
        _splice_tile(
            (w % n_tiles).to(tl.int32),
            w // n_tiles,
            SRC,
            DST,
            SLOTS,
            DELTA,
            INV_FREQ,
            LAYER_OFF,
            T,
            delta_scalar,
            block_size,
            stride_sl,
            stride_st,
            stride_dl,
            stride_db,
            stride_ds,
            D_NOPE,
            D_ROPE,
            BLOCK_T,
            BLOCK_D,
            INTERLEAVED,
            HAS_SLOTS,
            DELTA_PER_TOKEN,
            LAYER_TABLE,
            LAYER_ALIGN,
            ROW_ALIGN,
            BF16_RNE,
            HALF_PI_HI,
            HALF_PI_LO,
            TWO_OVER_PI,
        )
        w += step


_FREQ_TABLES: dict[tuple, torch.Tensor] = {}


def _freq_table(rope: RopeFrequencies, device: torch.device) -> torch.Tensor:
    """The frequencies as a float64 tensor on ``device``, cached (one copy per device)."""
    key = (tuple(rope.inv_freq), str(device))
    t = _FREQ_TABLES.get(key)
    if t is None:
        t = torch.tensor(key[0], dtype=torch.float64, device=device)
        _FREQ_TABLES[key] = t
    return t


def _check_rope(rope: object, width: int, name: str) -> RopeFrequencies:
    if not isinstance(rope, RopeFrequencies):
        raise TypeError(
            "rope: expected a RoPE spec with inv_freq, rope_dim and layout (e.g. "
            f"mqnc's RopeSpec), got {type(rope).__name__}"
        )
    rope_dim = rope.rope_dim
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 2:
        raise ValueError(f"rope.rope_dim: expected an even int >= 2, got {rope_dim!r}")
    half = rope_dim // 2
    if rope_dim % 2 or half & (half - 1):
        raise ValueError(f"rope.rope_dim: expected 2 * a power of two, got {rope_dim}")
    if len(rope.inv_freq) != half:
        raise ValueError(
            f"rope.inv_freq: expected rope_dim // 2 = {half} frequencies, got {len(rope.inv_freq)}"
        )
    if rope.layout not in ("interleaved", "half"):
        raise ValueError(f"rope.layout: expected 'interleaved' or 'half', got {rope.layout!r}")
    if width <= rope_dim:
        raise ValueError(
            f"{name}: expected the last dim (d_c + d_r) to exceed rope.rope_dim = {rope_dim}, "
            f"got {width}"
        )
    return rope


def _check_scalar_delta(delta: object) -> int:
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(
            f"delta: expected an int or an int64 torch.Tensor, got {type(delta).__name__}"
        )
    if abs(delta) > _MAX_ABS_DELTA:
        raise ValueError(f"delta: expected |delta| <= {_MAX_ABS_DELTA}, got {delta}")
    return delta


def _check_delta_values(delta: torch.Tensor) -> None:
    if delta.numel() and int(delta.abs().max()) > _MAX_ABS_DELTA:
        raise ValueError(
            f"delta: expected |delta| <= {_MAX_ABS_DELTA}, "
            f"got max |delta| = {int(delta.abs().max())}"
        )


def splice_launch(
    src,
    dst,
    slots,
    delta,
    freq,
    T,
    L,
    block_size,
    strides_src,
    strides_dst,
    rope,
    layer_offsets=None,
    layer_unit: int = 1,
    persistent: bool | None = None,
    row_unit: int = 1,
    entries: str | None = None,
) -> Launch:
    """The splice kernel's launch (no checks: :func:`rope_splice` / :func:`rope_rotate` check):
    ``T`` tokens of ``L`` layers from ``src`` into ``dst`` at ``slots`` (None: in order), each
    rotated by ``delta`` (an int, or an int64 tensor ``[T]``); ``freq`` the float64 frequencies;
    ``layer_offsets`` (int64 ``[L]``): layer ``l`` starts that many ``layer_unit``-element
    units from ``dst`` (one tensor per layer), instead of at ``l * strides_dst[0]``.

    ``persistent`` (None: :func:`persistent_splice`'s process-wide choice, off by default): the
    persistent-grid kernel, at most :data:`PERSISTENT_CTAS_PER_SM` programs per SM of
    ``src``'s device striding over the (token tile, layer) pairs, instead of one program per
    pair; the same arithmetic per tile (bit-identical pools).

    ``row_unit`` (> 1: every stride a multiple of it): the strides are passed in units of
    ``row_unit`` elements (the kernel's ``ROW_ALIGN``); ``entries`` names a cache format the
    bf16 ``src`` / ``dst`` views stand for (``"fp8_e4m3"``: FP8 entries, see
    :func:`fp8_entry_views`), else the launch is named by ``src``'s dtype."""
    per_token = isinstance(delta, torch.Tensor)
    if row_unit > 1:
        strides_src = tuple(x // row_unit for x in strides_src)
        strides_dst = tuple(x // row_unit for x in strides_dst)
    rows = "slots" if slots is not None else "rows"
    layers = ""
    if layer_offsets is not None:
        layers = ",layers=list" + ("" if layer_unit * src.element_size() == 16 else ",unaligned")
    tiles = triton.cdiv(T, BLOCK_T)
    persistent = _PERSISTENT[0] if persistent is None else bool(persistent)
    if persistent:
        work = tiles * L
        programs = max(1, min(work, sm_count(src.device) * PERSISTENT_CTAS_PER_SM))
        kernel, grid, sizes = _rope_splice_persistent_kernel, (programs,), (tiles, work)
        layers += ",persistent"
    else:
        kernel, grid, sizes = _rope_splice_kernel, (tiles, L), ()
    return Launch(
        name=(
            f"splice[{entries or dtype_name(src.dtype)},{rope.layout},{rows},"
            f"delta={'[T]' if per_token else 'int'},{BLOCK_T}x{BLOCK_D},w{NUM_WARPS}{layers}]"
        ),
        kernel=kernel,
        grid=grid,
        args=(
            src,
            dst,
            slots if slots is not None else freq,
            delta if per_token else freq,
            freq,
            layer_offsets if layer_offsets is not None else freq,  # (not read without a table)
            T,
            0 if per_token else delta,
            block_size,
            *sizes,
            *strides_src,
            *strides_dst,
        ),
        kwargs=dict(
            D_NOPE=src.shape[-1] - rope.rope_dim,
            D_ROPE=rope.rope_dim,
            BLOCK_T=BLOCK_T,
            BLOCK_D=BLOCK_D,
            INTERLEAVED=rope.layout == "interleaved",
            HAS_SLOTS=slots is not None,
            DELTA_PER_TOKEN=per_token,
            LAYER_TABLE=layer_offsets is not None,
            LAYER_ALIGN=layer_unit,
            ROW_ALIGN=row_unit,
            BF16_RNE=bf16_rne_in_software(dst.dtype, dst.device),
            HALF_PI_HI=_HALF_PI_HI,
            HALF_PI_LO=_HALF_PI_LO,
            TWO_OVER_PI=_TWO_OVER_PI,
            num_warps=NUM_WARPS,
        ),
    )


PERSISTENT_CTAS_PER_SM = 4
_PERSISTENT = [False]


@contextlib.contextmanager
def persistent_splice(enabled: bool = True):
    """Inside the ``with`` block every splice launched without an explicit ``persistent``
    (:func:`rope_splice`, :func:`rope_rotate`) runs the persistent-grid kernel. A candidate
    (``perf.bench_splice`` times it beside the default at the goal shape): the default stays
    one program per (token tile, layer) until a GPU run shows the persistent grid faster.
    Process-wide, not thread-safe: for benchmarks."""
    before = _PERSISTENT[0]
    _PERSISTENT[0] = bool(enabled)
    try:
        yield
    finally:
        _PERSISTENT[0] = before


def _launch(*args, layer_offsets=None, layer_unit=1, row_unit=1, entries=None):
    T, L = args[5], args[6]
    if T == 0 or L == 0:
        return
    splice_launch(
        *args, layer_offsets=layer_offsets, layer_unit=layer_unit, row_unit=row_unit,
        entries=entries,
    )()  # fmt: skip


_LAYER_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_LAYER_TABLES = 64


def layer_align(base: torch.Tensor, pools: list[torch.Tensor]) -> int:
    """The unit, in elements, of the per-layer offsets: 16 bytes when every layer starts a
    multiple of 16 bytes from ``base`` (separate allocations always do), else one element."""
    unit = max(1, 16 // base.element_size())
    aligned = all((p.data_ptr() - base.data_ptr()) % (unit * p.element_size()) == 0 for p in pools)
    return unit if aligned else 1


def _layer_table(base: torch.Tensor, pools: list[torch.Tensor], unit: int) -> torch.Tensor:
    """int64 ``[L]``: where each layer's tensor starts from ``base``'s first element, in units
    of ``unit`` elements, on ``base``'s device; cached by the layers' addresses (a serving engine
    allocates its per-layer caches once), so a repeated splice copies nothing to the device."""
    key = (str(base.device), base.element_size(), unit, *(p.data_ptr() for p in pools))
    table = _LAYER_TABLES.get(key)
    if table is None:
        step = unit * base.element_size()
        offsets = [(p.data_ptr() - base.data_ptr()) // step for p in pools]
        table = torch.tensor(offsets, dtype=torch.int64, device=base.device)
        if len(_LAYER_TABLES) >= _MAX_LAYER_TABLES:
            _LAYER_TABLES.pop(next(iter(_LAYER_TABLES)))
        _LAYER_TABLES[key] = table
    return table


def _layer_pools(pools, L: int, D: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Per-layer caches as ``[num_blocks, block_size, D]`` views: ``[num_blocks, block_size,
    D]`` (vLLM), ``[num_blocks, block_size, 1, D]`` (one KV head: FlashMLA, SGLang) or
    ``[slots, D]`` (a token pool, block size 1); one shape, dtype, device and strides for all."""
    if len(pools) != L:
        raise ValueError(f"pool: expected one cache per layer of chunk ({L}), got {len(pools)}")
    views = []
    for i, p in enumerate(pools):
        name = f"pool[{i}]"
        check_tensor(name, p, dtypes=FLOAT_DTYPES, contiguous_last=True)
        if p.dtype != dtype:
            raise TypeError(
                f"{name}: invalid dtype, expected {dtype_name(dtype)} (chunk's dtype: the "
                f"latent is copied bit-exactly), got {dtype_name(p.dtype)}"
            )
        if p.dim() == 4 and p.shape[2] == 1:
            p = p[:, :, 0]
        elif p.dim() == 2:
            p = p[:, None]
        if p.dim() != 3 or p.shape[-1] != D:
            raise ValueError(
                f"{name}: expected [num_blocks, block_size, {D}], [num_blocks, block_size, 1, "
                f"{D}] or [slots, {D}], got shape {tuple(pools[i].shape)}"
            )
        first = views[0] if views else p
        if p.shape != first.shape or p.stride() != first.stride() or p.device != first.device:
            raise ValueError(
                f"{name}: expected the shape, strides and device of pool[0] ({tuple(first.shape)},"
                f" {first.stride()}, {first.device}), got {tuple(p.shape)}, {p.stride()}, "
                f"{p.device}"
            )
        if (p.data_ptr() - first.data_ptr()) % p.element_size():
            raise ValueError(f"{name}: expected an address aligned to its element size")
        lo, hi = _extent(p)
        for j, v in enumerate(views):  # each layer written by its own programs: no sharing
            vlo, vhi = _extent(v)
            if lo < vhi and vlo < hi:
                raise ValueError(
                    f"{name}: expected a cache of its own per layer, got memory shared with "
                    f"pool[{j}] (one layer's entries would overwrite the other's)"
                )
        views.append(p)
    return views


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[first, last + 1)`` a strided tensor's elements span (host metadata)."""
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


def _entry_view(name: str, t: torch.Tensor) -> torch.Tensor:
    """uint8 FP8 entries ``[..., W]`` as bfloat16 ``[..., W / 2]`` (the same bytes), or a
    ``ValueError`` naming ``name`` when their strides or offset are odd."""
    if t.dim() and (t.stride(-1) != 1 or t.storage_offset() % 2 or any(
        x % 2 for x in t.stride()[:-1]
    )):  # fmt: skip
        raise ValueError(
            f"{name}: expected FP8 entries with unit stride on the last dim and even strides and "
            f"offset (read as bf16 pairs), got strides {t.stride()}, offset {t.storage_offset()}"
        )
    return t.view(torch.bfloat16)


def fp8_entry_views(chunk: torch.Tensor, pool, rope) -> tuple[torch.Tensor, object, int]:
    """An FP8 splice's operands as the bf16 rows the splice kernel moves, and their row unit.

    An FP8 entry (``mqnc.model.kv_format``: ``d_c`` e4m3 latent bytes, ``d_c / 128`` float32
    scales, then ``d_r`` bf16 RoPE values) read as bfloat16 is ``d_c * 33 / 64`` values that
    the kernel copies bit for bit (latent and scales: a 16-bit load and store never changes a
    bit pattern) followed by the ``d_r`` bf16 values it rotates, so the 16-bit splice kernel
    splices it unchanged (its ``D_NOPE`` = 264 at 512 + 64). Returns ``(chunk [L, ct, W/2],
    pool [.., W/2] (or the list of per-layer views), row_unit)``: 8 when every stride is a
    multiple of 16 bytes (the kernel then keeps 128-bit accesses), else 1. ``chunk`` is
    checked here (uint8, width ``d_c + 4 d_c / 128 + 2 d_r`` for ``d_r = rope.rope_dim``,
    ``d_c`` a multiple of 128), and every pool must be uint8 of the same width."""
    check_tensor("chunk", chunk, ndim=3, dtypes=(torch.uint8,), contiguous_last=True)
    W = chunk.shape[-1]
    _check_rope(rope, W, "chunk")
    prefix = W - 2 * rope.rope_dim  # latent and scales: d_c * (1 + 4 / 128) bytes
    d_c = prefix * GROUP // (GROUP + 4)
    if prefix <= 0 or d_c % GROUP or entry_bytes(d_c, rope.rope_dim) != W:
        raise ValueError(
            f"chunk: expected FP8 entries of d_c + 4 d_c / {GROUP} + 2 d_r bytes (d_c a multiple "
            f"of {GROUP}, d_r = rope.rope_dim = {rope.rope_dim}) on the last dim, got {W} "
            "(scales missing?)"
        )
    pools = list(pool) if isinstance(pool, (list, tuple)) else [pool]
    for i, p in enumerate(pools):
        name = f"pool[{i}]" if isinstance(pool, (list, tuple)) else "pool"
        check_tensor(name, p)
        if p.dtype != torch.uint8:
            raise TypeError(
                f"{name}: cache format mismatch, expected uint8 FP8 entries (the chunk's "
                f"format, fp8_e4m3), got a {dtype_name(p.dtype)} cache"
            )
        if p.dim() == 0 or p.shape[-1] != W:
            raise ValueError(
                f"{name}: expected FP8 entries of {W} bytes (the chunk's) on the last dim, got "
                f"shape {tuple(p.shape)}"
            )
    views = [_entry_view(f"pool[{i}]", p) for i, p in enumerate(pools)]
    chunk_v = _entry_view("chunk", chunk)
    strides = [*chunk_v.stride()[:-1], *(x for v in views for x in v.stride()[:-1])]
    unit = 8 if all(x % 8 == 0 for x in strides) else 1
    return chunk_v, views if isinstance(pool, (list, tuple)) else views[0], unit


def _operands(chunk, pool, rope) -> tuple:
    """``(chunk, pool, row_unit, entries)`` the splice kernel moves: 16-bit operands as they
    are, FP8 entries as bf16 views (:func:`fp8_entry_views`, named ``"fp8_e4m3"``); rows
    into an FP8 pool are a format mismatch."""
    if isinstance(chunk, torch.Tensor) and chunk.dtype == torch.uint8:
        return (*fp8_entry_views(chunk, pool, rope), _FP8)
    if isinstance(pool, torch.Tensor) and pool.dtype == torch.uint8:
        got = dtype_name(chunk.dtype) if isinstance(chunk, torch.Tensor) else type(chunk).__name__
        raise TypeError(
            f"chunk: cache format mismatch, the pool keeps uint8 FP8 entries ({_FP8}), got "
            f"{got} rows (quantize them with fp8_quantize first)"
        )
    return chunk, pool, 1, None


def _check_slot_values(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot in the pool's ``num_blocks x block_size`` and no slot twice (a ``ValueError``
    naming ``slot_mapping`` and the first offenders otherwise)."""
    n_slots = num_blocks * block_size
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < 0 or hi >= n_slots:
        bad = slot_mapping[(slot_mapping < 0) | (slot_mapping >= n_slots)][:5].tolist()
        raise ValueError(
            f"slot_mapping: expected slots in [0, {n_slots}) (num_blocks {num_blocks} x "
            f"block_size {block_size}), got out-of-range slots {bad}"
        )
    ct = slot_mapping.numel()
    uniq = torch.unique(slot_mapping)
    if uniq.numel() != ct:
        vals, counts = torch.unique(slot_mapping, return_counts=True)
        raise ValueError(
            f"slot_mapping: expected distinct slots, got {ct - uniq.numel()} duplicates "
            f"(e.g. {vals[counts > 1][:5].tolist()})"
        )


def _apart_from(chunk: torch.Tensor, pools) -> torch.Tensor:
    """``chunk``, or a copy of it when it and one of ``pools`` can touch the same bytes (entries
    moved within one pool: read whole, then written; address ranges, first to last element: on
    the safe side for strided views)."""
    mine = byte_range(chunk)
    for pool in pools:
        theirs = byte_range(pool)
        if mine and theirs and pool.device == chunk.device:
            if mine[0] < theirs[1] and theirs[0] < mine[1]:
                return chunk.clone()
    return chunk


@rope_splice.op.implementation("triton")
def _splice(call) -> None:
    """:func:`rope_splice` on the splice kernel (one launch for all layers); FP8 entries
    (uint8) through :func:`fp8_entry_views`."""
    chunk, pool, slot_mapping, delta, rope = (
        call.chunk,
        call.pool,
        call.slot_mapping,
        call.delta,
        call.rope,
    )
    given = pool
    chunk, pool, row_unit, entries = _operands(chunk, pool, rope)
    check_tensor("chunk", chunk, ndim=3, dtypes=FLOAT_DTYPES, contiguous_last=True)
    L, ct, D = chunk.shape
    _check_rope(rope, D, "chunk")
    layers = None
    if isinstance(pool, (list, tuple)):
        layers = _layer_pools(pool, L, D, chunk.dtype)
        dst = layers[0] if layers else chunk.new_empty((0, 1, D))
        num_blocks, block_size = dst.shape[:2]
        strides_dst = (0, dst.stride(0), dst.stride(1))
    else:
        check_tensor("pool", pool, ndim=4, dtypes=FLOAT_DTYPES, contiguous_last=True)
        if pool.dtype != chunk.dtype:
            raise TypeError(
                f"pool: invalid dtype, expected {dtype_name(chunk.dtype)} (chunk's dtype: the "
                f"latent is copied bit-exactly), got {dtype_name(pool.dtype)}"
            )
        check_tensor("pool", pool, shape=(L, None, None, D))
        dst = pool
        _, num_blocks, block_size, _ = pool.shape
        strides_dst = (pool.stride(0), pool.stride(1), pool.stride(2))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), shape=(ct,))
    tensors = dict(chunk=chunk, pool=dst, slot_mapping=slot_mapping)
    if isinstance(delta, torch.Tensor):
        check_tensor("delta", delta, ndim=1, dtypes=(torch.int64,), shape=(ct,))
        tensors["delta"] = delta
    else:
        _check_scalar_delta(delta)
    device = check_same_device(**tensors)
    check_launchable(chunk, "chunk")
    unit = layer_align(dst, layers) if layers else 1
    if call.validate and ct:
        _check_slot_values(slot_mapping, num_blocks, block_size)
        if isinstance(delta, torch.Tensor):
            _check_delta_values(delta)
    if delta is not None and isinstance(delta, torch.Tensor) and not delta.is_contiguous():
        delta = delta.contiguous()
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    chunk = _apart_from(chunk, layers if layers else [dst])
    _launch(
        chunk,
        dst,
        slot_mapping,
        delta,
        _freq_table(rope, device),
        ct,
        L,
        block_size,
        (chunk.stride(0), chunk.stride(1)),
        strides_dst,
        rope,
        layer_offsets=_layer_table(dst, layers, unit) if layers else None,
        layer_unit=unit,
        row_unit=row_unit,
        entries=entries,
    )
    return given


@rope_rotate.op.implementation("triton")
def _rotate(call) -> torch.Tensor:
    """:func:`rope_rotate` on the splice kernel (one layer, rows in order)."""
    x, delta, rope = call.x, call.delta, call.rope
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x: expected at least 1 dim, got shape {tuple(x.shape)}")
    D = x.shape[-1]
    _check_rope(rope, D, "x")
    check_launchable(x, "x")
    rows = x.shape[:-1]
    if isinstance(delta, torch.Tensor):
        check_tensor("delta", delta, dtypes=(torch.int64,))
        k = delta.dim()
        if tuple(delta.shape) != tuple(rows[:k]):
            raise ValueError(
                f"delta: expected shape equal to a prefix of x.shape[:-1] = {tuple(rows)}, "
                f"got {tuple(delta.shape)}"
            )
        check_same_device(x=x, delta=delta)
        _check_delta_values(delta)
        delta = delta.reshape(*delta.shape, *([1] * (len(rows) - k))).expand(rows).reshape(-1)
        delta = delta.contiguous()
    else:
        _check_scalar_delta(delta)
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    out = new_output(x.shape, x.dtype, x.device)
    out2 = out.view(-1, D)
    _launch(
        x2,
        out2,
        None,
        delta,
        _freq_table(rope, x.device),
        n,
        1,
        1,
        (0, x2.stride(0)),
        (0, out2.stride(0), 0),
        rope,
    )
    return out
