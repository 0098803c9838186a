"""``vla-rl train NAME``, ``vla-rl round ...``, ``vla-rl eval`` and ``vla-rl demo``.

Every ``train NAME`` command is generated from the algorithm's config dataclass (its field docstrings
are the ``--help``), and ``round start --algo NAME`` takes exactly the same flags plus the round's own:
one way to set a knob. ``--preset NAME`` starts from a named recipe (:mod:`vla_rl.train.presets`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from tyro.conf import Positional

from vla_rl.cli.common import (
    CliError,
    Command,
    parse,
    partial,
    pop_option,
    task_arg,
    user_errors,
    with_options,
)
from vla_rl.core.seeds import EVAL
from vla_rl.train.algorithms import ALGORITHMS, Algorithm, get_algorithm
from vla_rl.train.presets import PRESETS, get_preset


@dataclass(kw_only=True)
class PushOptions:
    push: str | None = None
    """Push the final checkpoint to this Hub repo (hub://org/name) as a new commit."""
    tag: str | None = None
    """Tag the pushed commit (with --push)."""
    nproc: int = 1
    """Training processes on this machine (SFT, AWR, RECAP, QAM): N > 1 launches torchrun
    --nproc-per-node N with the same flags (gloo on CPU, NCCL on GPU with one GPU per process); each
    process takes batch-size / N rows of every global batch and rank 0 writes checkpoints, logs and the
    push. For several machines run torchrun yourself (docs/training.md)."""


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _check_nproc(name: str, cfg: Any, nproc: int) -> None:
    """Refuse a process count the trainer cannot use, before anything starts."""
    if nproc < 1:
        raise CliError(f"--nproc: expected a positive integer, got {nproc}")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1) if _under_torchrun() else nproc
    if world > 1 and not getattr(cfg, "distributed", False):
        raise CliError(f"--nproc: the {name} trainer runs in one process (not data-parallel); drop --nproc")
    batch = getattr(cfg, "batch_size", None)
    if world > 1 and batch is not None and batch % world:
        raise CliError(
            f"--batch-size: expected a multiple of the {world} processes (each takes batch-size / "
            f"{world} rows of the global batch), got {batch}"
        )


def _launch_torchrun(name: str, argv: Sequence[str], nproc: int) -> int:
    """Run ``vla-rl train NAME argv`` in ``nproc`` processes under torchrun's agent on this machine
    (rendezvous on 127.0.0.1, a free port); returns 0, or raises a CliError naming the failed rank."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from vla_rl.core.logs import JsonFormatter

    root = logging.getLogger()
    fmt = "json" if any(isinstance(h.formatter, JsonFormatter) for h in root.handlers) else "text"
    level = logging.getLevelName(root.getEffectiveLevel()).lower()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.5,
        local_addr="127.0.0.1",
    )
    args = ["-m", "vla_rl.cli", "--log-level", level, "--log-format", fmt, "train", name, *argv]
    try:
        elastic_launch(config, sys.executable)(*args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        raise CliError(
            f"--nproc {nproc}: training process rank {rank} exited with code {failure.exitcode} "
            "(its error is above); the other processes were stopped"
        ) from None
    except SignalException:  # Ctrl-C / SIGTERM: the agent stopped the workers
        raise KeyboardInterrupt from None
    return 0


def _preset_values(preset: str | None, algo: str) -> dict[str, Any]:
    if preset is None:
        return {}
    with user_errors(ValueError, prefix="--"):
        p = get_preset(preset)
    if p.algorithm != algo:
        raise CliError(f"--preset {preset}: is a recipe for {p.algorithm}, not {algo}")
    return dict(p.values)


def _check_fixed(alg: Algorithm, cfg: Any) -> None:
    for k, v in alg.fixed.items():
        if getattr(cfg, k) != v:
            raise CliError(f"--{k.replace('_', '-')}: the {alg.name} command fixes it to {v}")


def _check_inputs(cfg: Any, push: bool = False) -> None:
    """Fail before any work on what a user most often gets wrong: a base or init run that is not there,
    a Hub that is not reachable or will not take a push."""
    from vla_rl.hub.registry import check_hub, is_hub_ref

    base = getattr(cfg, "base", None)
    if push or (base and is_hub_ref(base)):
        check_hub(write=push)
    if base and not str(base).startswith("hub://") and not Path(base).is_dir():
        raise CliError(f"--base {base}: no such checkpoint folder (or give hub://org/name@rev)")
    init = getattr(cfg, "init_from", None)
    if init is not None and not (Path(init) / "train_state.pt").is_file():
        raise CliError(
            f"--init-from {init}: no train_state.pt there; give the --out folder of an earlier "
            "`vla-rl train qam` run"
        )
    if getattr(cfg, "task", None) and not getattr(cfg, "needs_base", True):
        from sim.registry import sim_task_name

        cfg.task = sim_task_name(cfg.task) or cfg.task  # SFT: any task the store holds (real robot data too)
    elif getattr(cfg, "task", None):
        cfg.task = task_arg(cfg.task)


def _summary(name: str, r: Any) -> str:
    m = r.metrics
    parts = [f"{name}: {r.seconds / 60:.1f} min"]
    if "final_loss" in m:  # SFT reports steps and the first loss; AWR / RECAP only the last
        steps = f"{m['steps']} steps, " if "steps" in m else ""
        first = f"{m['first_loss']:.4f} -> " if "first_loss" in m else ""
        parts.append(f"{steps}loss {first}{m['final_loss']:.4f}")
    if getattr(r, "env_steps", None):
        parts.append(f"{r.env_steps} env steps")
    if r.curve and "rollout_success" in r.curve[0]:
        parts.append(
            f"rollout success {r.curve[0]['rollout_success']:.0%} -> {r.curve[-1]['rollout_success']:.0%}"
        )
    if "eval_success" in m:
        parts.append(f"eval success {m['eval_success']:.0%}")
    return "; ".join(parts) + f"; checkpoint {r.checkpoint}"


def _train_command(name: str) -> Any:
    def run(argv: Sequence[str], prog: str) -> int:
        from vla_rl.hub.checkpoint import CheckpointError
        from vla_rl.train.algorithms import train

        argv = list(argv)
        launch_argv = list(argv)
        nproc_flag = pop_option(launch_argv, "--nproc")  # the workers get the same flags, minus --nproc
        preset = pop_option(argv, "--preset")
        alg = get_algorithm(name)
        cls = alg.config_class()
        wrapper = with_options(f"Train{cls.__name__}", cls, PushOptions)
        values = {**_preset_values(preset, name), **alg.fixed}
        description = f"{alg.summary}. Presets (--preset NAME): {_presets_for(name)}."
        default = partial(wrapper, {"inner": partial(cls, values), "options": PushOptions()})
        parsed = parse(wrapper, argv, prog, description, default)
        cfg = parsed.inner
        _check_fixed(alg, cfg)
        _check_inputs(cfg, push=parsed.options.push is not None)
        nproc = parsed.options.nproc
        _check_nproc(name, cfg, nproc)
        if nproc > 1 and nproc_flag is not None and not _under_torchrun():
            return _launch_torchrun(name, launch_argv, nproc)
        from sim.ray_workers import RayUnavailable

        with user_errors(FileNotFoundError, ValueError, CheckpointError, RayUnavailable):
            result = train(cfg)
        if int(os.environ.get("RANK", "0") or 0) != 0:
            return 0  # rank 0 reports and pushes
        print(_summary(name, result))
        push = parsed.options
        if push.push:
            from vla_rl.hub.registry import parse_ref, push_folder

            ref = parse_ref(push.push)
            sha = push_folder(result.checkpoint, ref.repo_id, message=f"{name}: {cfg.out}", tag=push.tag)
            print(
                f"pushed to hub://{ref.repo_id} commit {sha[:12]}" + (f" tag {push.tag}" if push.tag else "")
            )
        return 0

    return run


def _presets_for(algo: str | None) -> str:
    names = [p.name for p in PRESETS.values() if algo is None or p.algorithm == algo]
    return ", ".join(names) or "none"


# ---------------------------------------------------------------------------- rounds
def round_start(argv: Sequence[str], prog: str) -> int:
    """Run one post-training round (its flags: the algorithm's, plus the round's)."""
    from vla_rl.hub.checkpoint import CheckpointError
    from vla_rl.rounds import RoundCancelled, RoundConfig, RoundError, RoundOptions, queue_round, start_round

    argv = list(argv)
    queue_only = "--queue" in argv
    argv = [a for a in argv if a != "--queue"]
    preset, algo = pop_option(argv, "--preset"), pop_option(argv, "--algo")
    if preset is not None and algo is None:
        with user_errors(ValueError, prefix="--"):
            algo = get_preset(preset).algorithm
    if algo is None:
        if {"-h", "--help"} & set(argv):
            print(f"{ROUND_USAGE}\n\n{ROUND_HELP}")
            return 0
        raise CliError(
            f"--algo: expected one of {', '.join(ALGORITHMS)} (or --preset NAME); see {prog} --help"
        )
    with user_errors(ValueError, prefix="--"):
        alg = get_algorithm(algo)
    cls = alg.config_class()
    wrapper = with_options(f"Round{cls.__name__}", cls, RoundOptions)
    values = {"out": Path("runs/rounds"), **_preset_values(preset, algo), **alg.fixed}
    default = partial(wrapper, {"inner": partial(cls, values), "options": RoundOptions()})
    parsed = parse(wrapper, argv, f"{prog} --algo {algo}", f"{alg.summary}. {ROUND_HELP}", default)
    _check_fixed(alg, parsed.inner)
    _check_inputs(parsed.inner, push=parsed.options.push)
    options = {f.name: getattr(parsed.options, f.name) for f in fields(RoundOptions)}
    with user_errors(
        RoundError,
        ValueError,
        FileNotFoundError,
        CheckpointError,
        suffix=" (the round's row in the DB records the failure: vla-rl round list)",
    ):
        cfg = RoundConfig(train=parsed.inner, preset=preset, **options)
        if queue_only:
            rid = queue_round(cfg)
            print(f"queued round {rid}; a `vla-rl round worker --store {cfg.train.store}` runs it")
            return 0
        try:
            rec = start_round(cfg)
        except RoundCancelled as e:
            print(f"{e} (vla-rl round cancel); its row records it: vla-rl round list", file=sys.stderr)
            return 1
    print(_round_line(rec))
    print(f"gate: {rec.metrics.get('gate', {}).get('reason', '')}")
    return 0


ROUND_USAGE = (
    "usage: vla-rl round start --algo ALGO [--preset NAME] [--queue] --base REF --store PATH [FLAGS]"
)
ROUND_HELP = (
    "Select data from the store + DB, train with ALGO starting from BASE, evaluate the result and the base "
    "on the same simulated seeds, push the checkpoint to the Hub with tag round-N, and move the served ref "
    "(--promote-ref, default prod) to it only if it beats the base by more than --margin and a paired test "
    "on the shared seeds says so at --gate-alpha (a promoted checkpoint's success is then measured again on "
    "--report-episodes seeds the gate did not see). Every round is "
    "recorded in the metadata DB (vla-rl round list|show). With --queue the round is only queued, for a "
    "`vla-rl round worker` to run (vla-rl round cancel N stops it). The flags are the algorithm's own (as for "
    "`vla-rl train ALGO`) plus the round's; `vla-rl round start --algo ALGO --help` lists them.\n\n"
    "algorithms:\n" + "".join(f"  {a.name:<12} {a.summary}\n" for a in ALGORITHMS.values()) + "\n"
    "presets (--preset NAME; --algo follows from it):\n"
    + "".join(f"  {p.name:<24} {p.algorithm}: {p.summary}\n" for p in PRESETS.values())
    + "\n"
    "example:\n  vla-rl round start --algo awr --base hub://fleet/pick@prod --store runs/fleet/store \\\n"
    "      --data 'since=2026-11-01,robot=arm-1|arm-2' --margin 0.05 --steps 1000 --beta 0.5"
)


def _round_line(r: Any) -> str:
    m = r.metrics
    if r.status in ("queued", "running"):
        phase = (r.progress or {}).get("phase", "")
        who = f"worker {r.worker}, attempt {r.attempts}" + (f", {phase}" if phase else "") if r.worker else ""
        return f"round {r.id:>3}  {r.algo:<10} {r.status:<9} {who}"
    if m.get("eval") == "offline":  # real data, no simulator: the gate is on the action MSE
        score = (
            f"action MSE {m['action_mse']:.4f} (base {m['base_action_mse']:.4f}, "
            f"{-m['relative_improvement']:+.1%})"
        )
        if m.get("gate_metric") == "estimated_success":  # ... or on a success estimate from the outcomes
            score = (
                f"estimated success {m['estimated_success']:.0%} (base {m['base_estimated_success']:.0%}, "
                f"{m['estimated_delta']:+.0%}), {score}"
            )
    elif m.get("success") is not None:
        score = f"success {m['success']:.0%} (base {m['base_success']:.0%}, {m['delta']:+.0%})"
        if m.get("reported_success") is not None:  # the promoted checkpoint on seeds the gate did not see
            score += f", held-out {m['reported_success']:.0%}"
    else:
        score = "-"
    flag = "promoted" if r.promoted else ("" if r.status != "succeeded" else "not promoted")
    return f"round {r.id:>3}  {r.algo:<10} {r.status:<9} {score:<38} {flag:<12} {r.checkpoint_ref or ''}"


@dataclass
class RoundList:
    """List rounds with their scores and promotion."""

    store: Path
    """Episode store (its DB holds the rounds)."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file next to the store."""
    task: str | None = None
    """Only this task's rounds."""
    json: bool = False
    """Machine-readable output."""


def round_list(a: RoundList) -> int:
    from vla_rl.cli.common import open_db

    db = open_db(a.store, a.db)
    rounds = db.rounds(task=task_arg(a.task) if a.task else None)
    if a.json:
        print(json.dumps([asdict(r) for r in rounds], indent=2, default=str))
        return 0
    if not rounds:
        print("no rounds yet; start one with: vla-rl round start --algo awr --base REF --store PATH")
    for r in rounds:
        print(_round_line(r))
    return 0


@dataclass
class RoundShow:
    """One round's full record (config, data, metrics, curve) as JSON."""

    round: Positional[int]
    """Round number."""
    store: Path
    """Episode store (its DB holds the rounds)."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file next to the store."""


def round_show(a: RoundShow) -> int:
    from vla_rl.cli.common import open_db

    db = open_db(a.store, a.db)
    r = db.round(a.round)
    if r is None:
        raise CliError(f"no round {a.round} in {db}; list them with: vla-rl round list --store {a.store}")
    print(json.dumps(asdict(r), indent=2, default=str))
    return 0


@dataclass
class RoundCancel:
    """Cancel a round: a queued one at once, a running one at its worker's next heartbeat."""

    round: Positional[int]
    """Round number."""
    store: Path
    """Episode store (its DB holds the rounds)."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file next to the store."""


def round_cancel(a: RoundCancel) -> int:
    from vla_rl.cli.common import open_db

    db = open_db(a.store, a.db)
    with user_errors(KeyError, ValueError, prefix=f"round {a.round}: "):
        rec = db.cancel_round(a.round)
    print(
        _round_line(rec)
        if rec.status == "cancelled"
        else f"round {a.round}: its worker stops it at the next heartbeat"
    )
    return 0


def _worker_args() -> type:
    from vla_rl.round_worker import WorkerConfig

    return WorkerConfig


def round_worker(cfg: Any) -> int:
    from vla_rl.round_worker import run_worker

    n = run_worker(cfg)
    print(f"ran {n} round(s)")
    return 0


# ---------------------------------------------------------------------------- eval / demo
@dataclass
class Eval:
    """Evaluate a checkpoint in simulation: vectorised rollouts with receding-horizon chunk execution;
    success with a 95% Wilson interval and mean episode length; optional videos and a JSON result.
    With --store (needed when the task is no simulator task, e.g. imported real data): offline action
    error against the store's most recent --episodes episodes instead (per-dim / per-task MSE table).
    Example: vla-rl eval --checkpoint runs/push/sft/checkpoints/last --episodes 50 --num-envs 2"""

    checkpoint: str
    """hub://org/name@rev or a checkpoint folder: ours, or a LeRobot SmolVLA / π0 / π0.5 policy folder."""
    task: str | None = None
    """Task; None = the checkpoint's robot spec."""
    episodes: int = 20
    """Episodes to run (with --store: the most recent this many recorded episodes of the task)."""
    store: Path | None = None
    """Evaluate offline on this episode store's recorded episodes (no simulator): a directory, or
    s3://BUCKET/PREFIX (credentials from the environment)."""
    cache_dir: Path | None = None
    """With an s3:// --store: local read cache of closed episodes (None = $VLA_RL_STORE_CACHE, else
    ~/.cache/vla-rl/store; 'off' for none)."""
    cache_max_gb: float | None = None
    """Size limit of that cache: least recently used episodes are evicted beyond it (None =
    $VLA_RL_STORE_CACHE_MAX_GB, else 20)."""
    max_frames: int | None = None
    """Offline: a seeded subsample of this many frames (None = every frame of the episodes)."""
    num_envs: int = 2
    """Simulator processes."""
    ray: str | None = None
    """Run the simulators as Ray actors: 'auto' (this machine's Ray cluster, or a local head on 127.0.0.1)
    or a cluster address host:port; None = local processes. Same seeds, same episodes."""
    seed: int = EVAL
    """First episode seed (evaluations start at 100000; training collects from 1000000 up, :mod:`vla_rl.core.seeds`)."""
    n_exec: int | None = None
    """Actions executed per chunk; None = the checkpoint's."""
    num_steps: int | None = None
    """Denoising steps K; None = the model's."""
    taco: Path | None = None
    """TACO selection (vla_rl/train/taco.py): a folder from `vla-rl taco fit`; each decision samples
    --num-samples chunks and executes the one with the highest pseudo-count. None = one sample."""
    num_samples: int = 8
    """With --taco: chunks sampled per decision (N)."""
    videos: int = 0
    """Save this many rollouts as MP4/GIF."""
    videos_dir: Path = Path("runs/eval_videos")
    """Where videos go."""
    out: Path | None = None
    """Write the results as JSON here."""
    latency: str | None = None
    """Run with latency as a robot feels it (sim/latency.py): the robot keeps executing its action queue
    while a request is in flight. A network delay drawn per episode (const:100ms, uniform:50ms-200ms,
    exp:100ms, exp:100ms:400ms for a cap) or net=DELAY,obs=DELAY (obs: the observation's own lag);
    0 = none but still through the queue. None = the receding-horizon driver (--n-exec)."""
    merge: str = "weighted_average"
    """With --latency: how a new chunk joins the queue: weighted_average, latest_only, temporal_ensemble,
    average, conservative."""
    chunk_size_threshold: float = 0.5
    """With --latency: ask for the next chunk when the queue is down to this share of a chunk."""
    when_starved: str = "still"
    """With --latency: what the robot does when its queue runs dry: still (stands still, gripper kept)
    or hold (repeats its last action)."""
    device: str = "auto"
    """auto (CUDA if present), cpu, cuda, cuda:1, ..."""
    threads: int = 1
    """Torch CPU threads (small policies gain nothing from more; on a busy machine extra threads made
    inference several times slower)."""
    progress: bool = True
    """Show a progress bar."""
    rtc: Literal["auto", "on", "off"] = "auto"
    """Real-time chunking (docs/serving.md). The rollout waits for each chunk (no inference delay to
    hide), so auto = off; on = each chunk continues the unexecuted rest of the robot's previous one."""

    def __post_init__(self) -> None:
        from sim.ray_workers import check_ray_address

        self.ray = check_ray_address(self.ray)

    def latency_options(self) -> Any:
        """The latency world of --latency and its knobs (None without --latency)."""
        if self.latency is None:
            return None
        from sim.latency import LatencyOptions, LatencySpec

        with user_errors(ValueError, prefix="--latency: "):
            spec = LatencySpec.parse(self.latency)
        with user_errors(ValueError, prefix="--latency: "):
            return LatencyOptions(
                spec,
                merge=self.merge,
                chunk_size_threshold=self.chunk_size_threshold,
                when_starved=self.when_starved,  # type: ignore[arg-type]
            )


def eval_(a: Eval) -> int:
    from policies.loading import LoadedPolicy, load_chunk_policy
    from vla_rl.evaluation import evaluate
    from vla_rl.hub.checkpoint import CheckpointError

    if a.threads < 1:
        raise CliError(f"--threads: expected a positive integer, got {a.threads}")
    latency = a.latency_options()
    import torch

    torch.set_num_threads(a.threads)
    from vla_rl.hub.registry import check_hub, is_hub_ref

    if is_hub_ref(a.checkpoint):
        check_hub()
    with user_errors(CheckpointError, FileNotFoundError, ValueError, prefix=f"--checkpoint {a.checkpoint}: "):
        lp = load_chunk_policy(a.checkpoint, device=a.device)  # ours, or a LeRobot flow VLA's folder
        if a.task is None:
            lp.task(None)  # a LeRobot folder from elsewhere names no task: ask for --task, not for --store
    lp.num_steps = a.num_steps
    policy: Any = lp
    if a.taco is not None:
        if not isinstance(lp, LoadedPolicy):
            raise CliError(
                f"--taco: selection scores our FlowVLA checkpoints; {a.checkpoint} is a LeRobot folder"
            )
        from vla_rl.train.taco import taco_policy

        with user_errors(FileNotFoundError, ValueError, prefix="--taco: "):
            policy = taco_policy(lp, a.taco, a.num_samples)
    from vla_rl.evaluation_offline import is_sim_task

    if a.store is not None or not is_sim_task(a.task or lp.spec.name):
        return _eval_offline(a, lp)
    task = task_arg(a.task) if a.task else lp.spec.name
    from sim.ray_workers import RayUnavailable

    with user_errors(RayUnavailable):
        result = evaluate(
            policy,
            task,
            episodes=a.episodes,
            num_envs=a.num_envs,
            seed=a.seed,
            n_exec=a.n_exec,
            video_dir=a.videos_dir,
            num_videos=a.videos,
            progress=a.progress,
            ray=a.ray,
            rtc=a.rtc,
            latency=latency,
        )
    print(result.summary())
    out = {"checkpoint": a.checkpoint, "commit": lp.commit, **result.to_dict()}
    if a.taco is not None:
        out["selection"] = {"taco": str(a.taco), "num_samples": a.num_samples}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2))
        print(f"results: {a.out}")
    for v in result.videos:
        print(f"video: {v}")
    return 0


def _eval_offline(a: Eval, lp: Any) -> int:
    from fleet.store import EpisodeStore
    from vla_rl.evaluation_offline import evaluate_offline, held_out_episodes

    task = a.task or lp.spec.name
    if a.taco is not None:
        raise CliError(
            "--taco: selection runs in simulation only (offline evaluation scores one chunk per frame)"
        )
    if a.store is None:
        raise CliError(
            f"--store: {task!r} is not a simulator task (see vla-rl sim list); "
            "give --store STORE to evaluate offline on its recorded episodes"
        )
    if a.episodes < 1:
        raise CliError(f"--episodes: expected >= 1, got {a.episodes}")
    if a.max_frames is not None and a.max_frames < 1:
        raise CliError(f"--max-frames: expected >= 1, got {a.max_frames}")
    if a.cache_max_gb is not None and not a.cache_max_gb > 0:
        raise CliError(f"--cache-max-gb: expected a size in GB > 0, got {a.cache_max_gb}")
    with user_errors(FileNotFoundError, ValueError, prefix="--store: "):
        store = EpisodeStore(a.store, cache_dir=a.cache_dir, cache_max_gb=a.cache_max_gb)
    metas = [store.read_metadata(e) for e in store.episode_ids()]
    ids = sorted((m.created, m.episode_id) for m in metas if m.task == task and m.is_closed)
    if not ids:
        tasks = sorted({m.task for m in metas})
        raise CliError(
            f"--store {a.store}: no closed episodes of task {task!r} (it holds {tasks}); use --task"
        )
    chosen = held_out_episodes([e for _, e in ids], a.episodes)
    with user_errors(ValueError, prefix=f"--store {a.store}: "):
        result = evaluate_offline(lp, store, chosen, seed=a.seed, max_frames=a.max_frames)
    print(result.table())
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        out = {"checkpoint": a.checkpoint, "commit": lp.commit, "task": task, **result.to_dict()}
        a.out.write_text(json.dumps(out, indent=2))
        print(f"results: {a.out}")
    return 0


def _demo_args() -> type:
    from vla_rl.demo import DemoJobConfig

    return DemoJobConfig


def demo(cfg: Any) -> int:
    """The embedded main job: demos -> store -> SFT -> registry -> eval (see vla_rl.demo)."""
    from vla_rl.cli.data import StoreInfo, StoreVerify, store_info, store_verify
    from vla_rl.demo import run_demo

    res = run_demo(cfg)
    print()
    store_info(StoreInfo(path=res.store))
    print()
    status = store_verify(StoreVerify(path=res.store))
    print()
    print(f"checkpoint  {res.checkpoint_ref} (commit {res.commit[:12]})")
    print(f"expert      {res.demo_success:.0%} success on the demonstrations")
    print(f"policy      {res.eval.summary()}")
    for v in res.eval.videos:
        print(f"video       {v}")
    print(f"total       {res.minutes:.1f} min")
    return status


def _up_args() -> type:
    from vla_rl.up import UpConfig

    return UpConfig


def up(cfg: Any) -> int:
    from vla_rl.core.lifeline import interruptible
    from vla_rl.up import run_up

    # SIGTERM too: `up` stops its children (in order) however it is told to stop
    with interruptible(), user_errors(RuntimeError, ValueError, prefix="up: "):
        rows = run_up(cfg)
    return 0 if all(r["status"] == "succeeded" for r in rows) else 1


@dataclass
class RoundCanary:
    """Decide on the canary: the candidate a round moved to --canary-ref (run it with --promote-ref
    canary) runs on a share of the fleet (`vla-rl serve --canary REF`, `vla-rl fleet sim --canary-share`).
    From the fleet's closed episodes each checkpoint acted in alone since then, a one-sided Fisher test on
    autonomous successes: promote (move --prod-ref to the canary's commit) once both arms have --episodes
    and the canary is better at --alpha, roll back (move --canary-ref to prod's commit) as soon as it is
    worse or when it is not shown better, else wait. Exit 0 promote, 1 rollback, 3 wait."""

    repo: str
    """Hub repo whose refs the fleet follows (org/name)."""
    store: Path
    """Episode store (its DB holds the episodes and rounds)."""
    db: str | None = None
    """Metadata DB URL; None = the SQLite file next to the store."""
    since: float | None = None
    """Count episodes created after this Unix time; None = the end of the round that pushed the canary."""
    alpha: float = 0.05
    """False-promotion rate of the test."""
    episodes: int = 100
    """Closed episodes an arm needs before the canary can be promoted."""
    canary_ref: str = "canary"
    prod_ref: str = "prod"
    json: bool = False
    """Machine-readable output."""


def round_canary(a: RoundCanary) -> int:
    from vla_rl.canary import check_canary
    from vla_rl.cli.common import open_db

    with user_errors(ValueError, prefix="round canary: "):
        d = check_canary(
            open_db(a.store, a.db),
            a.repo,
            since=a.since,
            alpha=a.alpha,
            episodes=a.episodes,
            canary_ref=a.canary_ref,
            prod_ref=a.prod_ref,
        )
    print(json.dumps(d.to_dict(), indent=2) if a.json else f"{d.action}: {d.why}")
    return {"promote": 0, "rollback": 1, "wait": 3}[d.action]


COMMANDS = [
    Command(
        ("up",),
        "the whole improvement loop on this machine (fleet -> rounds -> live swaps), supervised",
        _up_args,
        up,
    ),
    Command(
        ("demo",),
        "run the main job on embedded defaults (demos -> store -> SFT -> registry -> eval)",
        _demo_args,
        demo,
    ),
    *[Command(("train", a.name), a.summary, None, _train_command(a.name)) for a in ALGORITHMS.values()],
    Command(
        ("round", "start"),
        "run one post-training round: train, evaluate vs base, push, promote",
        None,
        round_start,
    ),
    Command(("round", "list"), "list rounds with their scores and promotion", RoundList, round_list),
    Command(("round", "show"), "one round's full record as JSON", RoundShow, round_show),
    Command(
        ("round", "worker"),
        "claim queued rounds from the DB and run them (many may share a queue)",
        _worker_args,
        round_worker,
        config_file=True,
    ),
    Command(("round", "cancel"), "cancel a queued or running round", RoundCancel, round_cancel),
    Command(
        ("round", "canary"),
        "promote or roll back the canary on the live fleet's outcomes",
        RoundCanary,
        round_canary,
    ),
    Command(("eval",), "evaluate a checkpoint in simulation", Eval, eval_),
]
