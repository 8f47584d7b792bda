"""The kernels as ``torch.library`` ops (``torch.ops.mqnc.*``, ``triton_kernels/ops.py``).

``torch.library.opcheck`` checks each op's registration against its real run: the schema
(declared mutations match what the op writes), the fake implementation (shapes, dtypes and
strides of its outputs equal the real ones) and the functionalised form that ``torch.compile``
traces; each op with ``out=`` is checked in its ``.out`` overload too. Then
``torch.compile(fullgraph=True)`` of a function that calls the public functions (which are the
ops' callers, eager or traced) gives the eager bits: one graph, no break; the same through the
ops' ``"torch"`` backend (``kernel_ops("torch")``, the fp64 references). The
``aot_eager`` backend runs Dynamo, the fakes and AOT functionalisation (what the
registration is for) without Inductor's C++ build, so the test stays small on a CPU; the GPU
tier compiles the holder step with Inductor and CUDA graphs (``test_cuda_graph.py``). Tiny
shapes (32 + 16 wide rows) keep the interpreter fast.
"""

from __future__ import annotations

import inspect
import math
import types

import pytest
import torch

import mqnc.triton_kernels  # noqa: F401  (registers torch.ops.mqnc.*)
from mqnc.testing import assert_close, default_device, tolerance
from mqnc.triton_kernels import (
    fp8_dequantize,
    fp8_quantize,
    merge_partials,
    merge_partials_into,
    mla_decode_partial,
    mla_decode_partial_csr,
    mla_sparse_partial,
    rope_rotate,
    rope_splice,
    tp_partial_scores,
    tp_partial_values,
)
from mqnc.triton_kernels.ops import OPS
from mqnc.triton_kernels.splice.rotate import PlainRope

DEVICE = default_device()
D_V, D_PE = 32, 16
D = D_V + D_PE
SCALE = 0.2
ROPE = PlainRope(tuple(10000.0 ** (-2 * i / D_PE) for i in range(D_PE // 2)), D_PE, "half")


def _mla(gen):
    q = torch.randn(2, 3, D, generator=gen).to(DEVICE)
    pool = torch.randn(3, 16, D, generator=gen).to(DEVICE)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)
    idx = torch.tensor([[0, 7, 40, -1], [3, -1, 2, 11]], dtype=torch.int32, device=DEVICE)
    return q, pool, table, lens, idx


def _op_cases():
    """``name -> (args, kwargs)`` of a real call of each op, as its schema takes it: the
    positional parameters positionally, the keyword-only ones (and ``out``, ``backend``) by
    keyword (``name.out``: its ``out=`` overload, the caller's tensors written in place)."""
    gen = torch.Generator().manual_seed(0)
    q, pool, table, lens, idx = _mla(gen)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    indices = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    o = torch.randn(3, 2, 2, D, generator=gen).to(DEVICE)
    lse = torch.randn(3, 2, 2, generator=gen).to(DEVICE)
    chunk = torch.randn(2, 5, D, generator=gen).to(DEVICE)
    freq = list(ROPE.inv_freq)
    mask = torch.tensor([True, False], device=DEVICE)
    kw = dict(softmax_scale=SCALE, d_v=D_V)
    dense = ((q, pool, table, lens), dict(**kw, num_splits=2))
    csr = ((q, pool, indptr, indices, lens), kw)
    sparse = ((q, pool, idx), kw)

    def outs(*shapes):
        return [torch.empty(s, device=DEVICE) for s in shapes]

    def with_out(case, *shapes):
        return case[0], {**case[1], "out": outs(*shapes)}

    slots = torch.tensor([[0, 17, 33, -1], [40, -1, 2, 9]], dtype=torch.int32, device=DEVICE)
    scores = (
        torch.randn(2, 3, 4, generator=gen).to(DEVICE).masked_fill(slots[:, None] < 0, -math.inf)
    )
    rows = torch.randn(3, 128 + D_PE, generator=gen).to(torch.bfloat16).to(DEVICE)
    merge = ((o, lse), dict(layout="MBHD"))

    return {
        "mla_decode_partial": dense,
        "mla_decode_partial_csr": csr,
        "mla_sparse_partial": sparse,
        "merge_partials": merge,
        "merge_partials_into": ((o[0].clone(), lse[0].clone(), o[1], lse[1]), dict(mask=mask)),
        "rope_splice": (
            (
                chunk,
                [torch.zeros(8, D, device=DEVICE) for _ in range(2)],
                False,
                torch.arange(5, device=DEVICE),
                torch.arange(5, device=DEVICE),
                0,
                freq,
                D_PE,
                "half",
            ),
            {},
        ),
        "rope_rotate": ((q, None, 9, freq, D_PE, "half"), {}),
        # a tensor-parallel rank's slice (d_v 32 + d_pe 16 columns) over pool slots, -1 unused
        "tp_partial_scores": (
            (q.to(torch.bfloat16), pool.to(torch.bfloat16), slots),
            dict(d_v=D_V),
        ),
        "tp_partial_values": (
            (scores, pool.to(torch.bfloat16), slots),
            dict(softmax_scale=SCALE, d_v=D_V),
        ),
        # FP8 entries of 128 latent values (one scale) + 16 RoPE values
        "fp8_quantize": ((rows, 128), {}),
        "fp8_dequantize": ((fp8_quantize(rows, 128), 128, D_PE, "float32"), {}),
        "mla_decode_partial.out": with_out(dense, (2, 3, D_V), (2, 3)),
        "mla_decode_partial_csr.out": with_out(csr, (2, 3, D_V), (2, 3)),
        "mla_sparse_partial.out": with_out(sparse, (2, 3, D_V), (2, 3)),
        "merge_partials.out": with_out(merge, (2, 2, D), (2, 2)),
    }


def _overload(name):
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.mqnc, op), overload or "default")


def test_every_op_is_checked():
    with_out = [f"{name}.out" for name in OPS if hasattr(getattr(torch.ops.mqnc, name), "out")]
    assert sorted(_op_cases()) == sorted([*OPS, *with_out])


def test_stacked_splice_through_the_op():
    """The op's stacked form (``[pool]``, ``stacked=True``) writes what the function writes."""
    gen = torch.Generator().manual_seed(2)
    chunk = torch.randn(2, 5, D, generator=gen).to(DEVICE)
    slots = torch.tensor([7, 0, 3, 12, 9], device=DEVICE)
    pool, expected = (torch.zeros(2, 4, 4, D, device=DEVICE) for _ in range(2))
    rope_splice(chunk, expected, slots, -3, ROPE)
    torch.ops.mqnc.rope_splice(
        chunk, [pool], True, slots, None, -3, list(ROPE.inv_freq), D_PE, "half", validate=True
    )
    assert_close(pool, expected, tolerance("same_kernel", "float32"), name="pool")


@pytest.mark.parametrize("name", sorted(_op_cases()))
def test_op_registration(name):
    """Schema, fake and functionalisation of ``torch.ops.mqnc.<name>`` against its real run."""
    args, kwargs = _op_cases()[name]
    torch.library.opcheck(
        _overload(name),
        args,
        kwargs,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )


def test_op_schemas_carry_the_declared_defaults():
    """Each op's schema is its public function's signature: the same parameters keyword-only,
    the same defaults (``d_v=512``, ``check_inputs=True``, ...; a parameter without one, such
    as ``merge_partials``' ``layout``, has none in the schema either)."""
    for name in OPS:
        fn = getattr(PUBLIC, name)
        declared = inspect.signature(fn).parameters
        schema = {a.name: a for a in getattr(torch.ops.mqnc, name).default._schema.arguments}
        for p in fn.op.params:
            kwonly = declared[p.name].kind is inspect.Parameter.KEYWORD_ONLY
            for i, (field, _) in enumerate(p.fields):
                arg = schema[field]
                assert arg.kwarg_only == kwonly, (name, field)
                if p.defaults is None:
                    assert declared[p.name].default is inspect.Parameter.empty, (name, p.name)
                    assert not arg.has_default_value(), (name, field)
                else:
                    assert arg.default_value == p.defaults[i], (name, field)
        assert schema["backend"].default_value == "triton"
    assert torch.ops.mqnc.mla_decode_partial.default._schema.arguments[5].default_value == 512


def _default_calls():
    """``name -> (args, kwargs)``: each op called with only the arguments that have no default
    (the rows 576 = 512 + 64 wide: ``d_v`` left at 512)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 576, generator=gen).to(DEVICE)
    pool = torch.randn(2, 16, 576, generator=gen).to(DEVICE)
    table = torch.tensor([[0], [1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([16, 5], dtype=torch.int32, device=DEVICE)
    idx = torch.tensor([[0, 7, -1], [3, 20, 11]], dtype=torch.int32, device=DEVICE)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    o = torch.randn(3, 2, 2, D, generator=gen).to(DEVICE)
    lse = torch.randn(3, 2, 2, generator=gen).to(DEVICE)
    slots = torch.tensor([[0, 17, -1], [4, -1, 2]], dtype=torch.int32, device=DEVICE)
    small = torch.randn(3, 16, D, generator=gen).to(DEVICE)
    return {
        "mla_decode_partial": ((q, pool, table, lens), dict(softmax_scale=SCALE)),
        "mla_decode_partial_csr": ((q, pool, indptr, table[:, 0]), dict(softmax_scale=SCALE)),
        "mla_sparse_partial": ((q, pool, idx), dict(softmax_scale=SCALE)),
        "merge_partials": ((o, lse), dict(layout="MBHD")),
        "merge_partials_into": ((o[0].clone(), lse[0].clone(), o[1], lse[1]), {}),
        "tp_partial_scores": ((q[..., :D], small, slots), dict(d_v=D_V)),
        "tp_partial_values": (
            (torch.randn(2, 2, 3, generator=gen).to(DEVICE), small, slots),
            dict(softmax_scale=SCALE, d_v=D_V),
        ),
        "rope_splice": (
            (
                small[:1, :5],
                [torch.zeros(8, D, device=DEVICE)],
                False,
                torch.arange(5, device=DEVICE),
                None,
                3,
                list(ROPE.inv_freq),
                D_PE,
                "half",
            ),
            {},
        ),
    }


@pytest.mark.parametrize("name", sorted(_default_calls()))
def test_an_op_called_without_its_defaulted_arguments_equals_the_public_call(name):
    """``torch.ops.mqnc.<name>`` without the arguments that have defaults (``d_v``,
    ``num_splits``, ``check_inputs``, ``kv_lens``, ``check_lse``, ``mask``, ``validate``, ...)
    runs, and gives what the public function gives for the same call (its own defaults)."""
    args, kwargs = _default_calls()[name]
    fn = getattr(PUBLIC, name)
    # (a mutating op and the function each write their own copy)
    theirs = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
    got = getattr(torch.ops.mqnc, name)(*args, **kwargs)
    if name == "rope_splice":  # (the function's spec and pool, not the codec's fields)
        pools = [p.clone() for p in args[1]]
        fn(args[0], pools, args[3], args[5], ROPE)
        got, want = args[1], pools
    else:
        want = fn(*theirs, **kwargs)
    if name == "merge_partials_into":
        got, want = args[:2], theirs[:2]
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, tolerance("same_kernel", "float32"), name=f"{name} output {i}")


def _step(ops, q, pool, table, lens, idx, acc, lacc, chunk, caches, slots):
    """A holder's step and a requester's fold, as user code writes them (``ops``: the public
    functions, or the ops bound to a backend, ``kernel_ops``)."""
    kw = dict(softmax_scale=SCALE, d_v=D_V)
    o1, l1 = ops.mla_decode_partial(q, pool, table, lens, check_inputs=False, **kw)
    B, H = q.shape[0], q.shape[1]
    out = (q.new_empty(B, H, D_V), q.new_empty(B, H))  # written in place (a holder's buffers)
    o2, l2 = ops.mla_sparse_partial(q, pool, idx, check_indices=False, out=out, **kw)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=q.device)
    o3, _ = ops.mla_decode_partial_csr(
        q, pool, indptr, table.flatten()[:3], lens, check_inputs=False, max_kv_len=32, **kw
    )
    o, lse = ops.merge_partials(
        torch.stack([o1, o2]), torch.stack([l1, l2]), check_lse=False, layout="MBHD"
    )
    ops.merge_partials_into(acc, lacc, o, lse, check_lse=False)
    ops.rope_splice(chunk, caches, slots, 5, ROPE, validate=False)
    return acc * 1.0, lacc, ops.rope_rotate(q, -5, ROPE), o, o3


PUBLIC = types.SimpleNamespace(
    mla_decode_partial=mla_decode_partial,
    mla_sparse_partial=mla_sparse_partial,
    mla_decode_partial_csr=mla_decode_partial_csr,
    merge_partials=merge_partials,
    merge_partials_into=merge_partials_into,
    rope_splice=rope_splice,
    rope_rotate=rope_rotate,
    tp_partial_scores=tp_partial_scores,
    tp_partial_values=tp_partial_values,
    fp8_quantize=fp8_quantize,
    fp8_dequantize=fp8_dequantize,
)


def test_the_torch_backend_is_the_same_ops():
    """``kernel_ops("torch")``: the same ops on another backend (each function has the public
    function's signature, docstring and op), ``kernel_ops("triton")`` the public functions."""
    from mqnc.serving.compute import kernel_ops

    for name in OPS:
        public, ref = getattr(PUBLIC, name), getattr(kernel_ops("torch"), name)
        assert getattr(kernel_ops("triton"), name) is public
        assert inspect.signature(ref) == inspect.signature(public), name
        assert ref.op is public.op and ref.__doc__ == public.__doc__, name


def test_plans_take_their_ops_signature_without_out():
    """A plan function is made from its op's one declaration: the same parameters, no ``out``;
    an op refuses a backend nothing registered, by name."""
    from mqnc.triton_kernels import plan_mla_decode, plan_mla_decode_csr, plan_mla_sparse

    for plan, op in (
        (plan_mla_decode, mla_decode_partial),
        (plan_mla_decode_csr, mla_decode_partial_csr),
        (plan_mla_sparse, mla_sparse_partial),
    ):
        params = dict(inspect.signature(op).parameters)
        assert params.pop("out").default is None
        assert inspect.signature(plan).parameters == params, plan.__name__
    o, lse = torch.zeros(2, 1, 1, 4, device=DEVICE), torch.zeros(2, 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="backend: expected one of .*'triton'.*got 'cuda'"):
        torch.ops.mqnc.merge_partials(o, lse, layout="MBHD", backend="cuda")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compile_fullgraph_equals_eager(backend):
    from mqnc.serving.compute import kernel_ops

    ops = PUBLIC if backend == "triton" else kernel_ops(backend)
    gen = torch.Generator().manual_seed(1)
    q, pool, table, lens, idx = _mla(gen)
    chunk = torch.randn(2, 5, D, generator=gen).to(DEVICE)
    slots = torch.tensor([7, 0, 3, 12, 9], device=DEVICE)

    def fresh():
        acc = torch.zeros(2, 3, D_V, device=DEVICE)
        lacc = torch.full((2, 3), float("-inf"), device=DEVICE)
        return acc, lacc, [torch.zeros(4, 4, D, device=DEVICE) for _ in range(2)]

    acc, lacc, caches = fresh()
    eager = _step(ops, q, pool, table, lens, idx, acc, lacc, chunk, caches, slots)
    acc_c, lacc_c, caches_c = fresh()

    def step(*args):
        return _step(ops, *args)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, pool, table, lens, idx, acc_c, lacc_c, chunk, caches_c, slots)
    tol = tolerance("same_kernel", "float32")
    for i, (a, e) in enumerate(zip(got, eager, strict=True)):
        assert_close(a, e, tol, name=f"output {i}")
    assert_close(acc_c, acc, tol, name="merged in place")
    for layer in range(2):
        assert_close(caches_c[layer], caches[layer], tol, name=f"spliced layer {layer}")


def _overlapping_out(name: str, kind: str):
    """``(args, kwargs, out, names)`` of a call of op ``name`` whose ``out=`` shares memory
    with an input (``kind="input"``: ``o`` is a view into the first tensor argument, ``q`` or
    the partials ``o``) or with the other output (``kind="lse"``: ``lse`` is a view into
    ``o``)."""
    args, kwargs = _op_cases()[f"{name}.out"]
    kwargs = dict(kwargs)
    args, (o, lse) = list(args), kwargs.pop("out")
    first = args[0]
    if kind == "input":  # (a fresh copy: the other cases' tensors stay untouched)
        args[0] = first = first.clone()
        o = first.reshape(-1)[: o.numel()].view(o.shape)
        return args, kwargs, (o, lse), ("out[0] (o)", "q" if name != "merge_partials" else "o")
    lse = o.reshape(-1)[1 : 1 + lse.numel()].view(lse.shape)
    return args, kwargs, (o, lse), ("out[0] (o)", "out[1] (lse)")


@pytest.mark.parametrize("kind", ["input", "lse"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(
    "name", ["mla_decode_partial", "mla_decode_partial_csr", "mla_sparse_partial", "merge_partials"]
)
def test_out_sharing_memory_is_refused(name, backend, kind):
    """An ``out=`` tensor that shares memory with an input or with the other output is refused
    (a ``ValueError`` naming both), through the public function and the ``.out`` overload, on
    each backend: the kernels read the inputs while writing ``out`` (a write lands on what
    another program still reads), so the numbers would be wrong (as torch refuses ``out=``
    that partially overlaps an input)."""
    import re

    from mqnc.serving.compute import kernel_ops  # noqa: F401  (registers the torch backend)

    args, kwargs, out, (a, b) = _overlapping_out(name, kind)
    pattern = f"{re.escape(a)} and {re.escape(b)}: .*share memory"
    with pytest.raises(ValueError, match=pattern):
        _overload(f"{name}.out")(*args, **kwargs, out=list(out), backend=backend)
    fn = getattr(kernel_ops(backend), name)
    call, _ = fn.op._call(tuple(args), kwargs)  # (the schema's arguments to the declared ones)
    with pytest.raises(ValueError, match=pattern):
        fn(**{p.name: getattr(call, p.name) for p in fn.op.params}, out=out)


@pytest.mark.parametrize("name", ["mla_decode_partial", "mla_sparse_partial"])
def test_op_registration_with_an_fp8_pool(name):
    """The attention ops over an FP8 cache (uint8 entries: 128 e4m3 latent bytes, one float32
    scale, 16 bf16 RoPE values; bf16 queries): schema, fake and functionalisation against the
    real run, as for a 16-bit pool."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 128 + D_PE, generator=gen).to(DEVICE, torch.bfloat16)
    rows = torch.randn(3, 16, 128 + D_PE, generator=gen).to(torch.bfloat16)
    pool = fp8_quantize(rows.to(DEVICE), 128)  # [3, 16, 164] uint8
    if name == "mla_decode_partial":
        table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)
        args, kwargs = (q, pool, table, lens), dict(softmax_scale=SCALE, d_v=128, num_splits=2)
    else:
        idx = torch.tensor([[0, 7, 40, -1], [3, -1, 2, 11]], dtype=torch.int32, device=DEVICE)
        args, kwargs = (q, pool, idx), dict(softmax_scale=SCALE, d_v=128)
    torch.library.opcheck(
        _overload(name),
        args,
        kwargs,
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"),
    )
