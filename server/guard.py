"""What a request may be: an ``ActRequest`` decoded into a :class:`~server.batching._Pending` with every
check on the way (sizes, values, the robot spec, seed or noise, the deadline), the request size a robot
spec needs (:func:`request_bytes_for`), and how many requests one connection may have in flight
(:class:`PeerSlots`). Each refusal is a :class:`SpecError` naming the field."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator

import numpy as np
from vla_rl_client.codec import decode_image, from_tensor
from vla_rl_client.proto import policy_service_pb2 as pb
from vla_rl_client.spec import RobotSpec, SpecError

from server.batching import RTCRequest, _Pending
from server.config import MESSAGE_SLACK_BYTES, ServerConfig
from server.slots import ServedVersion

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # only an upper bound now: the default is derived from the spec
MIN_DERIVED_MESSAGE_BYTES = 1024 * 1024  # headroom for a later checkpoint with a slightly larger spec
MAX_INSTRUCTION_CHARS = 2000
MAX_REQUEST_ID_CHARS = 200


def request_bytes_for(spec: RobotSpec, noise_shape: tuple[int, int] | None) -> int:
    """The largest ActRequest a robot with ``spec`` needs to send: every camera raw (or encoded, up to 2x
    raw for incompressible JPEG/PNG), the state, explicit noise, RTC's queued actions (a chunk of them),
    plus :data:`~server.config.MESSAGE_SLACK_BYTES` (ids, instruction, framing)."""
    pixels = sum(c.height * c.width * 3 for c in spec.cameras)
    noise = 4 * noise_shape[0] * noise_shape[1] if noise_shape else 0
    queued = 4 * noise_shape[0] * spec.action_dim if noise_shape else 0
    return 2 * pixels + 4 * spec.state_dim + noise + queued + MESSAGE_SLACK_BYTES


class PeerSlots:
    """At most ``limit`` requests in flight per connection (peer), over all its calls and streams, on the
    server's event loop. A request holds its slot from before it is decoded until its reply is written;
    a stream whose replies are not read blocks in that write, so it keeps its slot. Once a connection
    holds all of its slots, its next request waits (a stream's loop reads no further, and gRPC's flow
    control slows the sender) instead of being decoded, queued and answered into a window nobody reads:
    64 such streams on one connection took the batches from a robot that reads (its median latency went
    from ~12 to ~275 ms)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_peer_in_flight: expected at least 1, got {limit}")
        self.limit = limit
        self._peers: dict[str, tuple[asyncio.Semaphore, int]] = {}  # peer -> (slots, holders + waiters)

    @contextlib.asynccontextmanager
    async def hold(self, peer: str) -> AsyncIterator[None]:
        """Hold one of ``peer``'s slots for the body (waits while all are held)."""
        sem, users = self._peers.get(peer, (None, 0))
        if sem is None:
            sem = asyncio.Semaphore(self.limit)
        self._peers[peer] = (sem, users + 1)
        try:
            async with sem:
                yield
        finally:
            sem, users = self._peers[peer]
            if users > 1:
                self._peers[peer] = (sem, users - 1)
            else:
                del self._peers[peer]  # nobody holds or waits: forget the connection


def decode_request(
    req: pb.ActRequest,
    version: ServedVersion,
    config: ServerConfig,
    *,
    time_remaining: float | None,
    peer: str,
) -> _Pending:
    """``req`` checked against the serving ``version``'s robot spec and ``config``'s value bounds, as a
    request ready to queue (``enqueued_ns`` set by the caller). ``time_remaining``: the call's deadline
    in seconds (None: none); ``peer``: the connection it came on."""
    spec = version.spec
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise SpecError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters", f"{len(req.request_id)}")
    obs = req.observation
    state = _state(obs, spec, config.max_state_abs)
    cams = _cameras(obs, spec)
    if len(obs.instruction) > MAX_INSTRUCTION_CHARS:
        raise SpecError(
            "observation.instruction",
            f"at most {MAX_INSTRUCTION_CHARS} characters",
            f"{len(obs.instruction)}",
        )
    noise = _noise(req, version, config.max_noise_abs)
    seed = req.seed if req.HasField("seed") else (0 if noise is not None else secrets.randbits(63))
    return _Pending(
        state=state,
        cameras=cams,
        instruction=obs.instruction or spec.instruction,
        seed=seed,
        noise=noise,
        deadline=_deadline(time_remaining, req.timeout_ms),
        enqueued_ns=0,
        peer=peer,
        rtc=_rtc(req, version, config.max_state_abs),
    )


def _state(obs: pb.Observation, spec: RobotSpec, max_abs: float) -> np.ndarray:
    """``observation.state``: float32 [state_dim], finite, within +-``max_abs``."""
    if spec.state_dim == 0 and not obs.state.dtype:
        return np.zeros((0,), np.float32)
    state = from_tensor(obs.state, "observation.state", dtype="float32", shape=(spec.state_dim,))
    spec.check_state(state, name="observation.state")  # finite
    _within("observation.state", state, max_abs, "values", "max_state_abs")
    return state


def _cameras(obs: pb.Observation, spec: RobotSpec) -> dict[str, np.ndarray]:
    """Every camera of the spec, decoded (sizes read from the image header and checked before decoding)."""
    cams: dict[str, np.ndarray] = {}
    for name, img in obs.cameras.items():
        try:
            cam = spec.camera(name)
        except KeyError:
            raise SpecError(
                f"observation.cameras.{name}", f"only cameras {list(spec.camera_names)}", "an unknown camera"
            ) from None
        cams[name] = decode_image(img, f"observation.cameras.{name}", cam.height, cam.width)
    spec.check_images(cams, prefix="observation.cameras")
    return cams


def _noise(req: pb.ActRequest, version: ServedVersion, max_abs: float) -> np.ndarray | None:
    """Explicit initial noise (None when the request sends none): never with a seed, only for a model that
    takes noise, of its shape, finite and within +-``max_abs``."""
    if not (req.noise.dtype or req.noise.shape or req.noise.data):
        return None
    if req.HasField("seed"):
        raise SpecError("noise", "either seed or noise, not both", "both")
    if version.noise_shape is None:
        raise SpecError(
            "noise",
            f"no noise: {version.model.policy_type} takes no initial noise (send a seed or nothing)",
            "a noise tensor",
        )
    noise = from_tensor(req.noise, "noise", dtype="float32", shape=version.noise_shape)
    if not np.isfinite(noise).all():
        raise SpecError("noise", "finite values", "NaN or inf")
    _within("noise", noise, max_abs, "standard-normal values", "max_noise_abs")
    return noise


def _rtc(req: pb.ActRequest, version: ServedVersion, max_abs: float) -> RTCRequest | None:
    """Real-time chunking asked for (None: not asked, or nothing queued yet): ``inference_delay`` in
    [0, chunk_len) and within a trained checkpoint's maximum, ``queued_actions`` float32 [n, action_dim]
    with 1 <= n <= chunk_len, finite, within +-``max_abs``; only for a model that runs RTC."""
    has_queue = bool(req.queued_actions.dtype or req.queued_actions.shape or req.queued_actions.data)
    if not req.HasField("inference_delay"):
        if has_queue:
            raise SpecError("inference_delay", "a delay (control steps) with queued_actions", "none")
        return None
    if not version.rtc_mode:
        raise SpecError(
            "inference_delay",
            f"none: {version.model.policy_type} cannot run real-time chunking (GetInfo's rtc_mode is empty)",
            f"{req.inference_delay}",
        )
    h, a, delay = version.chunk_len, version.action_dim, req.inference_delay
    if delay >= h:
        raise SpecError("inference_delay", f"control steps in [0, {h - 1}] (chunk_len {h})", f"{delay}")
    bound = version.rtc_max_delay
    if bound and delay > bound:
        raise SpecError(
            "inference_delay",
            f"at most {bound}: commit {version.commit} was trained for real-time chunking with delays up to "
            f"{bound} (rtc_max_delay)",
            f"{delay}",
        )
    if not has_queue:
        return None  # nothing queued (the first request): nothing to continue
    dims = list(req.queued_actions.shape)
    if len(dims) != 2 or not 1 <= dims[0] <= h or dims[1] != a:
        raise SpecError("queued_actions", f"float32 [n, {a}] with 1 <= n <= {h} (chunk_len)", f"shape {dims}")
    queued = from_tensor(req.queued_actions, "queued_actions", dtype="float32", shape=dims)
    if not np.isfinite(queued).all():
        raise SpecError("queued_actions", "finite values", "NaN or inf")
    _within("queued_actions", queued, max_abs, "values", "max_state_abs")
    return RTCRequest(int(delay), queued)


def _within(name: str, x: np.ndarray, max_abs: float, what: str, knob: str) -> None:
    """Refuse ``x`` (the field ``name``) when a value lies beyond +-``max_abs`` (config field ``knob``)."""
    if x.size and float(np.abs(x).max()) > max_abs:
        raise SpecError(
            name, f"{what} within +-{max_abs:g} ({knob})", f"max |x| {float(np.abs(x).max()):.3g}"
        )


def _deadline(time_remaining: float | None, timeout_ms: int) -> float | None:
    """The ``time.monotonic()`` after which nobody waits for the answer: the call's deadline or the
    request's own ``timeout_ms`` (streams), whichever comes first; None when neither is set."""
    deadline = None
    if time_remaining is not None:
        deadline = time.monotonic() + time_remaining
    if timeout_ms:
        mine = time.monotonic() + timeout_ms / 1000
        deadline = mine if deadline is None else min(deadline, mine)
    return deadline
