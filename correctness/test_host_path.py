"""The host path of a launch: what Python does between a caller and the kernel launch.

At the decode operating point the host, not the kernel, can set a call's cost (an eager dense
call took 209 us of host time against 12.5 us on an H200 before plans were cached and run
paths precomputed). Host time is not asserted here (no test depends on timing): the Python
function calls that ``plan.run`` and an eager call make with the kernel launch stubbed are
counted under ``sys.setprofile`` and pinned, so work added to the run path fails here;
``perf/bench_host.py --launch`` measures the microseconds. Also: the eager call's plan cache
(hits, what is never cached, bit-identical results, no tensor kept alive) and the compiled
fast path of :class:`~mqnc.triton_kernels._core.launch.LaunchRunner` on a stand-in kernel.
"""

from __future__ import annotations

import gc
import pathlib
import subprocess
import sys
import weakref

import pytest
import torch

from mqnc.testing import default_device
from mqnc.triton_kernels import mla_decode_partial, plan_mla_decode
from mqnc.triton_kernels._core import launch as _launch
from mqnc.triton_kernels._core.launch import Launch, LaunchRunner
from mqnc.triton_kernels.mla.plan import forced_tile

DEVICE = default_device()

# Python-level calls (``sys.setprofile`` "call" events) of one run, launches stubbed. Raise a
# pin only with a reason; lower it when the path gets shorter. (An eager call finds its cached
# plan in the public function itself, without the dispatcher's round trip: 48 calls before.)
RUN_CALLS = 20
EAGER_CALLS = 36
SCALE = 0.1


def _inputs(seed: int = 0, B: int = 1, H: int = 16, ct: int = 128):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 576, generator=gen).to(DEVICE, torch.bfloat16)
    pool = torch.randn(B * ct // 64 + 1, 64, 576, generator=gen).to(DEVICE, torch.bfloat16)
    table = torch.arange(B * ct // 64, dtype=torch.int32, device=DEVICE).reshape(B, ct // 64)
    lens = torch.full((B,), ct, dtype=torch.int32, device=DEVICE)
    return q, pool, table, lens


def _calls(fn) -> int:
    n = [0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


_PINNED = """
import os, sys
os.environ.pop("MQNC_POISON_OUTPUTS", None)
sys.path.insert(0, "correctness")
from test_host_path import SCALE, _calls, _inputs
from mqnc.triton_kernels import mla_decode_partial, plan_mla_decode
from mqnc.triton_kernels._core.launch import LaunchRunner
launched = []
LaunchRunner.__call__ = lambda self, interpreted, *t: launched.append(self.k)
q, pool, table, lens = _inputs(ct=2048)
kw = dict(softmax_scale=SCALE, check_inputs=False)
plan = plan_mla_decode(q, pool, table, lens, **kw)
mla_decode_partial(q, pool, table, lens, **kw)  # (planned and cached)
launched.clear()
run = _calls(lambda: plan.run(q, pool, table, lens))
eager = _calls(lambda: mla_decode_partial(q, pool, table, lens, **kw))
print(plan.num_splits, run, eager, *launched)
"""


def test_plan_run_and_eager_call_make_pinned_python_calls():
    """``plan.run`` is the shape comparison, the output allocations and the kernels' launches;
    an eager call adds the dispatcher, the argument checks and the plan cache's key: counted
    with the launches stubbed (a split call: attention, then the combine) and outputs not
    poisoned (as in production). Counted in a Python of its own: in a suite worker what earlier
    test files left behind (imports, hooks of torch's dispatcher) added calls (50 once, in a
    loaded 2-worker run), which are not the package's path."""
    r = subprocess.run(
        [sys.executable, "-c", _PINNED], capture_output=True, text=True, timeout=300,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    splits, run, eager, *launched = map(int, r.stdout.split())
    print(f"plan.run: {run} Python calls; eager call: {eager}")
    assert splits > 1
    assert launched == [9, 5, 9, 5]  # attention (7 inputs + 2 outputs), combine, twice
    assert run <= RUN_CALLS
    assert eager <= EAGER_CALLS


def test_eager_calls_reuse_one_plan_per_signature_and_match_a_fresh_plan():
    """The second eager call with the same signature (new values) finds the plan the first made;
    its result is bit-identical to a fresh plan's run on the same inputs."""
    kop = mla_decode_partial.op
    kop.plans.clear()
    kw = dict(softmax_scale=SCALE, check_inputs=False)
    q, pool, table, lens = _inputs(0)
    mla_decode_partial(q, pool, table, lens, **kw)
    hits = kop.plans.hits
    q2, pool2, table2, lens2 = _inputs(1)
    lens2 = torch.tensor([77], dtype=torch.int32, device=DEVICE)
    o, lse = mla_decode_partial(q2, pool2, table2, lens2, **kw)
    assert kop.plans.hits == hits + 1
    o_ref, lse_ref = plan_mla_decode(q2, pool2, table2, lens2, **kw).run(q2, pool2, table2, lens2)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    # and the call is right: against the checked (never cached) call
    o_chk, lse_chk = mla_decode_partial(q2, pool2, table2, lens2, softmax_scale=SCALE)
    assert torch.equal(o, o_chk) and torch.equal(lse, lse_chk)


def test_a_checked_call_reuses_its_plan_and_still_checks():
    """A padded-table call with its checks on is cached like one without (its plan does not
    depend on the values checked), and its checks run before every launch of the cached plan:
    a length past the table's capacity, or a page out of the pool, is refused on a hit too."""
    kop = mla_decode_partial.op
    kop.plans.clear()
    q, pool, table, lens = _inputs(0)
    for _ in range(2):
        mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE)
    assert (kop.plans.hits, kop.plans.misses) == (1, 1)
    with pytest.raises(ValueError, match=r"cache_seqlens: expected values in \[0, 128\]"):
        mla_decode_partial(q, pool, table, lens + 1, softmax_scale=SCALE)
    with pytest.raises(ValueError, match="block_table: expected block ids in"):
        mla_decode_partial(q, pool, table + 50, lens, softmax_scale=SCALE)
    assert (kop.plans.hits, kop.plans.misses) == (3, 1)


def test_what_the_plan_cache_never_reuses():
    """Another signature (a stride, a scale) or a forced tile is another key; a CSR call with
    its checks on is planned afresh (its split choice reads the longest row the checks find)."""
    kop = mla_decode_partial.op
    kop.plans.clear()
    q, pool, table, lens = _inputs(0)
    kw = dict(check_inputs=False)
    mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, **kw)
    mla_decode_partial(q, pool, table, lens, softmax_scale=2 * SCALE, **kw)
    wide = torch.empty(1, 16, 640, dtype=torch.bfloat16, device=DEVICE)[..., :576]
    wide.copy_(q)
    mla_decode_partial(wide, pool, table, lens, softmax_scale=SCALE, **kw)
    with forced_tile("32x32w8s5"):
        mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, **kw)
    assert (kop.plans.hits, kop.plans.misses) == (0, 4)
    mla_decode_partial(q, pool, table, lens, softmax_scale=SCALE, **kw)
    assert kop.plans.hits == 1
    from mqnc.triton_kernels import mla_decode_partial_csr

    csr = mla_decode_partial_csr.op
    csr.plans.clear()
    indptr = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        mla_decode_partial_csr(q, pool, indptr, table[0], softmax_scale=SCALE)
    assert (csr.plans.hits, csr.plans.misses) == (0, 0)


def test_a_plan_keeps_no_tensor_it_was_made_from():
    """A (cached) plan holds stand-ins of its planning tensors, never the tensors: the cache
    pool it was made on is freed when its caller drops it."""
    q, pool, table, lens = _inputs(0)
    plan = plan_mla_decode(q, pool, table, lens, softmax_scale=SCALE, check_inputs=False)
    alive = weakref.ref(pool)
    del pool
    gc.collect()
    assert alive() is None
    assert all(a.is_meta for ln in plan.launches for a in ln.args if isinstance(a, torch.Tensor))


def test_plan_run_still_refuses_another_signature():
    q, pool, table, lens = _inputs(0)
    plan = plan_mla_decode(q, pool, table, lens, softmax_scale=SCALE, check_inputs=False)
    with pytest.raises(ValueError, match="block_table: expected shape"):
        plan.run(q, pool, table[:, :1], lens)
    with pytest.raises(TypeError, match="cache_seqlens: expected a torch.Tensor"):
        plan.run(q, pool, table, [128])


class _Compiled:
    """A stand-in for Triton's CompiledKernel: its launcher ``run`` and ``compiled[grid]``'s
    wrapper record their calls."""

    function, packed_metadata = "function", "packed"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("run", args))

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("wrapper", grid, args))


class _Jit:
    """A stand-in for a compiled-mode JITFunction: parameters ``a, b, n, BLOCK`` (``BLOCK`` a
    constexpr given by keyword); ``kernel[grid](...)`` records and returns a compiled kernel."""

    arg_names = ["a", "b", "n", "BLOCK"]

    def __init__(self):
        import inspect

        self.params = [type("P", (), {"default": inspect.Parameter.empty})() for _ in range(4)]
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log)

        return launch


def test_launch_runner_launches_the_compiled_kernel_directly_after_the_first_call(monkeypatch):
    """Compiled mode: the first call goes through the JIT, later ones call the compiled
    kernel's launcher (``CompiledKernel.run``) with the grid, the current stream, the kernel's
    function and metadata, no launch hooks, then the run's tensors, the fixed arguments and the
    constexprs in parameter order; a tensor of other 16-byte alignment goes through the JIT
    again; with a launch hook registered (a profiler's), Triton's own wrapper launches (it
    calls the hooks)."""
    import triton

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    jit = _Jit()
    runner = LaunchRunner(Launch("k", jit, (4,), (None, None, 7), dict(BLOCK=64, num_warps=4)), 2)
    base = torch.empty(64, dtype=torch.float32)
    a, b = base[:8], base[8:16]
    runner(False, a, b)
    runner(False, a, b)
    off = base[1:9]  # 4 bytes past a 16-byte boundary
    runner(False, off, b)
    assert [e[0] for e in jit.log] == ["jit", "run", "jit"]
    assert jit.log[0][2:] == ((a, b, 7), dict(BLOCK=64, num_warps=4))
    assert jit.log[1][1] == (4, 1, 1, 1234, "function", "packed", None, None, None, a, b, 7, 64)
    hook = triton.knobs.runtime.launch_enter_hook
    monkeypatch.setattr(hook, "calls", [lambda metadata: None])
    runner(False, off, b)
    assert jit.log[-1] == ("wrapper", (4, 1, 1), (off, b, 7, 64))


def test_interpreted_runs_take_the_launch_lock(monkeypatch):
    held = []

    class Lock:
        def __enter__(self):
            held.append(True)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(_launch, "interpreter_launch", lambda: Lock())
    jit = _Jit()
    LaunchRunner(Launch("k", jit, (1,), (None, None, 3), dict(BLOCK=16)), 2)(True, 1, 2)
    assert held == [True] and jit.log[0][0] == "jit"


def test_a_plan_that_owns_a_workspace_is_not_shared_between_eager_calls():
    """A fused-combine plan owns its split workspace (partials and tickets, reused run after
    run): the op's plan cache does not keep it (two eager calls on two streams would race on
    it); a plain plan owns nothing and is kept."""
    from mqnc.triton_kernels.mla.plan import SWEEP_TILES

    fused = [t for tiles in SWEEP_TILES.values() for t in tiles if t.fused]
    if not fused:
        pytest.skip("no fused-combine tile among the sweep candidates")
    q, pool, table, lens = _inputs(0)
    kw = dict(softmax_scale=SCALE, check_inputs=False, num_splits=2)
    plans = mla_decode_partial.op.plans
    plans.clear()
    with forced_tile(fused[0]):
        assert plan_mla_decode(q, pool, table, lens, **kw).owns_workspace
        with _stubbed_runs():
            for _ in range(2):
                mla_decode_partial(q, pool, table, lens, **kw)
    assert (plans.misses, plans.hits, len(plans._plans)) == (2, 0, 0)
    assert not plan_mla_decode(q, pool, table, lens, **kw).owns_workspace


def _stubbed_runs():
    """Plan launches as no-ops (a context manager)."""
    from mqnc.measure.launch_host import stubbed_launches

    return stubbed_launches()


def test_the_eager_path_launches_a_cached_plan_itself_only_in_plain_eager_mode():
    """A cached plan is launched by the public function itself (no dispatcher round trip) in
    plain eager mode, with ``out=`` checked as the ``.out`` overload checks it (shared memory
    refused, the caller's tensors returned); under a torch dispatch mode the call goes through
    the dispatcher (the mode sees ``mqnc.mla_decode_partial``) and gives the same numbers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    kw = dict(softmax_scale=SCALE, check_inputs=False)
    q, pool, table, lens = _inputs(0)
    want = mla_decode_partial(q, pool, table, lens, **kw)  # (planned and cached)
    o, lse = torch.empty_like(want[0]), torch.empty_like(want[1])
    got = mla_decode_partial(q, pool, table, lens, out=(o, lse), **kw)
    assert got[0] is o and got[1] is lse and torch.equal(o, want[0]) and torch.equal(lse, want[1])
    with pytest.raises(ValueError, match=r"out\[0\] \(o\) and q.*share memory"):
        mla_decode_partial(q, pool, table, lens, out=(q[..., :512], lse), **kw)
    with Seen() as seen:
        again = mla_decode_partial(q, pool, table, lens, **kw)
    assert any("mqnc.mla_decode_partial" in op for op in seen.ops), seen.ops
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])
