"""The op registry: each kernel's public signature written once, as a ``torch.library`` op.

An op is declared by a Python function with no body (its signature, annotations and
docstring; ``ops.py`` holds them all) under :func:`kernel_op`, its fake beside it. From that
one signature the registry makes:

- the schema of ``torch.ops.mqnc.<name>`` (``.default``): the declared parameters in order,
  the keyword-only ones keyword-only (after ``*``), each with its declared default, then
  ``backend`` (default ``"triton"``), which picks the implementation; for an op with an
  ``out=`` parameter a second overload ``.out`` takes ``out`` (required, by keyword) before
  ``backend``, writes into the caller's tensors and returns nothing (a custom op
  cannot return an alias of an input). An argument that no schema type carries travels through a
  :class:`Codec` (a RoPE spec as its frequencies, dim and layout; ``int | Tensor`` as a
  tensor-or-None and an int; one tensor or a list of them as a list and a flag);
- the public function, one per backend (:meth:`KernelOp.function`): the declared signature and
  docstring; it checks each argument's type (a ``TypeError`` naming it; a required
  keyword-only one given ``required=`` is named with what it expects when missing), encodes
  it and calls the op (positional parameters positionally, keyword-only ones by keyword).
  Eager calls and ``torch.compile`` take that one path (Dynamo traces the op through its
  fake): there is no ``is_compiling()`` branch anywhere;
- for an op that plans (:meth:`KernelOp.planner`), the plan function: the same signature
  without ``out``, returning a plan whose ``run`` launches with no dispatcher work (the hot
  path); the op's ``"triton"`` implementation is then the plan and its run.

Implementations are registered per backend: ``"triton"``, the launchers (each kernel's
module); ``"torch"``, the fp64 references (``mqnc.reference.torch_backend``, registered by
``mqnc.serving.compute``, a higher layer, when it is imported). Every implementation and fake
takes one argument, the :class:`Call` (one attribute per declared parameter, decoded), so none
of them writes the signature again.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import re
import threading
import types
import typing
from collections.abc import Callable

import torch

from mqnc.base.env import TRITON_INTERPRET

__all__ = [
    "Call",
    "Codec",
    "KernelOp",
    "OpSet",
    "PlanCache",
    "SYNC_CHECKS",
    "byte_range",
    "check_no_overlap",
    "check_out",
    "kernel_op",
    "op_set",
    "eager_is_plain",
    "set_plan_context",
    "plan_context_env",
    "registered_ops",
    "kernel_op_named",
    "written_into",
]

NAMESPACE = "mqnc"
DEFAULT_BACKEND = "triton"
_LIB = torch.library.Library(NAMESPACE, "DEF")
_REGISTRY: dict[str, KernelOp] = {}

Call = types.SimpleNamespace
"""What an implementation receives: one attribute per declared parameter (``out``: the
caller's tensors as a tuple, or None)."""

_SCALARS = {torch.Tensor: "Tensor", int: "int", float: "float", bool: "bool", str: "str"}
_NAMES = {
    torch.Tensor: "a torch.Tensor",
    int: "an int",
    float: "a float",
    bool: "a bool",
    str: "a str",
}


@dataclasses.dataclass(frozen=True)
class Codec:
    """How an argument that no schema type carries travels through an op.

    ``fields``: ``(name, schema type)`` of the schema arguments it becomes;
    ``encode(name, value)`` gives their values (and raises the
    ``TypeError`` naming the argument for a value it cannot carry); ``decode(*values)`` gives
    back what the implementations receive."""

    fields: tuple[tuple[str, str], ...]
    encode: Callable[[str, object], tuple]
    decode: Callable[..., object]


def _optional(tp) -> object | None:
    """``X`` for ``X | None``, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 2:
        if type(None) in args:
            return args[0] if args[1] is type(None) else args[1]
    return None


def _schema_type(tp) -> str:
    inner = _optional(tp)
    if inner is not None:
        return _schema_type(inner) + "?"
    if typing.get_origin(tp) is list:
        return _schema_type(typing.get_args(tp)[0]) + "[]"
    if tp in _SCALARS:
        return _SCALARS[tp]
    raise TypeError(f"no schema type for {tp!r}: give the parameter a Codec")


def _checker(name: str, tp) -> Callable[[object], object]:
    """The caller's check of one argument against its annotation: the value the schema takes,
    or a ``TypeError`` naming the argument (bools are coerced: any truthy value is True)."""
    inner = _optional(tp)
    base = inner if inner is not None else tp
    want = ("None or " if inner is not None else "") + _NAMES[base]

    def bad(value):
        raise TypeError(f"{name}: expected {want}, got {type(value).__name__}")

    if base is bool:
        return bool
    if base is float:

        def check(value):
            if value is None and inner is not None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(value)
            return float(value)

        return check
    exact = (int,) if base is int else (base,)

    def check(value):
        if value is None and inner is not None:
            return None
        if not isinstance(value, exact) or (base is int and isinstance(value, bool)):
            bad(value)
        return value

    return check


@dataclasses.dataclass(frozen=True)
class _Param:
    """One declared parameter: its schema arguments and how a value becomes them (``check``
    for a plain one, ``codec`` for one that no schema type carries)."""

    name: str
    kwonly: bool
    fields: tuple[tuple[str, str], ...]  # (schema name, schema type)
    check: Callable[[object], object] | None
    codec: Codec | None
    tensor: bool  # a Tensor or Tensor | None: what a plan's run takes
    defaults: tuple | None = None  # the declared default as the fields' values (None: required)

    def encode(self, value) -> tuple:
        if self.codec is not None:
            return self.codec.encode(self.name, value)
        return (self.check(value),)


def _param(p: inspect.Parameter, tp, codec: Codec | None, mutated: bool) -> _Param:
    if codec is not None:
        fields, check = codec.fields, None
    else:
        fields, check = ((p.name, _schema_type(tp)),), _checker(p.name, tp)
    if mutated:  # (the alias letters are given per schema: see _schema)
        fields = tuple((n, t.replace("Tensor", "Tensor(!)", 1)) for n, t in fields)
    tensor = codec is None and (tp is torch.Tensor or _optional(tp) is torch.Tensor)
    kwonly = p.kind is inspect.Parameter.KEYWORD_ONLY
    defaults = None
    if p.default is not inspect.Parameter.empty:
        defaults = codec.encode(p.name, p.default) if codec is not None else (p.default,)
    return _Param(p.name, kwonly, fields, check, codec, tensor, defaults)


def _literal(value: object) -> str:
    """A default value as a schema writes it (``None``, ``True``, ``512``, ``0.5``,
    ``"MBHD"``)."""
    if value is None or isinstance(value, (bool, int)):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    raise TypeError(f"no schema literal for the default {value!r}")


def _schema(params: list[_Param], extra: list[str], returns: str) -> str:
    """The schema's arguments in declared order, as the declaration has them: positional ones
    first, then (after ``*``) the keyword-only ones, each with the declared default (a
    codec's parameter: its fields' values of it); then ``extra`` (keyword-only when the
    declaration has keyword-only parameters)."""
    args, star = [], False
    for p in params:
        if p.kwonly and not star:
            args.append("*")
            star = True
        for i, (name, tp) in enumerate(p.fields):
            default = "" if p.defaults is None else "=" + _literal(p.defaults[i])
            args.append(f"{tp} {name}{default}")
    defaulted = any(p.defaults is not None for p in params)
    if not star and defaulted and any("=" not in e for e in extra):
        args.append("*")  # (a required extra, ``out``, after a default: by keyword)
    text = "(" + ", ".join(args + extra) + f") -> {returns}"
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    return re.sub(r"\(!\)", lambda _: f"({next(letters)}!)", text)


def _returns(tp) -> str:
    if tp is None or tp is type(None):
        return "()"
    if typing.get_origin(tp) is tuple:
        return "(" + ", ".join(_schema_type(t) for t in typing.get_args(tp)) + ")"
    return _schema_type(tp)


def check_out(out: object) -> tuple[torch.Tensor, ...]:
    """``out=`` as the ops take it: a tuple (or list) of two tensors, ``(o, lse)``."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            f"out: expected a tuple (o, lse) of two tensors (a pair), got {type(out).__name__}"
        )
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"out[{i}]: expected a torch.Tensor, got {type(t).__name__}")
    return tuple(out)


def byte_range(t: torch.Tensor) -> tuple[int, int] | None:
    """The addresses ``[begin, end)`` that ``t`` can touch (None: none, an empty or meta
    tensor): from its first element to its last by its strides (torch has no negative ones)."""
    n = t.numel()
    if n == 0 or t.is_meta:
        return None
    begin = t.data_ptr()
    if not t.is_contiguous():
        n = 1 + sum((k - 1) * s for k, s in zip(t.shape, t.stride(), strict=True))
    return begin, begin + n * t.element_size()


def _tensors(values: dict[str, object]):
    """``(name, tensor)`` of every tensor among ``values`` (a list of them named by index)."""
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            yield name, v
        elif isinstance(v, (tuple, list)):
            yield from ((f"{name}[{i}]", t) for i, t in enumerate(v) if isinstance(t, torch.Tensor))


def check_no_overlap(out: tuple[torch.Tensor, ...], inputs: dict[str, object]) -> None:
    """Refuse ``out`` tensors that share memory with one of ``inputs`` (name -> argument) or
    with each other: a ``ValueError`` naming both.

    The kernels read their inputs while they write ``out`` (one program's write lands on what
    another still reads) and the references copy ``o``, then ``lse``, into ``out`` (an ``lse``
    inside ``o`` overwrites it, an ``o`` inside ``q`` overwrites the caller's ``q``): any
    sharing gives wrong numbers. Torch refuses an ``out=`` that partially overlaps an input
    the same way. The test compares the address ranges each tensor can touch (first to last
    element by its strides) on one device: exact for the dense tensors the ops take, and on the
    safe side for strided views (two interleaved views of one buffer count as sharing).
    ``torch._C._overlaps`` is not used: it is private, undocumented, and reports two adjacent,
    disjoint halves of one buffer as overlapping."""
    outs = [
        (f"out[{i}] ({'o lse'.split()[i]})", t.device, byte_range(t)) for i, t in enumerate(out)
    ]
    ins = [(n, t.device, byte_range(t)) for n, t in _tensors(inputs)]
    pairs = [(o, i) for i in ins for o in outs]
    pairs += [(a, b) for k, a in enumerate(outs) for b in outs[k + 1 :]]
    for (name, device, mine), (other, where, theirs) in pairs:
        if mine and theirs and device == where and mine[0] < theirs[1] and theirs[0] < mine[1]:
            raise ValueError(
                f"{name} and {other}: expected separate memory (an output must not share "
                f"memory with an input or the other output), got tensors that share memory "
                f"(addresses {mine[0]:#x}..{mine[1]:#x} and {theirs[0]:#x}..{theirs[1]:#x} "
                f"on {device})"
            )


def written_into(out, result: tuple[torch.Tensor, ...]):
    """``result`` copied into ``out`` and ``out`` returned when one is given (``result`` when
    not): the ``out=`` of an implementation that returns new tensors (the fp64 references).
    ``out`` must match the results' shapes, dtypes and device (as a plan's ``run`` requires of
    its ``out``): nothing is broadcast or cast. A result that is its ``out`` tensor already (a
    kernel wrote it in place) is not copied."""
    if out is None:
        return result
    out = check_out(out)
    for name, t, r in zip(("out[0] (o)", "out[1] (lse)"), out, result, strict=True):
        if t is r:
            continue
        if t.shape != r.shape or t.dtype != r.dtype or t.device != r.device:
            raise ValueError(
                f"{name}: expected shape {tuple(r.shape)}, {r.dtype} on {r.device}, got shape "
                f"{tuple(t.shape)}, {t.dtype} on {t.device}"
            )
        t.copy_(r)
    return out


_MISSING = object()  # a required keyword-only argument with a hint, not given


def _generated(
    name: str,
    signature: inspect.Signature,
    run,
    doc: str | None,
    module: str,
    required: dict[str, str] | None = None,
):
    """A function ``name`` with exactly ``signature`` (Python binds the arguments: a missing or
    unknown one is the usual ``TypeError``) that returns ``run(values)`` (or ``run(values,
    out)``), ``values`` the arguments in declared order without ``out``. ``required``:
    keyword-only parameter -> what it expects; such a parameter missing is a one-line
    ``TypeError`` naming it and saying that, not Python's bare one."""
    required = required or {}
    parts, ns, star, checks = [], {"_run": run, "_MISSING": _MISSING}, False, []
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.name in required:
            ns[f"_m_{p.name}"] = (
                f"{p.name}: expected {required[p.name]}, got no {p.name} (a required keyword "
                f"argument of {name})"
            )
            parts.append(f"{p.name}=_MISSING")
            checks.append(f"    if {p.name} is _MISSING:\n        raise TypeError(_m_{p.name})\n")
        elif p.default is inspect.Parameter.empty:
            parts.append(p.name)
        else:
            ns[f"_d_{p.name}"] = p.default
            parts.append(f"{p.name}=_d_{p.name}")
    names = [n for n in signature.parameters if n != "out"]
    out = ", out" if "out" in signature.parameters else ""
    source = f"def {name}({', '.join(parts)}):\n{''.join(checks)}"
    source += f"    return _run(({', '.join(names)},){out})\n"
    exec(compile(source, f"<mqnc op {name}>", "exec"), ns)  # noqa: S102  (a signature, no input)
    fn = ns[name]
    fn.__doc__, fn.__module__, fn.__qualname__ = doc, module, name
    fn.__signature__ = signature
    return fn


class KernelOp:
    """One op: its declared signature, schema, fake and implementations by backend.

    Made by :func:`kernel_op` from the declaration; ``fake(call)`` gives the outputs' shapes
    and dtypes (None: the op returns nothing); ``mutates``: the parameters it writes in place;
    ``codecs``: parameter -> :class:`Codec`; ``returns``: the parameter whose argument the
    function returns (the op itself then returns nothing: ``rope_splice`` returns its pool);
    ``required``: a required keyword-only parameter -> what it expects (the public and plan
    functions' ``TypeError`` when it is missing says so)."""

    def __init__(
        self, declaration, *, fake=None, mutates=(), codecs=None, returns=None, required=None
    ):
        self.name = name = declaration.__name__
        self.required = dict(required or {})
        self.declaration = declaration
        self.signature = inspect.signature(declaration)
        hints = typing.get_type_hints(declaration)
        codecs = codecs or {}
        self.params = tuple(
            _param(p, hints[p.name], codecs.get(p.name), p.name in mutates)
            for p in self.signature.parameters.values()
            if p.name != "out"
        )
        self.has_out = "out" in self.signature.parameters
        self._fake = fake
        self._returns = returns
        self._impls: dict[str, Callable[[Call], object]] = {}
        self._functions: dict[str, Callable] = {}
        self._eager: PlanCache | None = None  # a planner's cache: the eager fast path
        self._checks: Callable[[Call], None] | None = None  # value checks apart from the plan
        self._names = tuple(p.name for p in self.params)
        self._defaults = {"backend": DEFAULT_BACKEND, "out": None}
        for p in self.params:  # (the schema's defaults: what a caller of the op may leave out)
            if p.defaults is not None:
                self._defaults.update(zip((n for n, _ in p.fields), p.defaults, strict=True))
        names = [n for p in self.params for n, _ in p.fields]
        self._names_default, self._out_names = [*names, "backend"], [*names, "out", "backend"]
        # the schema's positional arguments, then its keyword-only ones (passed by name)
        self._n_positional = sum(len(p.fields) for p in self.params if not p.kwonly)
        self._kw_fields = tuple(n for p in self.params if p.kwonly for n, _ in p.fields)
        self._coded = [p for p in self.params if p.codec is not None]
        backend = f'str backend="{DEFAULT_BACKEND}"'
        ret = "()" if returns else _returns(hints.get("return"))
        _LIB.define(name + _schema(list(self.params), [backend], ret))
        _LIB.impl(name, self._kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", self._fake_kernel, lib=_LIB)
        self.op = getattr(torch.ops.mqnc, name).default
        self.out_op = None
        if self.has_out:
            _LIB.define(
                f"{name}.out" + _schema(list(self.params), ["Tensor(!)[] out", backend], "()")
            )
            _LIB.impl(f"{name}.out", self._out_kernel, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{name}.out", _no_outputs, lib=_LIB)
            self.out_op = getattr(torch.ops.mqnc, name).out

    # -- the dispatcher's side: the schema's arguments back to a Call -----------------------

    def _call(self, args: tuple, kwargs: dict, out: bool = False) -> tuple[Call, str]:
        """The call the dispatcher passes (``args`` positional, any by keyword), decoded;
        ``out``: of the ``.out`` overload (its arguments end ``out, backend``)."""
        names = self._out_names if out else self._names_default
        values = dict(self._defaults)
        values.update(zip(names, args, strict=False))  # (trailing defaults: filled in)
        values.update(kwargs)
        backend, out = values.pop("backend"), values.pop("out")
        for p in self._coded:
            values[p.name] = p.codec.decode(*(values.pop(n) for n, _ in p.fields))
        if self.has_out:
            values["out"] = None if out is None else tuple(out)
        return Call(**values), backend

    def _impl(self, backend: str):
        impl = self._impls.get(backend)
        if impl is None:
            raise ValueError(
                f"backend: expected one of {tuple(self._impls)} for {self.name} (the torch "
                f"backend registers when mqnc.serving.compute is imported), got {backend!r}"
            )
        return impl

    def _kernel(self, *args, **kwargs):
        call, backend = self._call(args, kwargs)
        result = self._impl(backend)(call)
        return None if self._returns else result

    def _out_kernel(self, *args, **kwargs) -> None:
        call, backend = self._call(args, kwargs, out=True)
        check_out(call.out)  # (a direct call of the .out overload is checked as the function's)
        check_no_overlap(call.out, {p.name: getattr(call, p.name) for p in self.params})
        result = self._impl(backend)(call)
        if result is not None:  # (an implementation that made new tensors: copied in, checked)
            written_into(call.out, result)

    def _fake_kernel(self, *args, **kwargs):
        if self._fake is None:
            return None
        return self._fake(self._call(args, kwargs)[0])

    # -- the caller's side: the public function of one backend -----------------------------

    def _encoded(self, values: tuple) -> list:
        """The schema's arguments (in order, each field of a codec's) of the declared
        parameters' ``values``."""
        args = []
        for p, v in zip(self.params, values, strict=True):
            if p.codec is None:
                args.append(p.check(v))
            else:
                args.extend(p.codec.encode(p.name, v))
        return args

    def _caller(self, backend: str):
        returns = None
        if self._returns is not None:
            returns = [p.name for p in self.params].index(self._returns)

        default = backend == DEFAULT_BACKEND

        def run(values, out=None):
            eager = self._eager
            if default and eager is not None and eager_is_plain():
                plan = eager.get(eager.key_of(values), count_miss=False)
                if plan is not None:  # a cached plan: launched here, no dispatcher round trip
                    return self._run_cached(plan, values, out)
            args = self._encoded(values)
            n = self._n_positional
            kwargs = dict(zip(self._kw_fields, args[n:], strict=True))
            if out is not None:
                out = check_out(out)
                self.out_op(*args[:n], **kwargs, out=list(out), backend=backend)
                return out
            result = self.op(*args[:n], **kwargs, backend=backend)
            return result if returns is None else values[returns]

        return run

    def _run_cached(self, plan, values: tuple, out):
        """``plan`` (found by ``values``' key) run as the op's planner implementation runs it:
        its value checks first when a switch of them is on (:meth:`checks_apart`), then the
        tensor arguments positionally, the keyword-only ones by keyword; ``out`` checked as
        the ``.out`` overload checks it (pair of tensors, no memory shared with an input)."""
        if self._checks is not None and self._eager.checking(values):
            self._checks(self._decoded(values))
        tensors = self._plan_tensors(values)
        if out is None:
            return plan.run_planned(*tensors[0], **tensors[1])
        out = check_out(out)
        check_no_overlap(out, dict(zip(self._names, values, strict=True)))
        plan.run_planned(*tensors[0], **tensors[1], out=out)
        return out

    def _decoded(self, values: tuple) -> Call:
        """The call an implementation receives for the declared arguments ``values``."""
        call = {}
        for p, v in zip(self.params, values, strict=True):
            call[p.name] = p.check(v) if p.codec is None else p.codec.decode(*p.encode(v))
        return Call(**call)

    def checks_apart(self, checks):
        """Decorator: ``checks(call)`` runs this op's host-syncing value checks (those its
        switches turn on: :data:`SYNC_CHECKS`) for a call whose plan does not depend on the
        values checked. A planning op with it caches the plans of calls with their checks on
        too (a checked call's key differs from an unchecked one's only by the switch), and runs
        ``checks`` before each such call's cached plan: the checks, not the planning, are then
        the price of checking. Returns ``checks``."""
        self._checks = checks
        if self._eager is not None:
            self._eager.checks_apart = True
        return checks

    def function(self, backend: str = DEFAULT_BACKEND) -> Callable:
        """The public function that runs this op on ``backend`` (one object per backend)."""
        fn = self._functions.get(backend)
        if fn is None:
            module = self.declaration.__module__
            doc = self.declaration.__doc__
            fn = _generated(
                self.name, self.signature, self._caller(backend), doc, module, self.required
            )
            fn.op = self
            self._functions[backend] = fn
        return fn

    def implementation(self, backend: str):
        """Decorator: ``impl(call)`` runs this op on ``backend``. The triton implementation's
        module becomes the public function's ``__module__`` (where it is documented and its
        docstring examples run)."""

        def register(impl):
            self._impls[backend] = impl
            if backend == DEFAULT_BACKEND:
                self.function().__module__ = impl.__module__
            return impl

        return register

    def planner(self, build):
        """Decorator: ``build(call) -> plan`` plans this op (every check, the split choice);
        returns the plan function (this op's signature without ``out``, ``build``'s name and
        docstring). The op's triton implementation becomes ``build(call).run_planned(<the
        tensor arguments, keyword-only ones by keyword>, out=call.out)``: the plan launched on
        the tensors it was made from, ``out`` already checked by the op for shared memory."""
        pos = [p.name for p in self.params if p.tensor and not p.kwonly]
        kw = [p.name for p in self.params if p.tensor and p.kwonly]
        pos_i = [i for i, p in enumerate(self.params) if p.tensor and not p.kwonly]
        kw_i = [(p.name, i) for i, p in enumerate(self.params) if p.tensor and p.kwonly]
        self._plan_tensors = lambda values: (
            [values[i] for i in pos_i],
            {n: values[i] for n, i in kw_i},
        )

        def plan(values):
            return build(self._decoded(values))

        plans = PlanCache(self.params)

        def run(call):
            tensors = {n: getattr(call, n) for n in kw}
            key = plans.key(call)
            plan = plans.get(key)
            if plan is None:
                plan = build(call)
                if key is not None:
                    plans.put(key, plan)
            elif self._checks is not None and plans.checking_call(call):
                self._checks(call)
            return plan.run_planned(*(getattr(call, n) for n in pos), **tensors, out=call.out)

        self.plans = plans
        self._eager = plans

        self.implementation(DEFAULT_BACKEND)(run)
        self.function().__module__ = build.__module__
        params = [p for p in self.signature.parameters.values() if p.name != "out"]
        sig = self.signature.replace(
            parameters=params, return_annotation=inspect.signature(build).return_annotation
        )
        return _generated(build.__name__, sig, plan, build.__doc__, build.__module__, self.required)


def _no_outputs(*args, **kwargs) -> None:
    return None


SYNC_CHECKS = ("check_inputs", "check_indices", "check_lse", "validate")
"""The switches of host-syncing value checks (the ops' own parameters): a call with one of them
on is planned afresh (its plan may depend on the values it reads, and the check must run)."""

_CONTEXT: dict[str, object] = {}
_CONTEXT_KEY = [()]  # _CONTEXT's items, sorted: what every key reads
_CONTEXT_ENV: list[str] = [TRITON_INTERPRET]


def set_plan_context(name: str, value: object) -> None:
    """Record process-wide state that a plan depends on beyond its call's arguments (a tile
    forced by a tuning hook, a forced backend, the combine's PDL switch): ``value`` (hashable;
    None: the default) becomes part of every plan's key, so a plan made under one state is
    never reused under another, and is again once the state is back. Cheap per call: keys read
    one precomputed tuple."""
    if value is None:
        _CONTEXT.pop(name, None)
    else:
        _CONTEXT[name] = value
    _CONTEXT_KEY[0] = tuple(sorted(_CONTEXT.items()))


def plan_context_env(name: str) -> str:
    """Make the environment variable ``name`` part of every plan's key (its raw value, read per
    call: a plan made under one value is never reused under another). Returns ``name``."""
    if name not in _CONTEXT_ENV:
        _CONTEXT_ENV.append(name)
    return name


def eager_is_plain() -> bool:
    """True when a call runs in plain eager mode: no ``torch.compile`` tracing, no torch
    function or dispatch mode, no functorch transform (vmap, grad). Only then may a public
    function launch a cached plan itself instead of going through the dispatcher."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._are_functorch_transforms_active()
    )


class PlanCache:
    """The plans of an op's eager calls, by call signature: the op's triton implementation
    plans a call once per signature and launches the cached plan on every later call with that
    signature (FlashInfer's plan/run, made implicit), so an eager call costs the dispatcher, a
    key and the plan's launch, not the checks and split search again.

    A key is each tensor argument's shape, strides, dtype and device, every other argument's
    value, the interpreter mode and the plan context (:func:`set_plan_context`,
    :func:`plan_context_env`); a call with a
    host-syncing check on (:data:`SYNC_CHECKS`) is never cached (its checks read values), nor
    one with an argument that cannot be hashed. What a cached plan skips is what its key fixes:
    the shape, dtype, device and layout checks; the values a plan reads only with those checks
    on. At most ``size`` plans per op, least recently used dropped (a plan holds no tensor of
    its call). A plan that owns a workspace (the fused combine's partials and tickets) is not
    kept: the calls sharing it could run on two streams at once; plan such a call once and run
    the plan (``plan_mla_decode(...).run``) to reuse it."""

    def __init__(self, params, size: int = 64) -> None:
        params = tuple(params)
        self._tensors = tuple(i for i, p in enumerate(params) if p.tensor)
        self._values = tuple((i, p) for i, p in enumerate(params) if not p.tensor)
        self._sync = tuple(i for i, p in enumerate(params) if p.name in SYNC_CHECKS)
        self._names = tuple(p.name for p in params)
        self.checks_apart = False  # (KernelOp.checks_apart: checked calls are cached too)
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.size = size
        self.hits = self.misses = 0

    @classmethod
    def of(cls, tensors: tuple[str, ...], values: tuple[str, ...], *, checks_apart=False):
        """A cache for a function that is not an op (a layout adapter): its arguments in the
        order :meth:`key_of` takes them, ``tensors`` first, then the other ``values`` (used as
        given: call :meth:`key_of` with ``decoded=True``); ``checks_apart`` as for an op."""
        params = [types.SimpleNamespace(name=n, tensor=True) for n in tensors]
        params += [types.SimpleNamespace(name=n, tensor=False, codec=None) for n in values]
        cache = cls(params)
        cache.checks_apart = checks_apart
        return cache

    def checking(self, values: tuple) -> bool:
        """True when a host-syncing check switch of the call ``values`` is on."""
        return any(values[i] for i in self._sync)

    def checking_call(self, call: Call) -> bool:
        """:meth:`checking` of a decoded call."""
        return any(getattr(call, self._names[i]) for i in self._sync)

    def key(self, call: Call) -> tuple | None:
        """``call``'s key, or None when it is not to be cached."""
        return self.key_of(tuple(getattr(call, n) for n in self._names), decoded=True)

    def key_of(self, values: tuple, *, decoded: bool = False) -> tuple | None:
        """The key of a call given as its declared arguments in order (``decoded``: as an
        implementation receives them; else as a caller passed them, each checked as the
        public function checks it first, so both give one key); None when the call is not to
        be cached, or a tensor argument is not a plain ``torch.Tensor`` (a subclass goes
        through the dispatcher)."""
        if not self.checks_apart and self.checking(values):
            return None
        parts = [_CONTEXT_KEY[0]]
        parts += map(os.environ.get, _CONTEXT_ENV)
        for i in self._tensors:
            t = values[i]
            if t is None:
                parts.append(None)
            elif type(t) is torch.Tensor:
                parts.append((t.shape, t.stride(), t.dtype, t.device))
            else:
                return None
        for i, p in self._values:
            v = values[i]
            if not decoded:
                v = p.check(v) if p.codec is None else p.codec.decode(*p.encode(v))
            parts.append(v)
        key = tuple(parts)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def get(self, key: tuple | None, *, count_miss: bool = True):
        """The plan kept under ``key`` (None: none, or no key); a hit is counted, a miss only
        with ``count_miss`` (the eager path's lookup leaves its misses to the op's own)."""
        if key is None:
            return None
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                self.misses += count_miss
            else:
                self.hits += 1
                self._plans.move_to_end(key)
            return plan

    def put(self, key: tuple, plan) -> None:
        """Keep ``plan`` under ``key``, unless it owns a workspace (``plan.owns_workspace``: two
        calls on two streams would share it)."""
        if getattr(plan, "owns_workspace", False):
            return
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)

    def clear(self) -> None:
        """Drop every plan and zero the counts (``hits``, ``misses``)."""
        with self._lock:
            self._plans.clear()
            self.hits = self.misses = 0


def kernel_op(*, fake=None, mutates=(), codecs=None, returns=None, required=None):
    """Declare an op from a function's signature (see :class:`KernelOp`); returns its public
    function (the ``"triton"`` backend's), whose ``.op`` is the :class:`KernelOp`."""

    def declare(declaration):
        kop = KernelOp(
            declaration,
            fake=fake,
            mutates=mutates,
            codecs=codecs,
            returns=returns,
            required=required,
        )
        _REGISTRY[kop.name] = kop
        return kop.function()

    return declare


def kernel_op_named(name: str) -> KernelOp:
    """The declared op ``name`` (a ``ValueError`` naming the declared ones otherwise)."""
    kop = _REGISTRY.get(name)
    if kop is None:
        raise ValueError(f"op: expected one of {tuple(_REGISTRY)}, got {name!r}")
    return kop


def registered_ops() -> tuple[str, ...]:
    """The names of the declared ops (``torch.ops.mqnc.<name>``), in declaration order."""
    return tuple(_REGISTRY)


class OpSet:
    """The ops bound to one backend: attribute ``<name>`` is that op's public function on it
    (for ``"triton"``, the very functions of :mod:`mqnc.triton_kernels`)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __getattr__(self, name: str):
        kop = _REGISTRY.get(name)
        if kop is None:
            raise AttributeError(f"no kernel op {name!r} (ops: {', '.join(_REGISTRY)})")
        return kop.function(self.backend)

    def __dir__(self):
        return [*super().__dir__(), *_REGISTRY]

    def __repr__(self) -> str:
        return f"OpSet({self.backend!r}: {', '.join(_REGISTRY)})"


_OP_SETS: dict[str, OpSet] = {}


def op_set(backend: str = DEFAULT_BACKEND) -> OpSet:
    """The :class:`OpSet` of ``backend`` (one object per backend)."""
    if backend not in _OP_SETS:
        _OP_SETS[backend] = OpSet(backend)
    return _OP_SETS[backend]
