"""Long-running services and their clients: ``serve``, ``client act``, ``collect``, ``fleet sim``, ``hub ...``.

Tokens come from the environment (or a file), never from a flag by default: a command line is visible
to every user of the machine through ``ps``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import tyro
from tyro.conf import Positional

from vla_rl.cli.common import CliError, Command, check_port, parse_config, task_arg, user_errors
from vla_rl.core.secrets import env_secret, read_secret_file

if TYPE_CHECKING:
    from server.config import ServerConfig


# ---------------------------------------------------------------------------- policy server
def _read_token_file(path: Path) -> str:
    """The token in ``path`` (see :func:`vla_rl.core.secrets.read_secret_file`), or an error naming --token-file."""
    with user_errors(ValueError, prefix="--token-file "):
        return read_secret_file(path)


def serve_command(argv: Sequence[str], prog: str) -> int:
    """``vla-rl serve``: its flags are :class:`server.config.ServerConfig`'s fields."""
    from server.config import ServerConfig

    return serve(parse_config(ServerConfig, argv, prog))


def serve(config: ServerConfig) -> int:
    """Run the policy server of ``config`` in the foreground; the control token comes from
    ``--token-file`` or VLA_RL_SERVER_TOKEN (never a flag: ``ps`` shows command lines to everyone)."""
    from server.policy_server import serve as run

    if config.token_file is not None:
        token: str | None = _read_token_file(config.token_file)
    else:
        token = env_secret("VLA_RL_SERVER_TOKEN")
    check_port(config.host, config.port)
    run(config, token=token or None)
    return 0


@dataclass
class ClientAct:
    """One action chunk for a simulated observation (a quick check): reset the task's simulator, send
    its first observation to the server, print the chunk and timing. With --from-store: send a recorded
    observation (state, cameras, the episode's instruction) of --episode at --frame instead.
    Example: vla-rl client act --from-store runs/koch/store --episode 0 --frame 10"""

    server: str = "127.0.0.1:50061"
    """Policy server address: host:port, replicas as a comma-separated list (a:1,b:2) or dns:///name:port
    (round-robin over the replicas that report SERVING)."""
    task: str | None = None
    """Task; None = the served model's robot spec."""
    model_id: str = ""
    """Served model; empty = the only one."""
    seed: int = 0
    """Simulator and sampling seed."""
    timeout: float = 10.0
    """Seconds to wait for the server."""
    tls_ca: Path | None = None
    """PEM root certificate(s): connect over TLS."""
    from_store: Path | None = None
    """Send a recorded observation from this episode store (no simulator)."""
    episode: str = "0"
    """With --from-store: an episode id, or its index in the store's sorted episode ids."""
    frame: int = 0
    """With --from-store: the frame of the episode."""


def _recorded_observation(a: ClientAct) -> tuple[dict[str, Any], Any]:
    """The observation at ``--frame`` of ``--episode`` in ``--from-store``, and the recorded action there."""
    from fleet.store import EpisodeStore

    assert a.from_store is not None
    with user_errors(FileNotFoundError, prefix="--from-store: "):
        store = EpisodeStore(a.from_store)
    ids = store.episode_ids()
    eid = a.episode
    if eid not in ids:
        if not (eid.isdigit() and int(eid) < len(ids)):
            raise CliError(
                f"--episode {a.episode}: no such episode in {a.from_store} "
                f"(give an id, or an index 0..{len(ids) - 1}; e.g. {ids[:3]})"
            )
        eid = ids[int(eid)]
    ep = store.read_episode(eid)
    if not 0 <= a.frame < ep.length:
        raise CliError(f"--frame {a.frame}: episode {eid} has frames 0..{ep.length - 1}")
    obs = {
        "state": ep.state[a.frame],
        "cameras": {k: v[a.frame] for k, v in ep.cameras.items()},
        "instruction": ep.meta.instruction,
    }
    return obs, ep.action[a.frame]


def client_act(a: ClientAct) -> int:
    import numpy as np
    from vla_rl_client.policy_client import PolicyClient, PolicyError

    from sim.registry import make_env

    if a.tls_ca is not None and not a.tls_ca.is_file():
        raise CliError(f"--tls-ca {a.tls_ca}: no such file")
    recorded = _recorded_observation(a) if a.from_store is not None else None
    with user_errors(ValueError, prefix="--server: "):
        client = PolicyClient(a.server, timeout_s=a.timeout, tls_ca=a.tls_ca)
    with user_errors(PolicyError, prefix=f"{a.server}: "):
        info = client.info()
        model = info[a.model_id] if a.model_id else next(iter(info.values()))
        if recorded is not None:
            batch_obs = recorded[0]
        else:
            spec = json.loads(model.robot_spec_json)
            task = task_arg(a.task) if a.task else spec["name"]
            obs_mode = "rgb" if spec.get("cameras") else "state"
            image_size = spec["cameras"][0]["height"] if spec.get("cameras") else 128
            with make_env(task, obs=obs_mode, image_size=image_size) as env:  # type: ignore[arg-type]
                obs, _ = env.reset(seed=a.seed)
            batch_obs = {"state": obs["state"], "cameras": obs["cameras"], "instruction": obs["instruction"]}
        res = client.act(batch_obs, seed=a.seed, model_id=model.model_id)
    np.set_printoptions(precision=3, suppress=True)
    if recorded is not None:
        print(f"recorded observation: {a.from_store} episode {a.episode} frame {a.frame}")
        print(f"recorded action there: {recorded[1]}")
    print(f"model {model.model_id} ({model.policy_type}) commit {res.commit[:12]} on {model.device}")
    print(f"chunk [{res.actions.shape[0]} x {res.actions.shape[1]}], execute the first {res.n_exec}:")
    print(res.actions)
    t = res.timing
    print(
        f"timing: queue {t.queue_us} us, decode {t.decode_us} us, inference {t.inference_us} us, "
        f"total {t.total_us} us (batch of {res.batch_size})"
    )
    return 0


# ---------------------------------------------------------------------------- fleet
@dataclass
class Collect:
    """Run the fleet collector: receive frames, segments (autonomous / intervention / reset, with who
    was in control and why) and episode outcomes from many robots over gRPC and write them into an
    episode store + metadata DB. A message is acknowledged once it is durable (in the write-ahead log;
    with --fsync, on disk); robots resend what is not acknowledged and duplicates are dropped, so every
    frame is stored exactly once, across collector restarts too. The robots' token is read from
    VLA_RL_COLLECTOR_TOKEN. Example: vla-rl collect --store runs/fleet/store --port 50071 --metrics-port 9171"""

    store: Path
    """Episode store directory (created if missing), or s3://BUCKET/PREFIX (S3 credentials and endpoint
    from the environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; needs --wal-dir
    and --db)."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file inside the store."""
    wal_dir: Path | None = None
    """Local directory of the write-ahead logs (and the lock); None = <store>/wal. Required with an
    s3:// store: the log stays on local disk, only whole chunks and commit records are uploaded."""
    host: str = "127.0.0.1"
    """Bind address (anything but loopback needs a token)."""
    port: int = 50071
    """gRPC port (0 = any free port; printed on start)."""
    token: str | None = field(default_factory=lambda: env_secret("VLA_RL_COLLECTOR_TOKEN"))
    """Robots must send it (default: env VLA_RL_COLLECTOR_TOKEN; prefer the environment or --token-file
    over this flag). Its holder may speak as any robot id; see --robot-tokens-file."""
    token_file: Path | None = None
    """Read the shared token from this file's first line (instead of --token / the environment)."""
    robot_tokens_file: Path | None = None
    """Per-robot credentials, JSON {"robot_id": "token"} or lines "robot_id: token": a robot may only
    say Hello as the id its token is bound to (another id: PERMISSION_DENIED)."""
    fsync: bool = False
    """fsync every acknowledged message (power-loss safe, slower)."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics on this port (no authentication: it lists robot ids unless
    --no-metrics-robot-labels)."""
    metrics_host: str = "127.0.0.1"
    """Bind address of /metrics (loopback by default; anything else exposes it to the network)."""
    metrics_robot_labels: bool = True
    """Label per-robot metrics with the robot id (off: one label 'all', no robot ids in /metrics)."""
    robots: str | None = None
    """Comma-separated robot ids to accept; None = any."""
    chunk_len: int = 128
    """Frames per Zarr chunk."""
    camera_zstd_level: int = -3
    """zstd level of lossless camera arrays (-3: fast; 1 or 3 = ~10-20% smaller for 1.5-3x the CPU)."""
    camera_codec: str = "lossless"
    """Codec of the camera arrays: lossless (zstd), jpeg or jpeg:QUALITY (1-100; 5x smaller at 90, 11x at 60 on
    rendered frames: docs/store.md), per camera CAMERA=CODEC, comma-separated: e.g. jpeg:90,wrist=lossless."""
    max_batch_frames: int = 64
    """Largest FrameBatch accepted."""
    max_pending_mb: float = 1024
    """Frame MB waiting for the store before robots are slowed."""
    store_writers: int = 1
    """Processes writing the logged frames into Zarr beside the one taking messages (0 = a thread in
    the collector's process, which then shares its one core)."""
    store_writer_nice: int = 10
    """How much lower the store writers' CPU priority is (0-19): intake and acks go first."""
    max_open_episodes_per_robot: int = 16
    """Episodes one robot may have open at once (more: StartEpisode is refused, RESOURCE_EXHAUSTED)."""
    episode_idle_timeout_s: float = 1800.0
    """An open episode with no message for this long is closed with outcome 'aborted' (frames kept)."""
    max_open_logs: int = 256
    """Write-ahead log file descriptors kept open (least recently used closed first, reopened on demand)."""
    max_camera_pixels: int = 1280 * 720
    """Largest camera (height x width) a robot's Hello may announce (larger: RESOURCE_EXHAUSTED)."""
    max_buffered_mb: float = 1024
    """Frame MB the store writers hold in memory in all (past it, idle episodes are flushed to Zarr); a
    Hello whose one chunk (--chunk-len frames) is larger is refused."""
    drain_timeout_s: float = 5.0
    """Longest a stop (SIGTERM, Ctrl-C) takes: writing buffered frames to Zarr is cut off after it.
    Nothing acknowledged is lost (it is in the log, replayed on the next start); robots resend the rest."""


# Collect fields passed to serve() under the same name (the rest are converted in collect()).
_COLLECT_AS_IS = (
    "host",
    "port",
    "fsync",
    "chunk_len",
    "camera_zstd_level",
    "camera_codec",
    "max_batch_frames",
    "store_writers",
    "store_writer_nice",
    "metrics_port",
    "metrics_host",
    "metrics_robot_labels",
    "max_open_episodes_per_robot",
    "episode_idle_timeout_s",
    "max_open_logs",
    "max_camera_pixels",
    "drain_timeout_s",
    "wal_dir",
)


def collect(a: Collect) -> int:
    from fleet.collector import load_robot_tokens
    from fleet.collector import serve as run

    check_port(a.host, a.port)
    robots = {r.strip() for r in a.robots.split(",") if r.strip()} if a.robots else None
    mb = 1024 * 1024
    with user_errors(ValueError, RuntimeError, OSError, prefix="collect: "):
        token = _read_token_file(a.token_file) if a.token_file else a.token
        run(
            a.store,
            a.db,
            token=token or None,
            robot_tokens=load_robot_tokens(a.robot_tokens_file) if a.robot_tokens_file else None,
            max_buffered_bytes=int(a.max_buffered_mb * mb),
            max_pending_bytes=int(a.max_pending_mb * mb),
            allowed_robots=robots,
            **{k: getattr(a, k) for k in _COLLECT_AS_IS},
        )
    return 0


def _fleet_args() -> type:
    from sim.fleet_runner import FleetConfig

    doc = """N simulated robots (one process each) get action chunks from the policy server and stream every
    frame, segment and outcome to the collector. A simulated operator (the task's privileged scripted
    expert) takes over when the policy stalls (--stall-steps), drifts (--drift-radius) or at random
    (--spot-check-prob), drives for --drive-steps and hands back, within a budget per episode. The collector
    token is read from VLA_RL_COLLECTOR_TOKEN.
    Example: vla-rl fleet sim --robots 4 --episodes 20 --server 127.0.0.1:50061 --collector 127.0.0.1:50071"""
    return make_dataclass(
        "FleetSim",
        [
            ("fleet", Annotated[FleetConfig, tyro.conf.OmitArgPrefixes]),
            ("progress", Annotated[bool, tyro.conf.arg(help="Show a progress bar.")], field(default=True)),
        ],
        namespace={"__doc__": doc},
    )


def fleet_sim(a: Any) -> int:
    from vla_rl_client.policy_common import channel_target

    from sim.fleet_runner import run_sim_fleet

    cfg = a.fleet
    if cfg.robots < 1 or cfg.episodes < 1:
        raise CliError("--robots and --episodes must be >= 1")
    with user_errors(ValueError, prefix="--server: "):
        channel_target(cfg.server)
    if cfg.task:
        cfg.task = task_arg(cfg.task)
    if cfg.collector_token is None:
        cfg.collector_token = env_secret("VLA_RL_COLLECTOR_TOKEN")
    with user_errors(RuntimeError):
        result = run_sim_fleet(cfg, progress=a.progress)
    print()
    print(result.table())
    total = sum(s.episodes for s in result.robots.values())
    human = sum(s.human_steps for s in result.robots.values())
    steps = sum(s.steps for s in result.robots.values())
    succ = sum(s.successes for s in result.robots.values())
    print(
        f"\n{total} episodes in {result.seconds:.0f} s: success {succ}/{total}, operator drove "
        f"{human}/{steps} frames ({human / max(steps, 1):.0%}); robots waited for a busy operator "
        f"{result.operator_busy_waits} times"
    )
    for e in result.errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if result.errors else 0


# ---------------------------------------------------------------------------- hub
@dataclass
class HubServe:
    """Run the embedded Hub-compatible registry: model repos stored under --data, served with the
    Hugging Face Hub's HTTP API so the real huggingface_hub client pushes and pulls checkpoints here.
    Writes need the token when one is set, and so do reads of repos created private. The token comes from
    env VLA_RL_HUB_TOKEN or --token-file rather than a flag: a command line is visible to every user of the
    machine through ps (and /proc), the environment and a 0600 file are not. Request bodies are bounded
    (--max-commit-bytes, --max-inline-file-bytes, --max-json-bytes, --max-commit-operations; over a
    limit: 413 naming it). Binds 127.0.0.1 unless told otherwise."""

    data: Path = Path("runs/hub")
    """Repository storage folder."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: int = 8808
    """HTTP port."""
    token: str | None = field(default_factory=lambda: env_secret("VLA_RL_HUB_TOKEN"))
    """Write token (default: env VLA_RL_HUB_TOKEN; prefer the environment or --token-file over this flag)."""
    token_file: Path | None = None
    """File holding the token alone (surrounding whitespace ignored; wins over VLA_RL_HUB_TOKEN); mode 0600."""
    max_commit_bytes: int = 256 * 1024 * 1024  # = vla_rl.hub.limits.Limits() (a test checks)
    """Largest commit body in bytes (NDJSON with inline files base64-encoded; parsed as a stream)."""
    max_inline_file_bytes: int = 10 * 1024 * 1024
    """Largest regular file a commit carries inline, in bytes (at most 10 MiB; larger files use LFS)."""
    max_json_bytes: int = 4 * 1024 * 1024
    """Largest JSON body of other requests (preupload, LFS batch, paths-info, refs), in bytes."""
    max_commit_operations: int = 100_000
    """Most file operations (adds, deletes) in one commit."""


def hub_serve(a: HubServe) -> int:
    from vla_rl.hub.limits import Limits
    from vla_rl.hub.server import serve as run

    check_port(a.host, a.port)
    token = _read_token_file(a.token_file) if a.token_file is not None else (a.token or None)
    try:
        limits = Limits(
            max_commit_bytes=a.max_commit_bytes,
            max_inline_file_bytes=a.max_inline_file_bytes,
            max_json_bytes=a.max_json_bytes,
            max_commit_operations=a.max_commit_operations,
        )
    except ValueError as e:
        raise CliError(f"--{str(e).split()[0].replace('_', '-')}: {e}") from None
    run(a.data, host=a.host, port=a.port, token=token, limits=limits)
    return 0


@dataclass
class HubPush:
    """Push a checkpoint folder as a commit (and tag)."""

    folder: Positional[Path]
    """Checkpoint folder."""
    repo: str
    """org/name."""
    tag: str | None = None
    """Tag the commit."""
    branch: str = "main"
    """Branch to commit to."""
    message: str = "upload checkpoint"
    """Commit message."""


def hub_push(a: HubPush) -> int:
    from vla_rl.hub.registry import check_hub, push_folder

    if not a.folder.is_dir():
        raise CliError(f"{a.folder}: no such checkpoint folder")
    check_hub(write=True)
    sha = push_folder(a.folder, a.repo, message=a.message, tag=a.tag, branch=a.branch)
    print(f"hub://{a.repo}@{sha}" + (f"  (tag {a.tag})" if a.tag else ""))
    return 0


@dataclass
class HubPull:
    """Download a checkpoint by ref and verify its hashes."""

    ref: Positional[str]
    """hub://org/name@rev (branch, tag or commit)."""
    cache_dir: Path | None = None
    """Download cache; None = huggingface_hub's."""


def hub_pull(a: HubPull) -> int:
    from vla_rl.hub.checkpoint import load_checkpoint
    from vla_rl.hub.registry import check_hub, pull

    check_hub()
    ckpt = pull(a.ref, cache_dir=a.cache_dir)
    load_checkpoint(ckpt.path)  # verify hashes before telling anyone to use it
    print(f"{ckpt.path}  (commit {ckpt.commit}, hashes verified)")
    return 0


# ---------------------------------------------------------------------------- dashboard
def _dashboard_args() -> type:
    from vla_rl.dashboard.config import DashboardConfig

    return DashboardConfig


def dashboard(a: Any) -> int:
    import socket

    import uvicorn

    from vla_rl.dashboard.app import create_app
    from vla_rl.dashboard.auth import TokenError, load_tokens

    check_port(a.host, a.port)
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: --host {a.host} exposes the dashboard beyond this machine (no TLS here; put a "
            "TLS proxy in front)",
            file=sys.stderr,
        )
    with user_errors(TokenError, prefix="--tokens-file: " if a.tokens_file else ""):
        tokens = load_tokens(a.tokens_file)
    app = create_app(a, tokens=tokens)
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    secret = app.state.generated_token
    if secret is not None:
        print(
            "no dashboard tokens configured (--tokens-file, VLA_RL_DASHBOARD_TOKENS_FILE or "
            "VLA_RL_DASHBOARD_TOKEN): made a one-time operator token for this run"
        )

    sock = socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((a.host, a.port))
    sock.listen(2048)  # connections wait in the backlog from now on, not refused, while uvicorn starts
    port = sock.getsockname()[1]
    url = f"http://{f'[{a.host}]' if ':' in a.host else a.host}:{port}/"
    print(
        f"dashboard on {url}"
        + (f"#token={secret}" if secret else f"  (tokens from {tokens.source if tokens else '-'})"),
        flush=True,
    )
    server.run(sockets=[sock])
    return 0


COMMANDS = [
    Command(("serve",), "serve action chunks over gRPC (batched, hot-swappable)", None, serve_command),
    Command(
        ("client", "act"),
        "one action chunk for a simulated observation (a quick check)",
        ClientAct,
        client_act,
    ),
    Command(("collect",), "run the fleet collector (robots stream episodes into a store)", Collect, collect),
    Command(
        ("fleet", "sim"),
        "simulated robots + operator takeovers streaming to a collector",
        _fleet_args,
        fleet_sim,
    ),
    Command(
        ("dashboard",),
        "the web dashboard: review and label rollouts, start, promote and roll back rounds",
        _dashboard_args,
        dashboard,
    ),
    Command(("hub", "serve"), "run the embedded Hub-compatible registry", HubServe, hub_serve),
    Command(("hub", "push"), "push a checkpoint folder as a commit (and tag)", HubPush, hub_push),
    Command(("hub", "pull"), "download a checkpoint by ref and verify its hashes", HubPull, hub_pull),
]
