"""Compiled inference for a served flow policy: the denoising step (``velocity``) under ``torch.compile``,
one static-shape graph per batch bucket, warmed up on a background thread, with eager as the fallback.

A flow policy's ``sample`` calls its ``velocity(prefix, x_t, t)`` K times per batch: that step is the
unit compiled here (tensors only, so no guard depends on an instruction string; ``t`` is a tensor, so the
K steps share one graph). Shapes are static (``dynamic=False``): a batch of n rows is padded up to its
bucket (the smallest of :func:`batch_buckets` >= n, rows repeated) so every batch of a bucket reuses
that bucket's graph, and the padding rows are dropped from the result (rows never depend on each other).
The prefix pass stays eager: it takes the instruction strings and decodes images.

:class:`CompiledVelocity` shadows the policy's ``velocity`` with a dispatcher that runs the compiled step
only on a thread that asked for it (:meth:`CompiledVelocity.active`): the warm-up compiling a bucket and
the batcher running a ready one. Everything else (the batcher on a bucket not yet ready, training code
holding the same object) runs the original method. A bucket is ready once its warm-up batch ran
compiled; serving never waits for it. Any exception while compiling or running compiled code disables
compilation for this version, with one warning naming the reason, and the batch is rerun eager.

Threads: every compilation in the process runs on one long-lived worker thread (:func:`compile_worker`),
and serving threads run the compiled step in dynamo's run-only mode (``torch._dynamo.run``: the warm
graphs are used, a cache miss runs eager and never compiles). Dynamo compiling on a thread after another
thread that compiled has exited crashes the process (a segmentation fault in torch 2.11), and batcher
threads exit whenever a server stops.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from server.config import CompileMode

log = logging.getLogger("vla_rl.server")


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes compiled graphs exist for: powers of two below ``max_batch``, then ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``n`` rows, or None when ``n`` exceeds every bucket."""
    return next((b for b in buckets if b >= n), None)


def compile_options(mode: CompileMode, device: torch.device) -> dict[str, Any] | None:
    """``torch.compile`` keyword arguments for ``mode`` on ``device``; None = serve eager.

    ``"auto"`` compiles on CUDA only (on a CPU the compiled step is not reliably faster, and compiling
    costs minutes of the cores that serve); ``"on"`` compiles on any device and, on CUDA, also captures
    CUDA graphs (``mode="reduce-overhead"``: the step's kernel launches replayed as one graph; that path
    is not exercised by the CPU test-suite).
    """
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    opts: dict[str, Any] = {"dynamic": False, "fullgraph": False}
    if mode == "on" and device.type == "cuda":
        opts["mode"] = "reduce-overhead"
    return opts


_worker: concurrent.futures.ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def compile_worker() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread every warm-up compiles on, started on first use and kept for the process's life
    (never shut down: see the module docstring); warm-ups of several versions queue on it."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-warm-up")
        return _worker


def velocity_owner(policy: Any) -> Any | None:
    """The object whose ``velocity`` method the policy's ``sample`` calls (FlowVLA behind the contract:
    the wrapped model; a policy that samples through its own ``velocity``: itself), or None."""
    inner = getattr(policy, "model", None)
    for owner in (inner, policy):
        if owner is not None and callable(getattr(owner, "velocity", None)):
            return owner
    return None


def own_step(eager: Callable[..., Any]) -> Callable[..., Any]:
    """``eager(prefix, x_t, t)`` behind a function with a code object of its own, the one to compile.

    Dynamo keeps compiled graphs per code object, at most ``recompile_limit`` (8) of them: compiling the
    policy's ``velocity`` itself would pile every loaded version's buckets onto that method's one code
    object, and after a swap or two new versions would silently run eager. A fresh code object per
    version gives each its own cache, bounded by its buckets, freed with the version.
    """

    def step(prefix: Any, x_t: torch.Tensor, t: torch.Tensor) -> Any:
        return eager(prefix, x_t, t)

    code = step.__code__.replace()  # a copy: a new identity, so a new dynamo cache
    return types.FunctionType(code, step.__globals__, step.__name__, None, step.__closure__)


class CompiledVelocity:
    """The compiled denoising step of one served policy, per batch bucket (see the module docstring)."""

    def __init__(
        self,
        owner: Any,
        buckets: tuple[int, ...],
        options: dict[str, Any],
        compiler: Callable[..., Callable[..., Any]] | None = None,
    ) -> None:
        self.owner, self.buckets, self.options = owner, buckets, options
        self.eager: Callable[..., Any] = owner.velocity  # the bound method, before shadowing
        self.ready: set[int] = set()
        self.failed = ""  # why compilation was abandoned ("" = not abandoned)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._compiled: Callable[..., Any] | None = None
        self._compiler = compiler if compiler is not None else torch.compile
        self._run_only: Callable[..., Any] | None = None
        self._done: concurrent.futures.Future[None] | None = None
        object.__setattr__(owner, "velocity", self._dispatch)

    # -- dispatch
    def _dispatch(self, prefix: Any, x_t: torch.Tensor, t: torch.Tensor | float, **kwargs: Any) -> Any:
        """The shadowed ``velocity``: compiled on a thread inside :meth:`active` (plain calls only)."""
        how = getattr(self._local, "how", "")
        fn = self._compiled if how == "compile" else self._run_only if how == "run" else None
        if kwargs or fn is None:
            return self.eager(prefix, x_t, t, **kwargs)
        return fn(prefix, x_t, torch.as_tensor(t, device=x_t.device, dtype=x_t.dtype))

    def active(self, *, compiling: bool = False) -> _Active:
        """Within it, this thread's ``velocity`` calls run the compiled step: its warm graphs only (a
        shape or guard they do not cover runs eager), or, with ``compiling``, compiling what is missing
        (the warm-up worker only)."""
        return _Active(self._local, "compile" if compiling else "run")

    def usable(self, bucket: int | None) -> bool:
        """Whether a batch padded to ``bucket`` can run compiled now (its graph is warm, nothing failed)."""
        return not self.failed and bucket in self.ready

    def disable(self, reason: str) -> None:
        """Serve eager from now on, with one warning naming ``reason`` (later calls change nothing)."""
        with self._lock:
            if self.failed:
                return
            self.failed = reason
            self.ready.clear()
        log.warning("compiled inference disabled, serving eager: %s", reason)

    # -- warm-up
    def start_warm_up(self, run_bucket: Callable[[int], object]) -> None:
        """Compile every bucket, smallest first, on :func:`compile_worker`: ``run_bucket(b)`` runs one
        batch of ``b`` rows inside ``active(compiling=True)``; a bucket is ready once it returned."""
        self._done = compile_worker().submit(self._warm_up, run_bucket)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up; True when it has finished (or never started)."""
        if self._done is None:
            return True
        try:
            self._done.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        return True

    def _warm_up(self, run_bucket: Callable[[int], object]) -> None:
        try:
            self._compiled = self._compiler(own_step(self.eager), **self.options)
            self._run_only = torch._dynamo.run(self._compiled)
            for b in self.buckets:
                if self.failed:
                    return
                with self.active(compiling=True):
                    run_bucket(b)
                with self._lock:
                    if not self.failed:
                        self.ready.add(b)
                log.info("compiled inference ready for batch bucket %d", b)
        except Exception as e:  # any compiler error means: serve eager
            self.disable(f"compiling failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


class _Active:
    """Context manager: the current thread's ``velocity`` calls run compiled (``how``) while inside."""

    def __init__(self, local: threading.local, how: str) -> None:
        self.local, self.how = local, how

    def __enter__(self) -> None:
        self.local.how = self.how

    def __exit__(self, *exc: object) -> None:
        self.local.how = ""
