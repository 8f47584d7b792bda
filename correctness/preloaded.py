"""Run Python snippets as ``python -c`` would, each in a child forked from one interpreter that
has imported the heavy modules once (a test helper, not a test file).

Starting a Python that imports torch costs ~1.7 s of a CPU, Triton and the kernels ~0.7 s more,
and the first compile hashes Triton's own sources (~1 s): paid once per snippet by
``subprocess.run([sys.executable, "-c", code])``, once per :class:`Preloaded` here. Each snippet
still runs alone in a new process (``os.fork`` of the preloaded interpreter, which runs nothing
else): ``__name__ == "__main__"`` in a new ``__main__`` module, ``sys.argv == ["-c"]``, its own
working directory, stdin from ``/dev/null``, its stdout and stderr captured, its exit status
(``sys.exit`` and an uncaught exception as ``python -c`` reports them). What differs from a new
interpreter is only that the preloaded modules are already in ``sys.modules``, imported under
the environment the interpreter was started with: preload only what every snippet imports the
same way (``test_compile_sm90``: torch, Triton and the kernels in compiled mode; ``test_docs``:
torch).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile

_SERVER = r"""
import json, os, sys, traceback, types
exec(sys.argv[1])
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(req["stdout"], os.O_WRONLY), 1)
        os.dup2(os.open(req["stderr"], os.O_WRONLY), 2)
        os.chdir(req["cwd"])
        sys.argv = ["-c"]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        status = 0
        try:
            exec(compile(req["code"], "<string>", "exec"), main.__dict__)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, st = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(st)), flush=True)
"""


class Preloaded:
    """One interpreter that ran ``preload`` (Python source: the imports) under ``env``, forking a
    child per :meth:`run`. Started at the first run (and again if it died); :meth:`close` ends
    it."""

    def __init__(self, preload: str, env: dict[str, str] | None = None):
        self.preload = preload
        self.env = dict(os.environ if env is None else env)
        self._proc: subprocess.Popen | None = None

    def _server(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, self.preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=self.env,
                start_new_session=True,  # killpg on a timeout takes the child with it
            )
        return self._proc

    def run(self, code: str, *, timeout: float, cwd=None) -> subprocess.CompletedProcess:
        """``code`` run as ``python -c code`` in ``cwd`` (default: this process's) would run it;
        past ``timeout`` seconds the interpreter and the child are killed and
        ``subprocess.TimeoutExpired`` raised."""
        server = self._server()
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            for path in (out, err):
                open(path, "w").close()
            req = dict(code=code, cwd=str(cwd or os.getcwd()), stdout=out, stderr=err)
            try:
                server.stdin.write(json.dumps(req) + "\n")
                server.stdin.flush()
            except BrokenPipeError:  # it died before reading (its preload failed)
                raise RuntimeError(f"the preloaded interpreter exited {server.wait()}") from None
            if not select.select([server.stdout], [], [], timeout)[0]:
                self.close(kill=True)
                raise subprocess.TimeoutExpired(["python", "-c", code[:60]], timeout)
            reply = server.stdout.readline()
            with open(out) as f_out, open(err) as f_err:
                stdout, stderr = f_out.read(), f_err.read()
        if not reply:  # the interpreter itself died (its preload failed, or it was killed)
            raise RuntimeError(f"the preloaded interpreter exited {server.wait()}: {stderr}")
        return subprocess.CompletedProcess(
            ["python", "-c", code], json.loads(reply), stdout, stderr
        )

    def close(self, kill: bool = False) -> None:
        """End the interpreter (``kill``: at once, with a child it runs)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill or proc.poll() is not None:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.stdin.close()
        proc.wait(timeout=60)


# What a compile script imports (``test_compile_sm90``, the kernel report's tests): torch, Triton
# and the kernels in compiled mode, and Triton's source hash (the cache key's, ~1 s) computed.
COMPILED_PRELOAD = """
import torch, triton
import mqnc.triton_kernels.sm90.compile
try:
    from triton.runtime.cache import triton_key
    triton_key()
except Exception:
    pass
"""


def compiled_mode() -> Preloaded:
    """A :class:`Preloaded` of :data:`COMPILED_PRELOAD` under this environment in compiled mode
    (``TRITON_INTERPRET=0``: the kernels compile, nothing launches; ``TRITON_DEFAULT_FP_FUSION``
    as the package's compiles set it), so a kernel compiled here has the cache key it has in
    ``python -m mqnc.triton_kernels.sm90.compile``."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return Preloaded(COMPILED_PRELOAD, env)


# ``python -m {module} *argv`` as the code of a ``python -c`` (for :meth:`Preloaded.run`)
RUN_MODULE = """
import runpy, sys
sys.argv = [{module!r}, *{argv!r}]
runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
"""


def run_module(preloaded: Preloaded, module: str, *args: str, timeout: float, cwd=None):
    """``python -m module *args`` run in a child of ``preloaded`` (``runpy``, as ``-m`` runs it:
    ``__main__``, ``sys.argv[0]`` the module's file)."""
    code = RUN_MODULE.format(module=module, argv=list(args))
    return preloaded.run(code, timeout=timeout, cwd=cwd)
