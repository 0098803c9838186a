"""Policy server on loopback: bad inputs, batching, reproducibility, live swap, auth, backpressure.

Real servers and real gRPC clients on 127.0.0.1; tiny FlowVLA checkpoints built directly (no simulator),
so the whole file runs in well under a minute on two CPU cores. torch runs single-threaded so that the
tests neither fight each other nor distort other work on the machine.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from tolerances import RECOMPUTED_ATOL
from vla_rl_client.codec import encode_image, to_tensor
from vla_rl_client.policy_client import PolicyClient, PolicyError, build_request
from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.spec import CameraSpec, RobotSpec, SpecError

from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy
from policies.flow_vla.uncertainty import accel_score
from policies.loading import load_policy
from server.config import ServerConfig
from server.policy_server import PolicyServer
from server.slots import ServedVersion, initial_noise
from vla_rl.hub.checkpoint import WEIGHTS_FILE, CheckpointInfo, Lineage, load_checkpoint, save_checkpoint

torch.set_num_threads(1)

TOKEN = "server-test-token"
SPEC = RobotSpec("arm", 5, 3, 10.0, "push the cube", cameras=(CameraSpec("front", 16, 16),))
H, A = 4, 3
SC = grpc.StatusCode


def make_checkpoint(folder: Path, seed: int, spec: RobotSpec = SPEC, **model: Any) -> Path:
    """A tiny FlowVLA checkpoint (``model``: more FlowVLAConfig fields)."""
    cfg = FlowVLAConfig.from_robot_spec(
        spec,
        d_model=32,
        n_layers=1,
        expert_n_layers=1,
        n_heads=2,
        instruction_encoder="none",
        chunk_len=H,
        n_exec=2,
        num_inference_steps=3,
        image_encoder_width=8,
        image_encoder_stages=2,
        **model,
    )
    torch.manual_seed(seed)
    policy = FlowVLAPolicy(cfg)
    info = CheckpointInfo("flow_vla", cfg.to_dict(), spec, {}, Lineage("test"))
    save_checkpoint(folder, policy.state_dict(), info)
    return folder


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    out = {"a": make_checkpoint(root / "a", 0), "b": make_checkpoint(root / "b", 1)}
    out["wide"] = make_checkpoint(root / "wide", 2, RobotSpec("arm", 6, 3, 10.0, "push", SPEC.cameras))
    corrupt = root / "corrupt"
    shutil.copytree(out["b"], corrupt)
    weights = corrupt / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # one flipped bit pattern in the tensor data: same size, different hash
    weights.write_bytes(bytes(data))
    out["corrupt"] = corrupt
    return out


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> dict[str, ServedVersion]:
    """The checkpoints loaded in the test process, to compute unbatched expected actions."""
    return {k: ServedVersion(load_policy(ckpts[k], device="cpu")) for k in ("a", "b")}


def expected(version: ServedVersion, obs: dict[str, Any], seed: int) -> np.ndarray:
    cams = {k: v[None] for k, v in obs["cameras"].items()}
    noise = initial_noise(seed, H, A)[None]
    return version.infer(obs["state"][None], cams, [SPEC.instruction], noise)[0]


def make_obs(rng: np.random.Generator) -> dict[str, Any]:
    return {
        "state": rng.normal(size=5).astype(np.float32),
        "cameras": {"front": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)},
    }


def start_server(
    models: dict[str, Path], *, follow: dict[str, str] | None = None, token: str | None = TOKEN, **config: Any
) -> PolicyServer:
    """A started server of ``models`` on a free loopback port (CPU, one torch thread; ``config``: more
    :class:`ServerConfig` fields)."""
    refs = {k: str(v) for k, v in models.items()}
    defaults: dict[str, Any] = {"port": 0, "torch_threads": 1, "device": "cpu"}
    cfg = ServerConfig(checkpoint=next(iter(refs.values())), **(defaults | config))
    return PolicyServer(cfg, models=refs, follow=follow, token=token).start()


@pytest.fixture(scope="module")
def server(ckpts: dict[str, Path]) -> Iterator[PolicyServer]:
    """Two models; a 1 MiB receive limit so the oversized-message check needs no big allocation."""
    srv = start_server(
        {"arm": ckpts["a"], "arm_b": ckpts["b"]},
        max_batch=8,
        max_wait_us=5000,
        max_message_bytes=1024 * 1024,
    )
    yield srv
    srv.stop()


@pytest.fixture
def client(server: PolicyServer) -> Iterator[PolicyClient]:
    with PolicyClient(server.address, token=TOKEN, timeout_s=10, model_id="arm") as c:
        yield c


# ---------------------------------------------------------------------------------------------- basics
def test_act_info_and_health(
    server: PolicyServer, client: PolicyClient, reference: dict[str, ServedVersion]
) -> None:
    obs = make_obs(np.random.default_rng(0))
    r = client.act(obs, seed=7)
    info = client.info()
    assert set(info) == {"arm", "arm_b"}
    assert r.actions.shape == (H, A) and r.actions.dtype == np.float32
    assert r.commit == info["arm"].commit == reference["a"].commit and r.model_id == "arm"
    assert r.seed == 7 and r.n_exec == 2 and r.batch_size >= 1
    t = r.timing
    assert t.total_us >= t.inference_us > 0 and t.decode_us > 0 and t.round_trip_us >= t.total_us
    np.testing.assert_allclose(r.actions, expected(reference["a"], obs, 7), atol=RECOMPUTED_ATOL)
    # the same request again is the same chunk; another model answers with its own commit
    np.testing.assert_allclose(client.act(obs, seed=7).actions, r.actions, atol=RECOMPUTED_ATOL)
    rb = client.act(obs, seed=7, model_id="arm_b")
    assert rb.commit == reference["b"].commit
    np.testing.assert_allclose(rb.actions, expected(reference["b"], obs, 7), atol=RECOMPUTED_ATOL)
    # GetInfo advertises what a robot needs
    m = info["arm"]
    assert RobotSpec.from_json(m.robot_spec_json) == SPEC
    assert (m.chunk_len, m.n_exec, m.control_hz, m.last_load_error) == (H, 2, 10.0, "")
    assert client.health() == "SERVING" and client.health("vla_rl.v1.PolicyService") == "SERVING"
    # no seed: the server draws one and says which, so the chunk can be reproduced
    r2 = client.act(obs)
    np.testing.assert_allclose(r2.actions, client.act(obs, seed=r2.seed).actions, atol=RECOMPUTED_ATOL)
    # explicit noise is the same as the seed that draws it
    rn = client.act(obs, noise=initial_noise(7, H, A))
    np.testing.assert_allclose(rn.actions, r.actions, atol=RECOMPUTED_ATOL)


def test_encoded_images(client: PolicyClient) -> None:
    obs = make_obs(np.random.default_rng(1))
    raw = client.act(obs, seed=3).actions
    for fmt in ("png", "jpeg"):
        req = build_request(obs, model_id="arm", seed=3, image_format=fmt)
        got = client.act_request(req).actions
        if fmt == "png":  # lossless: the same pixels, the same chunk
            np.testing.assert_allclose(got, raw, atol=RECOMPUTED_ATOL)
        assert got.shape == (H, A) and np.isfinite(got).all()


def test_from_tensor_reads_the_bytes_once() -> None:
    """Each access of a protobuf bytes field copies it; the decoder must take one copy, not two."""
    from vla_rl_client.codec import from_tensor

    class Counting:
        def __init__(self, t: pb.Tensor) -> None:
            self.dtype, self.shape, self._data, self.reads = t.dtype, t.shape, t.data, 0

        @property
        def data(self) -> bytes:
            self.reads += 1
            return self._data

    want = np.arange(12, dtype=np.float32).reshape(3, 4)
    msg = Counting(to_tensor(want))
    got = from_tensor(msg, "x", dtype="float32", shape=(3, 4))  # type: ignore[arg-type]
    np.testing.assert_array_equal(got, want)
    assert msg.reads == 1 and not got.flags.writeable
    short = Counting(pb.Tensor(dtype="float32", shape=[3, 4], data=b"\0" * 8))
    with pytest.raises(SpecError, match=r"48 bytes.*8 bytes \(truncated"):
        from_tensor(short, "x")  # type: ignore[arg-type]
    assert short.reads == 1


def test_reflection_lists_the_service(server: PolicyServer) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(server.address) as ch:
        services = ProtoReflectionDescriptorDatabase(ch).get_services()
    assert "vla_rl.v1.PolicyService" in services and "grpc.health.v1.Health" in services


# ---------------------------------------------------------------------------------------------- bad input
def _req(**kw: Any) -> pb.ActRequest:
    obs = make_obs(np.random.default_rng(2))
    obs.update(kw.pop("obs", {}))
    return build_request(obs, model_id=kw.pop("model_id", "arm"), seed=kw.pop("seed", 1), **kw)


def _with(mutate: Callable[[pb.ActRequest], None], **kw: Any) -> pb.ActRequest:
    req = _req(**kw)
    mutate(req)
    return req


def _truncate_state(r: pb.ActRequest) -> None:
    r.observation.state.data = r.observation.state.data[:-3]


def _jpeg_8x8(r: pb.ActRequest) -> None:
    r.observation.cameras["front"].CopyFrom(encode_image(np.zeros((8, 8, 3), np.uint8), "jpeg"))


def _garbage_png(r: pb.ActRequest) -> None:
    r.observation.cameras["front"].CopyFrom(pb.Image(encoding=pb.Image.PNG, encoded=b"\x89PNG not really"))


def _object_dtype(r: pb.ActRequest) -> None:
    r.observation.state.dtype = "object"


def _noise_and_seed(r: pb.ActRequest) -> None:
    r.noise.CopyFrom(to_tensor(np.zeros((H, A), np.float32)))


BAD_INPUTS: list[tuple[str, Callable[[], pb.ActRequest], grpc.StatusCode, list[str]]] = [
    (
        "state dtype",
        lambda: _req(obs={"state": np.zeros(5, np.float64)}),
        SC.INVALID_ARGUMENT,
        ["observation.state", "float32"],
    ),
    (
        "state size",
        lambda: _req(obs={"state": np.zeros(4, np.float32)}),
        SC.INVALID_ARGUMENT,
        ["observation.state", "[5]", "[4]"],
    ),
    (
        "state NaN",
        lambda: _req(obs={"state": np.array([0, np.nan, 0, 0, 0], np.float32)}),
        SC.INVALID_ARGUMENT,
        ["observation.state", "finite"],
    ),
    (
        "state inf",
        lambda: _req(obs={"state": np.array([0, np.inf, 0, 0, 0], np.float32)}),
        SC.INVALID_ARGUMENT,
        ["observation.state", "finite"],
    ),
    (
        "state missing",
        lambda: _with(lambda r: r.observation.ClearField("state")),
        SC.INVALID_ARGUMENT,
        ["observation.state", "missing"],
    ),
    (
        "truncated bytes",
        lambda: _with(_truncate_state),
        SC.INVALID_ARGUMENT,
        ["observation.state", "20 bytes", "truncated"],
    ),
    ("object dtype", lambda: _with(_object_dtype), SC.INVALID_ARGUMENT, ["observation.state", "object"]),
    (
        "missing camera",
        lambda: _req(obs={"cameras": {}}),
        SC.INVALID_ARGUMENT,
        ["observation.cameras.front", "missing"],
    ),
    (
        "unknown camera",
        lambda: _req(
            obs={
                "cameras": {
                    "front": np.zeros((16, 16, 3), np.uint8),
                    "wrist": np.zeros((16, 16, 3), np.uint8),
                }
            }
        ),
        SC.INVALID_ARGUMENT,
        ["observation.cameras.wrist", "front"],
    ),
    (
        "image shape",
        lambda: _req(obs={"cameras": {"front": np.zeros((16, 12, 3), np.uint8)}}),
        SC.INVALID_ARGUMENT,
        ["observation.cameras.front", "[16, 16, 3]"],
    ),
    (
        "image dtype",
        lambda: _req(obs={"cameras": {"front": np.zeros((16, 16, 3), np.float32)}}),
        SC.INVALID_ARGUMENT,
        ["observation.cameras.front", "uint8"],
    ),
    (
        "jpeg dims",
        lambda: _with(_jpeg_8x8),
        SC.INVALID_ARGUMENT,
        ["observation.cameras.front", "16x16", "8x8"],
    ),
    ("png garbage", lambda: _with(_garbage_png), SC.INVALID_ARGUMENT, ["observation.cameras.front", "PNG"]),
    (
        "noise NaN",
        lambda: _req(seed=None, noise=np.full((H, A), np.nan, np.float32)),
        SC.INVALID_ARGUMENT,
        ["noise", "finite"],
    ),
    (
        "noise shape",
        lambda: _req(seed=None, noise=np.zeros((H + 1, A), np.float32)),
        SC.INVALID_ARGUMENT,
        ["noise", "[4, 3]"],
    ),
    ("noise and seed", lambda: _with(_noise_and_seed), SC.INVALID_ARGUMENT, ["noise", "seed"]),
    ("unknown model", lambda: _req(model_id="nope"), SC.NOT_FOUND, ["model_id", "arm_b", "nope"]),
    ("ambiguous model", lambda: _req(model_id=""), SC.INVALID_ARGUMENT, ["model_id", "several"]),
    # grpc's own limit answers oversized messages before any of our code runs
    (
        "oversized message",
        lambda: _with(lambda r: setattr(r, "request_id", "x" * (2 * 1024 * 1024))),
        SC.RESOURCE_EXHAUSTED,
        ["larger than max"],
    ),
]


@pytest.mark.parametrize(("name", "make", "code", "words"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_and_server_keeps_serving(
    client: PolicyClient,
    name: str,
    make: Callable[[], pb.ActRequest],
    code: grpc.StatusCode,
    words: list[str],
) -> None:
    with pytest.raises(PolicyError) as err:
        client.act_request(make())
    assert err.value.code == code, err.value
    for w in words:
        assert w in err.value.message, (w, err.value.message)
    assert client.health() == "SERVING"
    assert client.act(make_obs(np.random.default_rng(3)), seed=1).actions.shape == (H, A)


def test_stream_survives_a_bad_request(client: PolicyClient, reference: dict[str, ServedVersion]) -> None:
    obs = make_obs(np.random.default_rng(4))
    with client.stream() as s:
        first = s.act(obs, seed=5)
        with pytest.raises(PolicyError) as err:
            s.act({**obs, "state": np.zeros(3, np.float32)}, seed=5)
        assert err.value.code == SC.INVALID_ARGUMENT and "observation.state" in err.value.message
        again = s.act(obs, seed=5)
    np.testing.assert_allclose(first.actions, expected(reference["a"], obs, 5), atol=RECOMPUTED_ATOL)
    np.testing.assert_allclose(again.actions, first.actions, atol=RECOMPUTED_ATOL)


# ---------------------------------------------------------------------------------------------- batching
def test_batching_batches_and_matches_unbatched(
    server: PolicyServer, reference: dict[str, ServedVersion]
) -> None:
    rng = np.random.default_rng(5)
    work = [(make_obs(rng), int(rng.integers(1 << 31))) for _ in range(8 * 6)]
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def robot(k: int) -> None:
        with PolicyClient(server.address, timeout_s=30, model_id="arm") as c:
            barrier.wait()
            for i in range(k, len(work), 8):
                try:
                    results[i] = c.act(work[i][0], seed=work[i][1])
                except BaseException as e:
                    errors.append(e)

    threads = [threading.Thread(target=robot, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == len(work)
    sizes = [r.batch_size for r in results.values()]
    assert max(sizes) > 1, sizes
    for i, (obs, seed) in enumerate(work):  # batched results == unbatched ones, row by row
        np.testing.assert_allclose(
            results[i].actions, expected(reference["a"], obs, seed), atol=RECOMPUTED_ATOL
        )
    with PolicyClient(server.address, timeout_s=10, model_id="arm") as c:
        for i in range(4):  # ...and == the server's own answers to one request at a time
            single = c.act(work[i][0], seed=work[i][1])
            np.testing.assert_allclose(results[i].actions, single.actions, atol=RECOMPUTED_ATOL)


# ---------------------------------------------------------------------------------------------- uncertainty
def local_accel(version: ServedVersion, obs: dict[str, Any], seed: int) -> float:
    """The `accel` score of the same seed and observation, computed here from the policy's own sampler."""
    loaded = version.model.loaded  # type: ignore[attr-defined]
    policy = loaded.policy
    batch = {
        "state": torch.from_numpy(obs["state"][None]),
        "cameras": {k: torch.from_numpy(v[None]) for k, v in obs["cameras"].items()},
        "instruction": [SPEC.instruction],
    }
    noise = torch.from_numpy(initial_noise(seed, H, A))[None, None]
    with torch.no_grad():
        s = policy.sample(batch, num_steps=loaded.num_steps, noise=noise, return_iterates=True)
    with torch.no_grad():  # keeping the iterates changes nothing: the served chunk is predict_action_chunk's
        chunk = policy.predict_action_chunk(batch, num_steps=loaded.num_steps, noise=noise[:, 0])
    np.testing.assert_array_equal(expected(version, obs, seed), chunk[0].numpy())
    return float(accel_score(s.iterates[:, 0], n_exec=policy.config.n_exec).item())


def test_a_recap_checkpoint_is_served_with_its_guidance(tmp_path: Path) -> None:
    """An advantage-conditioned (RECAP) checkpoint saved with guidance scale 2 is served guided: the server
    hands the policy observations naming no advantage, and the policy applies classifier-free guidance
    between its unconditioned and positive prefixes (= its own predict_action_chunk); not the positive
    prompt alone."""
    cfg = dict(load_checkpoint(make_checkpoint(tmp_path / "base", 3))[0].model_config)
    cfg |= {"advantage_conditioning": True, "guidance_scale": 2.0}
    torch.manual_seed(3)
    policy = FlowVLAPolicy(FlowVLAConfig.from_dict(cfg))
    with torch.no_grad():  # a trained embedding: the conditioned and unconditioned prefixes differ
        policy.advantage_embedding.weight.normal_()
    save_checkpoint(
        tmp_path / "recap", policy.state_dict(), CheckpointInfo("flow_vla", cfg, SPEC, {}, Lineage("recap"))
    )
    obs, seed = make_obs(np.random.default_rng(7)), 5
    srv = start_server({"recap": tmp_path / "recap"})
    try:
        with PolicyClient(srv.address, timeout_s=30) as c:
            r = c.act(obs, seed=seed)
    finally:
        srv.stop()
    batch = {
        "state": torch.from_numpy(obs["state"][None]),
        "cameras": {k: torch.from_numpy(v[None]) for k, v in obs["cameras"].items()},
        "instruction": [SPEC.instruction],
    }
    noise = torch.from_numpy(initial_noise(seed, H, A))[None]
    policy.eval()
    with torch.no_grad():
        guided = policy.predict_action_chunk(batch, noise=noise)[0].numpy()
        positive = policy.predict_action_chunk(batch | {"advantage": torch.tensor([2])}, noise=noise)[
            0
        ].numpy()
    np.testing.assert_allclose(r.actions, guided, atol=RECOMPUTED_ATOL)
    assert not np.allclose(guided, positive, atol=1e-3), "guidance must change the chunk"
    assert r.uncertainty_kind == "accel" and np.isfinite(r.uncertainty)


def test_a_one_step_checkpoint_is_served_without_an_uncertainty(tmp_path: Path) -> None:
    """accel needs at least two denoising steps: a K = 1 head (what FQL saves) answers every request, with
    no uncertainty (NaN, kind ""), instead of failing each one."""
    folder = make_checkpoint(tmp_path / "one", 3)
    info, weights = load_checkpoint(folder)
    cfg = dict(info.model_config, num_inference_steps=1)
    save_checkpoint(folder, weights, dataclasses.replace(info, model_config=cfg))
    srv = start_server({"one": folder})
    try:
        with PolicyClient(srv.address, timeout_s=30) as c:
            r = c.act(make_obs(np.random.default_rng(0)), seed=1)
    finally:
        srv.stop()
    assert r.actions.shape == (H, A) and np.isfinite(r.actions).all()
    assert np.isnan(r.uncertainty) and r.uncertainty_kind == ""


def test_uncertainty_rides_with_every_chunk(
    server: PolicyServer, client: PolicyClient, reference: dict[str, ServedVersion]
) -> None:
    rng = np.random.default_rng(21)
    work = [(make_obs(rng), int(rng.integers(1 << 31))) for _ in range(12)]
    want = [local_accel(reference["a"], o, seed) for o, seed in work]
    assert len({round(w, 6) for w in want}) == len(want), "the score must depend on the observation and seed"
    unary = client.act(work[0][0], seed=work[0][1])
    assert unary.uncertainty_kind == "accel"
    np.testing.assert_allclose(unary.uncertainty, want[0], atol=RECOMPUTED_ATOL)
    with client.stream() as st:
        streamed = [st.act(o, seed=seed) for o, seed in work[:3]]
    for r, w in zip(streamed, want, strict=False):
        assert r.uncertainty_kind == "accel"
        np.testing.assert_allclose(r.uncertainty, w, atol=RECOMPUTED_ATOL)
    # batched with other robots' requests: each row's score is its own chunk's
    results: dict[int, Any] = {}
    barrier = threading.Barrier(4)

    def robot(k: int) -> None:
        with PolicyClient(server.address, timeout_s=30, model_id="arm") as c:
            barrier.wait()
            for i in range(k, len(work), 4):
                results[i] = c.act(work[i][0], seed=work[i][1])

    threads = [threading.Thread(target=robot, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == len(work) and max(r.batch_size for r in results.values()) > 1
    for i, w in enumerate(want):
        np.testing.assert_allclose(results[i].uncertainty, w, atol=RECOMPUTED_ATOL)


def test_uncertainty_is_absent_for_models_that_cannot_score(
    server: PolicyServer, client: PolicyClient, reference: dict[str, ServedVersion]
) -> None:
    """A model without ``infer_scored`` (LeRobot policies) replies with the field unset: NaN, kind ""."""
    from vla_rl_client.proto import policy_service_pb2_grpc as pb_grpc

    slot = server.slots["arm"]
    real = slot.active.model

    class Unscored:  # the ServedModel protocol without infer_scored, as LeRobotModel
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            if name in ("infer_scored", "uncertainty_kind"):
                raise AttributeError(name)
            return getattr(self._inner, name)

    obs = make_obs(np.random.default_rng(22))
    slot.active.model = Unscored(real)  # type: ignore[assignment]
    try:
        r = client.act(obs, seed=3)
        channel = grpc.insecure_channel(server.address)
        raw = pb_grpc.PolicyServiceStub(channel).Act(build_request(obs, model_id="arm", seed=3), timeout=10)
        channel.close()
    finally:
        slot.active.model = real
    assert np.isnan(r.uncertainty) and r.uncertainty_kind == ""
    assert not raw.HasField("uncertainty") and raw.uncertainty_kind == ""
    np.testing.assert_allclose(r.actions, expected(reference["a"], obs, 3), atol=RECOMPUTED_ATOL)
    assert client.act(obs, seed=3).uncertainty_kind == "accel"


# ---------------------------------------------------------------------------------------------- swap
def test_swap_under_load(ckpts: dict[str, Path], reference: dict[str, ServedVersion]) -> None:
    srv = start_server({"arm": ckpts["a"]}, max_batch=8, max_wait_us=2000)
    old, new = reference["a"].commit, reference["b"].commit
    log: list[list[tuple[float, dict[str, Any], int, Any]]] = [[] for _ in range(8)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def robot(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        with PolicyClient(srv.address, timeout_s=30) as c:
            while not stop.is_set():
                obs, seed = make_obs(rng), int(rng.integers(1 << 31))
                sent = time.monotonic()
                try:
                    log[k].append((sent, obs, seed, c.act(obs, seed=seed)))
                except BaseException as e:
                    errors.append(e)

    threads = [threading.Thread(target=robot, args=(k,)) for k in range(8)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        with PolicyClient(srv.address, token=TOKEN, timeout_s=60) as ctl:
            resp = ctl.load_checkpoint(str(ckpts["b"]))
            swapped = time.monotonic()
            assert (resp.commit, resp.previous_commit, resp.serving) == (new, old, True)
            time.sleep(0.5)
            stop.set()
            for t in threads:
                t.join(30)
            assert not errors, errors[:3]
            entries = [e for per in log for e in per]
            commits = [e[3].commit for e in entries]
            assert set(commits) == {old, new}, "the load must have run while robots were being served"
            for per in log:  # per robot: old ... old new ... new, never back
                cs = [e[3].commit for e in per]
                assert cs == sorted(cs, key=lambda c: c == new)
            for sent, obs, seed, res in entries:
                if sent > swapped:
                    assert res.commit == new
                version = reference["a"] if res.commit == old else reference["b"]
                np.testing.assert_allclose(res.actions, expected(version, obs, seed), atol=RECOMPUTED_ATOL)
            # rollback: instant, to the version kept in memory
            rb = ctl.rollback()
            assert (rb.commit, rb.previous_commit) == (old, new)
            obs = make_obs(np.random.default_rng(9))
            r = ctl.act(obs, seed=2)
            assert r.commit == old
            np.testing.assert_allclose(r.actions, expected(reference["a"], obs, 2), atol=RECOMPUTED_ATOL)
    finally:
        stop.set()
        srv.stop()


def test_bad_checkpoints_are_refused_and_old_keeps_serving(
    ckpts: dict[str, Path], reference: dict[str, ServedVersion]
) -> None:
    srv = start_server({"arm": ckpts["a"]})
    old = reference["a"].commit
    try:
        with PolicyClient(srv.address, token=TOKEN, timeout_s=60) as c:
            obs = make_obs(np.random.default_rng(10))
            with pytest.raises(PolicyError) as err:
                c.load_checkpoint(str(ckpts["corrupt"]))
            assert err.value.code == SC.FAILED_PRECONDITION and "hash check" in err.value.message
            info = c.info()["arm"]
            assert info.commit == old and "hash check" in info.last_load_error
            assert c.act(obs, seed=1).commit == old
            with pytest.raises(PolicyError) as err:
                c.load_checkpoint(str(ckpts["wide"]))
            assert err.value.code == SC.FAILED_PRECONDITION and "state_dim 5 -> 6" in err.value.message
            assert "state_dim" in c.info()["arm"].last_load_error
            with pytest.raises(PolicyError) as err:
                c.load_checkpoint(str(ckpts["a"].parent / "does-not-exist"))
            assert err.value.code == SC.INVALID_ARGUMENT and "ref" in err.value.message
            assert c.act(obs, seed=1).commit == old and c.health() == "SERVING"
            # staging: checked and warm, but serving only after Promote; a good load clears the error
            staged = c.load_checkpoint(str(ckpts["b"]), stage_only=True)
            assert not staged.serving and staged.commit == reference["b"].commit
            info = c.info()["arm"]
            assert (info.commit, info.staged_commit, info.last_load_error) == (old, staged.commit, "")
            assert c.act(obs, seed=1).commit == old
            assert c.promote().commit == staged.commit
            assert c.act(obs, seed=1).commit == staged.commit
            # another model id starts being hosted next to the first
            added = c.load_checkpoint(str(ckpts["wide"]), model_id="wide")
            assert set(c.info()) == {"arm", "wide"} and added.serving
    finally:
        srv.stop()


def test_control_calls_need_the_token(server: PolicyServer, ckpts: dict[str, Path]) -> None:
    for token in (None, "wrong-token"):
        with PolicyClient(server.address, token=token, timeout_s=10, model_id="arm") as c:
            for call in (lambda c=c: c.load_checkpoint(str(ckpts["b"])), c.rollback, c.promote):
                with pytest.raises(PolicyError) as err:
                    call()
                assert err.value.code == SC.UNAUTHENTICATED
            assert c.info()["arm"].commit  # reads need no token
    with PolicyClient(server.address, token=TOKEN, timeout_s=10, model_id="arm") as c:
        with pytest.raises(PolicyError) as err:
            c.rollback()  # authenticated, but nothing to roll back to
        assert err.value.code == SC.FAILED_PRECONDITION


def test_follow_a_moving_ref(
    ckpts: dict[str, Path], tmp_path: Path, reference: dict[str, ServedVersion]
) -> None:
    """A followed local folder stands in for ``hub://org/name@prod``: resolve() changes, the server swaps."""
    from vla_rl.hub.registry import resolve

    live = tmp_path / "prod"
    shutil.copytree(ckpts["a"], live)
    srv = start_server({"arm": live}, follow={"arm": str(live)}, follow_interval=0.1)
    try:
        with PolicyClient(srv.address, timeout_s=10) as c:
            first = c.info()["arm"].commit
            assert c.info()["arm"].followed_ref == str(live)
            for name in (WEIGHTS_FILE, "README.md", "config.json"):  # as a sync tool would, config last
                shutil.copy2(ckpts["b"] / name, live / name)
            want = resolve(str(live))
            deadline = time.monotonic() + 20
            while c.info()["arm"].commit != want and time.monotonic() < deadline:
                time.sleep(0.1)
            assert first != want and c.info()["arm"].commit == want
            obs = make_obs(np.random.default_rng(11))
            r = c.act(obs, seed=4)
            assert r.commit == want
            np.testing.assert_allclose(r.actions, expected(reference["b"], obs, 4), atol=RECOMPUTED_ATOL)
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------- backpressure
def test_queue_full_and_expired_requests(ckpts: dict[str, Path]) -> None:
    srv = start_server({"arm": ckpts["a"]}, max_batch=1, max_wait_us=0, max_queue=1)
    slot = srv.slots["arm"]
    fast_infer = slot.active.infer_scored  # what the batcher calls

    started, release = threading.Event(), threading.Event()

    def slow_infer(*args: Any, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
        started.set()
        release.wait(10)  # held until the test has filled the queue (no sleeps to order the requests)
        return fast_infer(*args, **kw)

    def wait_for(cond: Callable[[], bool]) -> None:
        end = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < end, "the server never reached the state the test waits for"
            time.sleep(0.01)

    slot.active.infer_scored = slow_infer  # type: ignore[method-assign]
    obs = make_obs(np.random.default_rng(12))
    outcomes: list[Any] = []

    def background() -> threading.Thread:
        def run() -> None:
            with PolicyClient(srv.address, timeout_s=10) as c:
                try:
                    outcomes.append(c.act(obs, seed=1))
                except PolicyError as e:
                    outcomes.append(e)

        t = threading.Thread(target=run)
        t.start()
        return t

    try:
        with PolicyClient(srv.address, timeout_s=10) as c:
            t1 = background()  # in inference, held
            assert started.wait(10)
            t2 = background()  # waits in the queue (max_queue=1)
            wait_for(lambda: slot.queued() == 1)
            with pytest.raises(PolicyError) as err:
                c.act(obs, seed=1)
            assert err.value.code == SC.RESOURCE_EXHAUSTED and "queue full" in err.value.message
            release.set()
            t1.join(10)
            t2.join(10)
            assert all(not isinstance(o, PolicyError) for o in outcomes) and len(outcomes) == 2
            # a request whose budget runs out while it waits is dropped before inference
            started.clear(), release.clear()
            t3 = background()  # in inference, held until 0.3 s after the next request was sent
            assert started.wait(10)
            threading.Timer(0.3, release.set).start()
            with c.stream() as s:
                with pytest.raises(PolicyError) as err:
                    s.act(obs, seed=1, timeout_s=0.1)
                assert err.value.code == SC.DEADLINE_EXCEEDED and "before inference" in err.value.message
            t3.join(10)
            info = c.info()["arm"]
            assert info.dropped_expired == 1 and info.rejected_full == 1 and info.served == 3
            assert c.health() == "SERVING"
    finally:
        srv.stop()


def test_cli_serve_and_client_act(tmp_path: Path, cli_server: Callable[..., str]) -> None:
    """`vla-rl serve` in its own process, `vla-rl client act` against it with a real simulator observation."""
    import subprocess
    import sys

    from sim.registry import TASKS

    info = TASKS["maniskill/PushCube-v1"]
    spec = RobotSpec(info.name, info.state_dim["state"], info.action_dim, info.control_hz, info.instruction)
    folder = make_checkpoint(tmp_path / "push", seed=3, spec=spec)
    address = cli_server("--checkpoint", str(folder), "--device", "cpu")
    out = subprocess.run(
        [sys.executable, "-m", "vla_rl.cli", "client", "act", "--server", address, "--seed", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "chunk [" in out.stdout and "commit local:" in out.stdout and "inference" in out.stdout
