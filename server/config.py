"""Every knob of the policy server, typed once: :class:`ServerConfig` is ``vla-rl serve``'s flags (tyro reads
its fields and their docstrings), what :func:`server.policy_server.serve` and
:class:`server.policy_server.PolicyServer` take, and what a config file holds (:meth:`ServerConfig.to_dict`,
:meth:`ServerConfig.from_dict`).

Secrets are never fields: the control token comes from ``token_file`` (a path, which is saved) or the
environment, and reaches the server as its own argument. Kept light (no torch) so the CLI can parse flags
before anything heavy loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from vla_rl.core import configs

DEFAULT_PORT = 50061
DEFAULT_DRAIN_S = 2.0  # seconds NOT_SERVING between SIGTERM and the stop
DEFAULT_LOAD_TIMEOUT_S = 600.0
DEFAULT_MAX_FILE_MB = 64 * 1024.0  # one checkpoint file; vla_rl.hub.checkpoint.DEFAULT_MAX_FILE_BYTES in MiB
DEFAULT_MAX_CONCURRENT_RPCS = 256
DEFAULT_MAX_PEER_QUEUED = 64
DEFAULT_MAX_PEER_IN_FLIGHT = 16
DEFAULT_STREAM_WRITE_TIMEOUT_S = 10.0
DEFAULT_MAX_NOISE_ABS = 10.0
DEFAULT_MAX_STATE_ABS = 1e6
DEFAULT_LOG_INTERVAL_S = 10.0
DEFAULT_LONE_INLINE_MS = 100.0  # a lone robot's forward runs on the event loop up to this long
DEFAULT_MAX_GUIDANCE_WEIGHT = 10.0  # policies.rtc.DEFAULT_MAX_GUIDANCE_WEIGHT (kept light: no torch here)
MESSAGE_SLACK_BYTES = 64 * 1024  # a request's ids, instruction and framing: the least max_message_bytes
FOLLOW_SELF = "self"
CompileMode = Literal["off", "auto", "on"]
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)


@dataclass
class ServerConfig:
    """Serve a checkpoint to many robots over gRPC: dynamic batching across clients, a bounded queue
    (RESOURCE_EXHAUSTED when full), deadlines, health + reflection, and live checkpoint swaps
    (LoadCheckpoint / Promote / Rollback with the token, or --follow a moving ref such as
    hub://org/name@prod). --checkpoint may also be a LeRobot policy folder (config.json with a "type",
    e.g. ACT or Diffusion, saved by save_pretrained with its processors). Binds 127.0.0.1 unless told
    otherwise; --tls-cert/--tls-key serve over TLS. The control token is read from VLA_RL_SERVER_TOKEN
    or --token-file. Limits bound what one client or checkpoint can make the server do (--max-* flags).
    Several servers can follow the same ref as replicas: clients list them (--server a:50061,b:50061) and
    skip one that is down or draining (SIGTERM drains for --drain seconds before stopping).
    Example: vla-rl serve --checkpoint hub://fleet/push@prod --follow self"""

    checkpoint: str
    """hub://org/name@rev, a checkpoint folder, or a LeRobot policy folder."""
    follow: str | None = None
    """A ref to follow for new revisions ('self' = --checkpoint's ref)."""
    follow_interval: float = 30.0
    """Seconds between ref polls."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = DEFAULT_PORT
    """gRPC port."""
    max_batch: int = 16
    """Largest batch per forward pass."""
    max_wait_us: int = 2000
    """Longest a batch waits to fill."""
    adaptive_wait: bool = True
    """Stop waiting once every active robot is in the batch (--no-adaptive-wait: always wait --max-wait-us)."""
    lone_inline_ms: float = DEFAULT_LONE_INLINE_MS
    """With adaptive wait, a lone robot's request (no other robot active on any served model, nothing
    queued, no batch running) is run on the server's event loop instead of the batcher thread, saving two
    thread wake-ups, when the model's last forward took at most this many ms: meanwhile the event loop
    answers nothing else (health checks and GetInfo wait up to that long). 0 = always the batcher thread."""
    tls_cert: Path | None = None
    """PEM certificate chain: serve over TLS."""
    tls_key: Path | None = None
    """PEM private key for --tls-cert."""
    max_queue: int = 256
    """Queued requests before RESOURCE_EXHAUSTED."""
    model_id: str = "default"
    """Name of the served model."""
    canary: str | None = None
    """A candidate's ref (e.g. hub://org/name@canary) served beside --checkpoint as model
    --canary-model-id and followed: the share of the fleet that runs the canary asks for it
    (vla_rl/canary.py promotes it or rolls it back on their outcomes)."""
    canary_model_id: str = "canary"
    """Name of the canary's model."""
    token_file: Path | None = None
    """Read the control token from this file (first line; overrides VLA_RL_SERVER_TOKEN). Keep it mode 0600."""
    device: str = "auto"
    """auto (CUDA if present), cpu, cuda, cuda:1, ..."""
    max_message_bytes: int | None = None
    """Largest request accepted; None = derived from the robot spec (2 x cameras x H x W x 3 + state +
    noise + 64 KiB, at least 1 MiB)."""
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS
    """Calls and open streams served at once; more are answered RESOURCE_EXHAUSTED."""
    max_peer_queued: int = DEFAULT_MAX_PEER_QUEUED
    """Requests one connection may have waiting for inference; more are answered RESOURCE_EXHAUSTED."""
    max_peer_in_flight: int = DEFAULT_MAX_PEER_IN_FLIGHT
    """Requests one connection may have in flight over all its calls and streams: read and not yet answered,
    a reply waiting for the robot to read it included. Past it, the connection's next request waits (a
    stream's next request is not read: flow control slows the sender), so streams that send and never read
    cost at most this many requests' work each time their replies back up."""
    stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT_S
    """Seconds a stream reply may wait for the robot to read it before the stream is closed."""
    load_timeout: float = DEFAULT_LOAD_TIMEOUT_S
    """Seconds one checkpoint load may take: past it, reading stops at its next check and the call answers
    DEADLINE_EXCEEDED (later loads, rollbacks and --follow keep working)."""
    max_file_mb: float = DEFAULT_MAX_FILE_MB
    """Largest checkpoint file (MiB) a load will read."""
    max_noise_abs: float = DEFAULT_MAX_NOISE_ABS
    """Largest |value| of explicit initial noise in a request (it is standard normal)."""
    max_state_abs: float = DEFAULT_MAX_STATE_ABS
    """Largest |value| in observation.state."""
    log_interval: float = DEFAULT_LOG_INTERVAL_S
    """Seconds between repeated warnings about one client's bad requests (the rest are counted)."""
    drain: float = DEFAULT_DRAIN_S
    """Seconds to drain on SIGTERM before stopping: the health service says NOT_SERVING, so clients given
    several replicas send new calls elsewhere, and open streams close after their next reply (Ctrl-C or a
    second signal stops at once; 0 = no drain)."""
    cache_dir: Path | None = None
    """Where hub:// checkpoints are downloaded; None = the Hugging Face cache."""
    torch_threads: int | None = None
    """Torch CPU threads for inference (a process-wide setting); None = torch's default."""
    compile: CompileMode = "off"
    """Run flow policies' denoising step under torch.compile, one static graph per batch bucket (powers of
    two up to --max-batch), compiled in the background after each load while eager serves: off; auto =
    compile on CUDA only; on = compile on any device, with CUDA graphs on CUDA. A failure to compile
    logs one warning and serves eager."""
    rtc_execution_horizon: int | None = None
    """Real-time chunking (requests that send an inference delay and their queued actions; docs/serving.md):
    the action where guidance toward the queued actions fades to nothing (capped at the queued actions);
    None = every queued action guides."""
    rtc_max_guidance_weight: float = DEFAULT_MAX_GUIDANCE_WEIGHT
    """Real-time chunking: the cap of the guidance weight (the RTC paper's beta; LeRobot's default 10).
    Larger follows the queued actions more tightly early in denoising."""

    def __post_init__(self) -> None:
        for name in ("checkpoint", "host", "model_id", "device"):
            _text(name, getattr(self, name))
        if self.follow is not None:
            _text("follow", self.follow)
        if self.canary is not None:
            _text("canary", self.canary)
            _text("canary_model_id", self.canary_model_id)
            if self.canary_model_id == self.model_id:
                raise ValueError(
                    f"canary_model_id: expected a name other than --model-id ({self.model_id!r})"
                )
        _number("follow_interval", self.follow_interval, low=0.0, strict=True)
        _integer("port", self.port, low=0)
        if self.port > 65535:
            raise ValueError(f"port: expected 0..65535 (0 = any free port), got {self.port}")
        _integer("max_batch", self.max_batch, low=1)
        _integer("max_wait_us", self.max_wait_us, low=0)
        _integer("max_queue", self.max_queue, low=1)
        if not isinstance(self.adaptive_wait, bool):
            raise ValueError(f"adaptive_wait: expected true or false, got {self.adaptive_wait!r}")
        _number(
            "lone_inline_ms", self.lone_inline_ms, low=0.0, strict=False, unit="milliseconds", finite=True
        )
        self._check_tls()
        for name in ("token_file", "cache_dir"):
            _path_or_none(name, getattr(self, name))
        if self.max_message_bytes is not None:
            _integer("max_message_bytes", self.max_message_bytes, low=MESSAGE_SLACK_BYTES)
        for name in ("max_concurrent_rpcs", "max_peer_queued", "max_peer_in_flight"):
            _integer(name, getattr(self, name), low=1)
        for name in (
            "stream_write_timeout",
            "load_timeout",
            "max_file_mb",
            "max_noise_abs",
            "max_state_abs",
            "log_interval",
        ):
            _number(name, getattr(self, name), low=0.0, strict=True)
        _number("drain", self.drain, low=0.0, strict=False, unit="seconds", finite=True)
        if self.torch_threads is not None:
            _integer("torch_threads", self.torch_threads, low=1)
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile: expected one of {list(COMPILE_MODES)}, got {self.compile!r}")
        if self.rtc_execution_horizon is not None:
            _integer("rtc_execution_horizon", self.rtc_execution_horizon, low=1)
        _number("rtc_max_guidance_weight", self.rtc_max_guidance_weight, low=0.0, strict=True, finite=True)

    def _check_tls(self) -> None:
        """TLS needs the certificate chain and its key together, each an existing file."""
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            raise ValueError(
                f"{missing}: expected both tls_cert (PEM certificate chain) and tls_key (its PEM private "
                f"key), got only {given}"
            )
        for name in ("tls_cert", "tls_key"):
            path = _path_or_none(name, getattr(self, name))
            if path is not None and not path.is_file():
                raise ValueError(f"{name}: expected a PEM file, got {path}: no such file")

    # -- derived values
    @property
    def max_file_bytes(self) -> int:
        """``max_file_mb`` in bytes: the largest checkpoint file a load reads."""
        return int(self.max_file_mb * 1024 * 1024)

    def models(self) -> dict[str, str]:
        """Model id -> checkpoint reference: the model this config serves, and its canary if it has one."""
        return {
            self.model_id: self.checkpoint,
            **({self.canary_model_id: self.canary} if self.canary else {}),
        }

    def follow_map(self) -> dict[str, str]:
        """Model id -> the ref polled for new revisions (empty: nothing followed); a canary is always
        followed (its ref moves to each candidate, and back to prod on a rollback)."""
        canary = {self.canary_model_id: self.canary} if self.canary else {}
        if self.follow is None:
            return canary
        return {self.model_id: self.checkpoint if self.follow == FOLLOW_SELF else self.follow, **canary}

    # -- files
    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-safe (:func:`vla_rl.core.configs.to_dict`): what :meth:`from_dict` reads back."""
        return configs.to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServerConfig:
        """A config from :meth:`to_dict`'s output (fields left out take their defaults); ValueError names
        unknown keys, a missing ``checkpoint`` and any value the validation refuses."""
        if isinstance(data, dict) and "checkpoint" not in data:
            raise ValueError("checkpoint: required (hub://org/name@rev or a folder)")
        return configs.from_dict(cls, data, "server config")


def _text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}: expected a non-empty string, got {value!r}")


def _integer(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")


def _number(
    name: str, value: object, *, low: float, strict: bool, unit: str = "a number", finite: bool = False
) -> None:
    """``value`` is a number above ``low`` (``strict``) or at least ``low``; never NaN, and never inf
    when ``finite``."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and not math.isnan(value)
    ok = ok and not (finite and math.isinf(value))  # type: ignore[arg-type]
    if not ok or (value <= low if strict else value < low):  # type: ignore[operator]
        raise ValueError(f"{name}: expected {unit} {'>' if strict else '>='} {low:g}, got {value!r}")


def _path_or_none(name: str, value: object) -> Path | None:
    if value is not None and not isinstance(value, Path):
        raise ValueError(f"{name}: expected a path, got {value!r}")
    return value
