"""Long-running services and their clients: ``serve``, ``client act``, ``collect``, ``fleet sim``, ``hub ...``.

Tokens come from the environment (or a file), never from a flag by default: a command line is visible
to every user of the machine through ``ps``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tyro.conf import Positional

from vla_rl.cli.common import CliError, Command, check_port, task_arg, user_errors
from vla_rl.core.configs import SECRET
from vla_rl.core.secrets import env_secret, read_secret_file

if TYPE_CHECKING:
    from server.config import ServerConfig


# ---------------------------------------------------------------------------- policy server
def _read_token_file(path: Path) -> str:
    """The token in ``path`` (see :func:`vla_rl.core.secrets.read_secret_file`), or an error naming --token-file."""
    with user_errors(ValueError, prefix="--token-file "):
        return read_secret_file(path)


def _serve_args() -> type:
    from server.config import ServerConfig

    return ServerConfig


def serve(config: ServerConfig) -> int:
    """Run the policy server of ``config`` in the foreground; the control token comes from
    ``--token-file`` or VLA_RL_SERVER_TOKEN (never a flag: ``ps`` shows command lines to everyone)."""
    from server.policy_server import serve as run
    from vla_rl.core.rpc import RequestError
    from vla_rl.hub.registry import check_hub, is_hub_ref

    if config.token_file is not None:
        token: str | None = _read_token_file(config.token_file)
    else:
        token = env_secret("VLA_RL_SERVER_TOKEN")
    check_port(config.host, config.port)
    if is_hub_ref(config.checkpoint):
        check_hub()  # no registry: one line naming it and how to start one (hub_errors), before loading
    elif not Path(config.checkpoint).is_dir():
        raise CliError(
            f"--checkpoint {config.checkpoint}: no such folder (give a checkpoint or LeRobot policy folder, "
            "or hub://org/name@rev)"
        )
    try:
        run(config, token=token or None)
    except RequestError as e:  # the first checkpoint could not be loaded: there is nothing to serve
        raise CliError(f"--checkpoint {config.checkpoint}: {e.message}") from None
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
    print(
        f"stages: client encode {t.client_encode_us}, network {t.network_us}, decode {t.decode_us}, "
        f"queue {t.queue_us}, batch {t.batch_us}, prefix {t.prefix_us}, denoise {t.denoise_us}, "
        f"wake {t.wake_us}, encode {t.encode_us}, client decode {t.client_decode_us} us; "
        f"time to first action {t.ttfa_us} us"
    )
    return 0


# ---------------------------------------------------------------------------- fleet
_COLLECT_DOC = """Run the fleet collector: receive frames, segments (autonomous / intervention / reset, with who
    was in control and why) and episode outcomes from many robots over gRPC and write them into an
    episode store + metadata DB. A message is acknowledged once it is durable (in the write-ahead log;
    with --fsync, on disk); robots resend what is not acknowledged and duplicates are dropped, so every
    frame is stored exactly once, across collector restarts too. The robots' token is read from
    VLA_RL_COLLECTOR_TOKEN. Example: vla-rl collect --store runs/fleet/store --port 50071 --metrics-port 9171"""


def _collect_args() -> type:
    """``vla-rl collect``'s flags: every :class:`~fleet.collector.CollectorConfig` field, then the secrets,
    which are not config fields (a config can be saved without them). Built on demand: it imports the
    collector."""
    from fleet.collector import CollectorConfig

    @dataclass(frozen=True)
    class Collect(CollectorConfig):
        __doc__ = _COLLECT_DOC

        token: str | None = field(
            default_factory=lambda: env_secret("VLA_RL_COLLECTOR_TOKEN"), repr=False, metadata=SECRET
        )
        """Robots must send it (default: env VLA_RL_COLLECTOR_TOKEN; prefer the environment or --token-file
        over this flag). Its holder may speak as any robot id; see --robot-tokens-file."""
        token_file: Path | None = None
        """Read the shared token from this file's first line (instead of --token / the environment)."""
        robot_tokens_file: Path | None = None
        """Per-robot credentials, JSON {"robot_id": "token"} or lines "robot_id: token": a robot may only
        say Hello as the id its token is bound to (another id: PERMISSION_DENIED)."""

        def __post_init__(self) -> None:
            try:
                super().__post_init__()
            except ValueError as e:  # "field: what was expected" -> one line naming the flag
                name, _, why = str(e).partition(": ")
                raise CliError(f"collect: --{name.replace('_', '-')}: {why}") from None

    return Collect


def collect(a: Any) -> int:
    from fleet.collector import CollectorConfig, load_robot_tokens
    from fleet.collector import serve as run

    check_port(a.host, a.port)
    with user_errors(ValueError, RuntimeError, OSError, prefix="collect: "):
        token = _read_token_file(a.token_file) if a.token_file else a.token
        run(
            CollectorConfig.from_dict(a.to_dict()),  # the config alone: no secrets in it
            token=token or None,
            robot_tokens=load_robot_tokens(a.robot_tokens_file) if a.robot_tokens_file else None,
        )
    return 0


def _fleet_args() -> type:
    from sim.fleet_runner import FleetConfig

    return FleetConfig


def fleet_sim(a: Any) -> int:
    from vla_rl_client.policy_common import channel_target

    from sim.fleet_runner import run_sim_fleet

    cfg = a
    if cfg.robots < 1 or cfg.episodes < 1:
        raise CliError("--robots and --episodes must be >= 1")
    with user_errors(ValueError, prefix="--server: "):
        channel_target(cfg.server)
    if cfg.task:
        cfg.task = task_arg(cfg.task)
    if cfg.collector_token is None:
        cfg.collector_token = env_secret("VLA_RL_COLLECTOR_TOKEN")
    with user_errors(RuntimeError):
        result = run_sim_fleet(cfg)
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
    if result.desk is not None and result.episodes:
        m = result.operator_metrics(cfg.operators)
        wait = "-" if m["mean_wait_s"] is None else f"{m['mean_wait_s']:.1f} s"
        print(
            f"help queue at {cfg.collector} ({cfg.operators} simulated operators, sim-operator-0.., reaction "
            f"{cfg.rules.reaction_s:g} s): {m['requests']} "
            f"requests, {m['requests_unanswered']} unanswered, mean wait {wait}; "
            f"{m['failures_without_takeover']}/{m['failures']} failures never taken over; "
            f"{m['interventions_per_robot_hour']:.1f} interventions per robot-hour, "
            f"{m['successful_episodes_per_operator_hour']:.1f} successful episodes per operator-hour, "
            f"operators busy {m['operator_utilisation']:.0%}"
        )
    for e in result.errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if result.errors else 0


# ---------------------------------------------------------------------------- hub
def _hub_args() -> type:
    from vla_rl.hub.config import HubConfig

    return HubConfig


def hub_serve(a: Any) -> int:
    from vla_rl.hub.server import serve as run

    check_port(a.host, a.port)
    try:
        a.resolved_token()  # a bad token file fails here, before the port is bound
    except ValueError as e:
        raise CliError(f"--token-file {str(e).removeprefix('token_file: ')}") from None
    run(a)
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
    if (lerobot := _lerobot_summary(ckpt.path)) is not None:
        print(f"{ckpt.path}  (commit {ckpt.commit}, {lerobot})")
        return 0
    load_checkpoint(ckpt.path)  # verify hashes before telling anyone to use it
    print(f"{ckpt.path}  (commit {ckpt.commit}, hashes verified)")
    return 0


def _lerobot_summary(folder: str | Path) -> str | None:
    """``LeRobot smolvla policy folder, awr round 3`` for a LeRobot folder (its lineage from our sidecar
    beside it, :mod:`policies.lerobot_sidecar`); None for our checkpoint."""
    from policies.lerobot_adapter import read_lerobot_config
    from policies.lerobot_sidecar import read_sidecar

    config = read_lerobot_config(folder)
    if config is None:
        return None
    lineage = read_sidecar(folder).lineage
    made = (
        f", {lineage.algorithm}" + (f" round {lineage.round}" if lineage.round is not None else "")
        if lineage
        else ""
    )
    return f"LeRobot {config['type']} policy folder{made}"


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
    Command(
        ("serve",),
        "serve action chunks over gRPC (batched, hot-swappable)",
        _serve_args,
        serve,
        config_file=True,
    ),
    Command(
        ("client", "act"),
        "one action chunk for a simulated observation (a quick check)",
        ClientAct,
        client_act,
    ),
    Command(
        ("collect",),
        "run the fleet collector (robots stream episodes into a store)",
        _collect_args,
        collect,
        config_file=True,
    ),
    Command(
        ("fleet", "sim"),
        "simulated robots + operator takeovers streaming to a collector",
        _fleet_args,
        fleet_sim,
        config_file=True,
    ),
    Command(
        ("dashboard",),
        "the web dashboard: review and label rollouts, start, promote and roll back rounds",
        _dashboard_args,
        dashboard,
        config_file=True,
    ),
    Command(
        ("hub", "serve"), "run the embedded Hub-compatible registry", _hub_args, hub_serve, config_file=True
    ),
    Command(("hub", "push"), "push a checkpoint folder as a commit (and tag)", HubPush, hub_push),
    Command(("hub", "pull"), "download a checkpoint by ref and verify its hashes", HubPull, hub_pull),
]
