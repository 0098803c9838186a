"""Compiled inference in the policy server (``ServerConfig.compile``, :mod:`server.compiled`): the knob, the
batch buckets, the background warm-up that never blocks serving, the fallback to eager when compiling or a
compiled batch fails, and compiled chunks equal to eager ones for the same seed.

Most tests inject the compiler (a counting wrapper, one that raises, or ``torch.compile`` with the
``aot_eager`` backend: real graph capture without code generation) so they run in seconds; the one test
that generates code with inductor, as the server does, is slow (a minute of compiling on two cores).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_server import SPEC, make_checkpoint, make_obs, start_server
from tolerances import RECOMPUTED_ATOL, RECOMPUTED_RTOL
from vla_rl_client.policy_client import PolicyClient

from policies.loading import load_policy
from server.compiled import batch_buckets, bucket_for, compile_options
from server.config import ServerConfig
from server.slots import ServedVersion, pad_batch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "a", 0)


def load(ckpt: Path) -> ServedVersion:
    return ServedVersion(load_policy(ckpt, device="cpu"))


def batch(rows: int, seed: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray], list[str], np.ndarray]:
    """``rows`` random observations and their seeds' initial noise."""
    rng = np.random.default_rng(seed)
    obs = [make_obs(rng) for _ in range(rows)]
    noise = [np.random.default_rng(seed + i).standard_normal((4, 3)).astype(np.float32) for i in range(rows)]
    return (
        np.stack([o["state"] for o in obs]),
        {"front": np.stack([o["cameras"]["front"] for o in obs])},
        [SPEC.instruction] * rows,
        np.stack(noise),
    )


def counting_compiler(calls: list[int]) -> Callable[..., Callable[..., Any]]:
    """A stand-in for ``torch.compile``: the function itself, recording each call's row count."""

    def compiler(fn: Callable[..., Any], **_: Any) -> Callable[..., Any]:
        def run(prefix: Any, x_t: torch.Tensor, t: torch.Tensor) -> Any:
            calls.append(x_t.shape[0])
            return fn(prefix, x_t, t)

        return run

    return compiler


def assert_same_chunks(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=RECOMPUTED_RTOL, atol=RECOMPUTED_ATOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RECOMPUTED_RTOL, atol=RECOMPUTED_ATOL)


# ------------------------------------------------------------------------------------------ the knob
def test_the_compile_knob_defaults_off_and_is_validated() -> None:
    assert ServerConfig(checkpoint="x").compile == "off"
    assert ServerConfig.from_dict(ServerConfig(checkpoint="x", compile="on").to_dict()).compile == "on"
    with pytest.raises(ValueError, match=r"compile: expected one of \['off', 'auto', 'on'\], got 'fast'"):
        ServerConfig(checkpoint="x", compile="fast")  # type: ignore[arg-type]


def test_buckets_and_compile_options() -> None:
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(5) == (1, 2, 4, 5)
    assert batch_buckets(1) == (1,)
    assert [bucket_for(n, (1, 2, 4, 5)) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 5, None]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert compile_options("off", cuda) is None
    assert compile_options("auto", cpu) is None  # a CPU serves eager unless told "on"
    assert compile_options("auto", cuda) == {"dynamic": False, "fullgraph": False}
    assert compile_options("on", cpu) == {"dynamic": False, "fullgraph": False}
    assert compile_options("on", cuda) == {"dynamic": False, "fullgraph": False, "mode": "reduce-overhead"}


def test_pad_batch_repeats_the_last_row() -> None:
    states, cams, instr, noise = batch(3)
    s, c, i, n = pad_batch(4, (states, cams, instr, noise))
    assert s.shape == (4, 5) and c["front"].shape == (4, 16, 16, 3) and len(i) == 4 and n.shape == (4, 4, 3)
    np.testing.assert_array_equal(s[3], states[2])
    np.testing.assert_array_equal(n[3], noise[2])
    assert pad_batch(3, (states, cams, instr, noise))[0] is states


# -------------------------------------------------------------------------------- warm-up and dispatch
def test_ready_buckets_run_the_compiled_step_padded_to_their_bucket(ckpt: Path) -> None:
    version, reference, calls = load(ckpt), load(ckpt), []
    compiled = version.start_compiled("on", 4, compiler=counting_compiler(calls))
    assert compiled is not None and compiled.join(60)
    assert compiled.ready == {1, 2, 4} and not compiled.failed
    k = 3  # the checkpoint's denoising steps
    assert calls == [1] * k + [2] * k + [4] * k  # warm-up: one batch per bucket, smallest first
    calls.clear()
    got = version.infer_scored(*batch(3))
    assert calls == [4] * k  # 3 rows padded to the bucket of 4
    assert got[0].shape == (3, 4, 3) and got[1].shape == (3,)
    assert_same_chunks(got, reference.infer_scored(*batch(3)))


def test_eager_serves_while_a_bucket_compiles(ckpt: Path) -> None:
    version, release, calls = load(ckpt), threading.Event(), []
    inner = counting_compiler(calls)

    def slow_compiler(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
        release.wait(30)  # compiling takes until the test says so
        return inner(fn, **kw)

    compiled = version.start_compiled("on", 2, compiler=slow_compiler)
    assert compiled is not None
    want = load(ckpt).infer_scored(*batch(2))
    assert_same_chunks(version.infer_scored(*batch(2)), want)  # answered at once, eager
    assert calls == [] and compiled.ready == set()
    release.set()
    assert compiled.join(60) and compiled.ready == {1, 2}
    assert_same_chunks(version.infer_scored(*batch(2)), want)
    assert calls[-3:] == [2, 2, 2]


def test_off_or_a_cpu_on_auto_compiles_nothing(ckpt: Path) -> None:
    version = load(ckpt)
    assert version.start_compiled("off", 4) is None
    assert version.start_compiled("auto", 4) is None
    assert version.compiled is None


# ------------------------------------------------------------------------------------------- fallback
def test_a_compiler_that_fails_leaves_eager_serving_with_one_warning(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(fn: Callable[..., Any], **_: Any) -> Callable[..., Any]:
        raise RuntimeError("no C++ compiler here\nmore detail")

    version = load(ckpt)
    with caplog.at_level(logging.WARNING, logger="vla_rl.server"):
        compiled = version.start_compiled("on", 4, compiler=broken)
        assert compiled is not None and compiled.join(60)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "compiled inference disabled, serving eager: compiling failed: RuntimeError: no C++ compiler here"
    ]
    assert compiled.ready == set() and compiled.failed
    assert_same_chunks(version.infer_scored(*batch(3)), load(ckpt).infer_scored(*batch(3)))


def test_a_compiled_batch_that_fails_is_rerun_eager_and_compiling_stops(
    ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []
    inner, fail = counting_compiler(calls), threading.Event()

    def flaky(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
        run = inner(fn, **kw)

        def maybe(*args: Any) -> Any:
            if fail.is_set():
                raise RuntimeError("guard failure")
            return run(*args)

        return maybe

    version = load(ckpt)
    compiled = version.start_compiled("on", 2, compiler=flaky)
    assert compiled is not None and compiled.join(60) and compiled.ready == {1, 2}
    fail.set()
    with caplog.at_level(logging.WARNING, logger="vla_rl.server"):
        got = version.infer_scored(*batch(2))
        version.infer_scored(*batch(1))
    assert_same_chunks(got, load(ckpt).infer_scored(*batch(2)))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "compiled inference disabled, serving eager: a compiled batch of 2 failed: RuntimeError: guard failure"
    ]
    assert not compiled.usable(1) and not compiled.usable(2)


def test_a_server_whose_torch_compile_fails_serves_eager(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("inductor is unavailable")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="vla_rl.server"):
        srv = start_server({"arm": ckpt}, compile="on", max_batch=2)
        try:
            compiled = srv.slots["arm"].active.compiled
            assert compiled is not None and compiled.join(60)
            obs = make_obs(np.random.default_rng(0))
            with PolicyClient(srv.address, timeout_s=10, model_id="arm") as client:
                res = client.act({**obs, "instruction": SPEC.instruction}, seed=3)
        finally:
            srv.stop()
    assert res.actions.shape == (4, 3) and np.isfinite(res.actions).all()
    assert compiled.failed == "compiling failed: RuntimeError: inductor is unavailable"
    assert sum("compiled inference disabled" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------------------------------------------------- equivalence
def graph_counting_compiler(runs: list[int]) -> Callable[..., Callable[..., Any]]:
    """``torch.compile`` with a backend that runs dynamo's captured graph as is, recording each run."""

    def backend(gm: torch.fx.GraphModule, _: list[torch.Tensor]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            runs.append(1)
            return gm(*args)

        return run

    return functools.partial(torch.compile, backend=backend)


def test_graph_captured_chunks_equal_eager_ones_and_serving_runs_the_warm_graphs(ckpt: Path) -> None:
    """Real graph capture (dynamo) on a backend that runs the captured graph: the served chunks of every
    bucket equal eager ones for the same seeds, and a serving thread runs the graphs the warm-up built
    (K graph runs per batch). Every later version (a hot swap) warms and serves its own: four versions of
    three buckets are more graphs than dynamo keeps for one code object (8)."""
    reference = load(ckpt)
    for _ in range(4):
        version, runs = load(ckpt), []
        compiled = version.start_compiled("on", 4, compiler=graph_counting_compiler(runs))
        assert compiled is not None and compiled.join(120)
        assert compiled.ready == {1, 2, 4}, compiled.failed
        for rows in (1, 2, 3):
            before = len(runs)
            got = version.infer_scored(*batch(rows, seed=rows))
            assert len(runs) - before == 3  # K = 3 compiled denoising steps, run on this thread
            assert_same_chunks(got, reference.infer_scored(*batch(rows, seed=rows)))


@pytest.mark.slow  # inductor builds C++ for two buckets: over a minute on two shared cores when its disk cache is cold
def test_a_served_chunk_from_the_compiled_path_equals_the_eager_one(ckpt: Path) -> None:
    srv = start_server({"arm": ckpt}, compile="on", max_batch=2)
    reference = load(ckpt)
    rng = np.random.default_rng(7)
    obs = make_obs(rng)
    try:
        compiled = srv.slots["arm"].active.compiled
        assert compiled is not None
        with PolicyClient(srv.address, timeout_s=60, model_id="arm") as client:
            early = client.act({**obs, "instruction": SPEC.instruction}, seed=5)  # served during warm-up
            assert compiled.join(600) and compiled.ready == {1, 2}, compiled.failed
            late = client.act({**obs, "instruction": SPEC.instruction}, seed=5)  # compiled bucket 1
    finally:
        srv.stop()
    noise = reference.initial_noise(5)[None]
    want = reference.infer(
        obs["state"][None], {"front": obs["cameras"]["front"][None]}, [SPEC.instruction], noise
    )
    np.testing.assert_allclose(early.actions, want[0], rtol=RECOMPUTED_RTOL, atol=RECOMPUTED_ATOL)
    np.testing.assert_allclose(late.actions, want[0], rtol=RECOMPUTED_RTOL, atol=RECOMPUTED_ATOL)


def test_rtc_rows_run_the_compiled_step_in_their_padded_bucket(ckpt: Path) -> None:
    """A batch mixing RTC and plain rows runs the warm graph of its bucket (the padding rows plain) and
    gives what eager gives."""
    from server.batching import RTCRequest

    version, reference, calls = load(ckpt), load(ckpt), []
    compiled = version.start_compiled("on", 4, compiler=counting_compiler(calls))
    assert compiled is not None and compiled.join(60)
    calls.clear()
    queued = np.random.default_rng(1).uniform(-0.5, 0.5, (4, 3)).astype(np.float32)
    rtc = [RTCRequest(1, queued), None, RTCRequest(2, queued[:3])]
    got = version.infer_scored(*batch(3), rtc)
    assert calls == [4] * 3  # 3 rows padded to the bucket of 4, three denoising steps
    assert_same_chunks(got, reference.infer_scored(*batch(3), rtc))
    assert not np.allclose(got[0][0], reference.infer_scored(*batch(3))[0][0], atol=1e-3)  # RTC applied
