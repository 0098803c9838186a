"""The ``vla-rl`` command line.

    vla-rl demo                       generate demonstrations and show what the store holds
    vla-rl sim list                   simulated tasks, observation modes and robot specs
    vla-rl sim demos --task T ...     record scripted-expert demonstrations into an episode store
    vla-rl store info PATH            episodes, frames, bytes, per-task success, per-robot interventions
    vla-rl store verify PATH          integrity check (exit code 1 on any inconsistency)
    vla-rl train sft --task T ...     flow-matching SFT on a store's episodes -> checkpoint folders
    vla-rl round start|list|show      post-training rounds: train, evaluate vs base, push, promote
    vla-rl train ppo --base REF ...   PPO fine-tuning in simulation (Flow-Noise / Flow-SDE)
    vla-rl train qam --base REF ...   QAM (Q-learning with adjoint matching), offline and online
    vla-rl eval --checkpoint REF ...  success rate (95% Wilson CI), episode length, videos, JSON
    vla-rl hub serve|push|pull        the embedded Hub-compatible registry and checkpoint transfer
    vla-rl serve --checkpoint REF     gRPC policy server (batching, live swaps)
    vla-rl client act --server ADDR   one chunk from a server for a simulated observation
    vla-rl collect --store PATH       fleet collector: robots stream episodes into a store, exactly once
    vla-rl fleet sim --robots N ...   simulated robots + operator takeovers streaming to a collector

Every command takes ``--log-format json`` for structured logs and ``--help`` for its options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vla_rl import __version__
from vla_rl.console import human_bytes, table
from vla_rl.logs import setup_logging

log = logging.getLogger("vla_rl")

DEFAULT_HUB = "http://127.0.0.1:8808"  # the embedded registry (`vla-rl hub serve`)


class CliError(Exception):
    """A user-facing error: printed as one line with a hint, exit code 2."""


# ---------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def _user_errors(*types: type[Exception], prefix: str = "", suffix: str = "") -> Iterator[None]:
    """Turn the listed exceptions (bad input the user can fix) into one ``CliError`` line: prefix, the
    exception's own message, suffix (usually which flag, or how to fix it)."""
    try:
        yield
    except types as e:
        raise CliError(f"{prefix}{e}{suffix}") from None


def _open_db(store_root: Path, url: str | None) -> Any:
    from fleet.db import MetadataDB

    return MetadataDB(url) if url else MetadataDB.for_store(store_root)


def _open_store(path: Path, create: bool = False, db_url: str | None = None) -> tuple[Any, Any]:
    from fleet.store import EpisodeStore

    with _user_errors(
        FileNotFoundError, ValueError, suffix=f". Create one with: vla-rl sim demos --store {path} ..."
    ):
        EpisodeStore(path, create=create)  # no store: fail here, before a DB file is made in its place
    db = _open_db(path, db_url)
    return EpisodeStore(path, db=db), db


def _task_arg(name: str) -> str:
    """The full task id for a --task value, or a one-line error pointing at `vla-rl sim list`."""
    from sim.registry import resolve_task

    with _user_errors(ValueError, prefix="--task ", suffix=". See: vla-rl sim list"):
        return resolve_task(name).name


# ---------------------------------------------------------------------------- sim
def cmd_sim_list(args: argparse.Namespace) -> int:
    from sim.registry import list_tasks

    tasks = list_tasks()
    if args.json:
        print(json.dumps([t.__dict__ for t in tasks], indent=2))
        return 0
    rows = [
        [
            t.name,
            "state, rgb",
            f"{t.state_dim['state']} / {t.state_dim['rgb']}",
            f"{t.action_dim} (dx, dy, dz, gripper)",
            ", ".join(t.cameras),
            f"{t.control_hz:g} Hz",
            str(t.max_episode_steps),
            t.instruction,
        ]
        for t in tasks
    ]
    header = [
        "task",
        "obs",
        "state dim (state/rgb)",
        "action",
        "cameras (rgb)",
        "rate",
        "steps",
        "instruction",
    ]
    print(table(rows, header))
    print("\nActions are float32 in [-1, 1]; gripper +1 opens, -1 closes. Images are uint8 HxWx3.")
    return 0


def cmd_sim_demos(args: argparse.Namespace) -> int:
    from sim.demos import record_demos

    task = _task_arg(args.task)
    store, _db = _open_store(args.store, create=True, db_url=args.db)
    report = record_demos(
        store,
        task,
        episodes=args.episodes,
        noise=args.noise,
        seed=args.seed,
        obs=args.obs,
        image_size=args.image_size,
        num_envs=args.num_envs,
        max_episode_steps=args.max_steps,
        progress=not args.no_progress,
    )
    print(
        f"recorded {report.episodes} episodes of {report.task} ({report.frames} frames) into {store.root}: "
        f"expert success {report.successes}/{report.episodes} ({report.success_rate:.0%}) "
        f"in {report.seconds:.1f} s"
    )
    return 0


# ---------------------------------------------------------------------------- store
def cmd_store_info(args: argparse.Namespace) -> int:
    store, _db = _open_store(args.path, db_url=args.db)
    info = store.info()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"store     {info['root']}")
    print(f"episodes  {info['episodes']} ({info['open_episodes']} open)")
    print(f"frames    {info['frames']}")
    print(f"on disk   {human_bytes(info['bytes'])}")
    if info["tasks"]:
        rows = []
        for name, t in info["tasks"].items():
            rate = "-" if t["success_rate"] is None else f"{t['success_rate']:.0%}"
            rows.append([name, t["episodes"], t["frames"], f"{t['successes']}/{t['closed']}", rate])
        print()
        print(table(rows, ["task", "episodes", "frames", "successes", "success rate"]))
    if info["robots"]:
        rows = []
        for name, r in info["robots"].items():
            rate = "-" if r["success_rate"] is None else f"{r['success_rate']:.0%}"
            irate = "-" if r["intervention_rate"] is None else f"{r['intervention_rate']:.1%}"
            seg = r["segments"]
            rows.append(
                [
                    name,
                    r["episodes"],
                    r["frames"],
                    f"{r['successes']}/{r['closed']} ({rate})",
                    f"{seg['autonomous']} / {seg['intervention']} / {seg['reset']}",
                    f"{r['episodes_with_intervention']}/{r['episodes']}",
                    irate,
                ]
            )
        print()
        header = ["robot", "episodes", "frames", "success", "segments (auto / interv / reset)"]
        print(table(rows, [*header, "episodes w/ takeover", "intervention rate (frames)"]))
    return 0


def cmd_store_verify(args: argparse.Namespace) -> int:
    store, db = _open_store(args.path, db_url=args.db)
    problems = store.verify(db=None if args.no_db else db)
    n = len(store.episode_ids())
    if problems:
        for p in problems:
            print(f"PROBLEM {p}")
        print(f"{len(problems)} problem(s) in {n} episodes of {store.root}")
        return 1
    print(f"ok: {n} episodes in {store.root} are consistent")
    return 0


def cmd_store_export_lerobot(args: argparse.Namespace) -> int:
    from fleet.lerobot_io import export_lerobot

    store, _db = _open_store(args.path)
    out = export_lerobot(store, args.out, args.repo_id, task=args.task, use_videos=args.videos)
    print(
        f"LeRobot v3 dataset written to {out} (load it with LeRobotDataset({args.repo_id!r}, root={str(out)!r}))"
    )
    return 0


def cmd_store_import_lerobot(args: argparse.Namespace) -> int:
    from fleet.lerobot_io import import_lerobot

    store, db = _open_store(args.store, create=True)
    ids = import_lerobot(args.dataset, store, robot_id=args.robot_id, task=args.task, db=db)
    print(f"imported {len(ids)} episodes into {store.root}")
    return 0


# ---------------------------------------------------------------------------- train / eval
def cmd_train_sft(args: argparse.Namespace) -> int:
    from vla_rl.train.sft import SFTConfig, train_sft

    task = _task_arg(args.task)
    cfg = SFTConfig(
        task=task,
        store=args.store,
        out=args.out,
        success_only=args.success_only,
        max_episodes=args.max_episodes,
        chunk_len=args.chunk_len,
        n_exec=args.n_exec,
        d_model=args.d_model,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        device=args.device,
        checkpoint_every=args.checkpoint_every,
        resume=not args.no_resume,
        progress=not args.no_progress,
        instruction_encoder=args.instruction_encoder,
    )
    with _user_errors(FileNotFoundError, ValueError):
        result = train_sft(cfg)
    print(
        f"trained {result.steps} steps in {result.seconds / 60:.1f} min ({result.samples_per_s:.0f} samples/s): "
        f"loss {result.first_loss:.4f} -> {result.final_loss:.4f}; checkpoint {result.checkpoint}"
    )
    if args.push:
        from vla_rl.hub.registry import parse_ref, push_folder

        ref = parse_ref(args.push)
        sha = push_folder(
            result.checkpoint, ref.repo_id, message=f"sft {task}: {result.steps} steps", tag=args.tag
        )
        print(f"pushed to hub://{ref.repo_id} commit {sha[:12]}" + (f" tag {args.tag}" if args.tag else ""))
    return 0


def cmd_round_start(args: argparse.Namespace) -> int:
    from vla_rl.rounds import RoundConfig, RoundError, parse_overrides, start_round

    with _user_errors(
        RoundError,
        ValueError,
        FileNotFoundError,
        suffix=" (the round's row in the DB records the failure: vla-rl round list)",
    ):
        cfg = RoundConfig(
            algo=args.algo,
            base=args.base,
            store=args.store,
            data=args.data,
            task=_task_arg(args.task) if args.task else None,
            db_url=args.db,
            out=args.out,
            repo=args.repo,
            push=not args.no_push,
            promote_ref=args.promote_ref,
            margin=args.margin,
            eval_episodes=args.eval_episodes,
            eval_envs=args.eval_envs,
            eval_seed=args.eval_seed,
            overrides=parse_overrides(args.set),
            seed=args.seed,
            progress=not args.no_progress,
        )
        rec = start_round(cfg)
    print(_round_line(rec))
    print(f"gate: {rec.metrics.get('gate', {}).get('reason', '')}")
    return 0


def _round_line(r: Any) -> str:
    m = r.metrics
    score = (
        f"success {m['success']:.0%} (base {m['base_success']:.0%}, {m['delta']:+.0%})"
        if "success" in m
        else "-"
    )
    flag = "promoted" if r.promoted else ("" if r.status != "succeeded" else "not promoted")
    return f"round {r.id:>3}  {r.algo:<10} {r.status:<9} {score:<38} {flag:<12} {r.checkpoint_ref or ''}"


def cmd_round_list(args: argparse.Namespace) -> int:
    db = _open_db(args.store, args.db)
    rounds = db.rounds(task=_task_arg(args.task) if args.task else None)
    if args.json:
        from dataclasses import asdict

        print(json.dumps([asdict(r) for r in rounds], indent=2, default=str))
        return 0
    if not rounds:
        print("no rounds yet; start one with: vla-rl round start --algo awr --base REF --store PATH")
    for r in rounds:
        print(_round_line(r))
    return 0


def cmd_round_show(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    db = _open_db(args.store, args.db)
    r = db.round(args.round)
    if r is None:
        raise CliError(
            f"no round {args.round} in {db}; list them with: vla-rl round list --store {args.store}"
        )
    print(json.dumps(asdict(r), indent=2, default=str))
    return 0


def cmd_train_ppo(args: argparse.Namespace) -> int:
    from vla_rl.checkpoint import CheckpointError
    from vla_rl.train.ppo import PPOConfig, train_ppo

    with _user_errors(CheckpointError, FileNotFoundError, ValueError):
        cfg = PPOConfig(
            base=args.base,
            out=args.out,
            task=_task_arg(args.task) if args.task else None,
            method=args.method,
            num_steps=args.num_steps,
            noise_level=args.noise_level,
            sde_steps=args.sde_steps,
            noise_std_range=tuple(args.noise_std) if args.noise_std else None,
            entropy_coef=args.entropy_coef,
            num_envs=args.num_envs,
            env_steps=args.env_steps,
            rollout_steps=args.rollout_steps,
            reward=args.reward,
            gamma=args.gamma,
            gae_lambda=args.gae_lambda,
            advantage=args.advantage,
            group_size=args.group_size,
            update_epochs=args.epochs,
            minibatch_size=args.minibatch_size,
            actor_lr=args.actor_lr,
            critic_lr=args.critic_lr,
            critic=args.critic,
            seed=args.seed,
            device=args.device,
            eval_episodes=args.eval_episodes,
            progress=not args.no_progress,
        )
        result = train_ppo(cfg)
    succ = [r["rollout_success"] for r in result.curve]
    print(
        f"trained {result.env_steps} env steps ({result.episodes} episodes, {result.iterations} iterations) in "
        f"{result.seconds / 60:.1f} min; rollout success {succ[0]:.0%} -> {succ[-1]:.0%}; "
        f"checkpoint {result.checkpoint}"
        + (f"; eval success {result.metrics['eval_success']:.0%}" if "eval_success" in result.metrics else "")
    )
    return 0


def cmd_train_qam(args: argparse.Namespace) -> int:
    from vla_rl.checkpoint import CheckpointError
    from vla_rl.train.qam import QAMConfig, train_qam

    if not args.base.startswith("hub://") and not Path(args.base).is_dir():
        raise CliError(f"--base {args.base}: no such checkpoint folder (or give hub://org/name@rev)")
    if args.init_from is not None and not (args.init_from / "train_state.pt").is_file():
        raise CliError(
            f"--init-from {args.init_from}: no train_state.pt there; give the --out folder of an earlier "
            "`vla-rl train qam` run"
        )
    with _user_errors(FileNotFoundError, ValueError, CheckpointError):
        cfg = QAMConfig(
            base=args.base,
            store=args.store,
            out=args.out,
            task=_task_arg(args.task) if args.task else None,
            data=args.data,
            reward=args.reward,
            gamma=args.gamma,
            inv_temp=args.inv_temp,
            rho=args.rho,
            members=args.members,
            critic_hidden=tuple(args.critic_hidden),
            flow_steps=args.flow_steps,
            train_base=args.train_base,
            batch_size=args.batch_size,
            actor_lr=args.actor_lr,
            critic_lr=args.critic_lr,
            offline_steps=args.offline_steps,
            critic_mc_steps=args.critic_mc_steps,
            critic_warmup=args.critic_warmup,
            max_seconds=args.max_seconds,
            env_steps=args.env_steps,
            utd=args.utd,
            start_online_after=args.start_online_after,
            offline_fraction=args.offline_fraction,
            reanchor_every=args.reanchor_every,
            actor_every=args.actor_every,
            next_action_cache=args.next_action_cache,
            init_from=args.init_from,
            init_reset_actor=args.init_reset_actor,
            num_envs=args.num_envs,
            final_eval_episodes=args.eval_episodes,
            seed=args.seed,
            device=args.device,
            resume=not args.no_resume,
            progress=not args.no_progress,
        )
        result = train_qam(cfg)
    line = (
        f"qam: {result.steps} updates, {result.env_steps} env steps in {result.seconds / 60:.1f} min; "
        f"checkpoint {result.checkpoint}"
    )
    if "eval_success" in result.metrics:
        line += f"; eval success {result.metrics['eval_success']:.0%}"
    print(line)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from vla_rl.checkpoint import CheckpointError
    from vla_rl.evaluation import evaluate
    from vla_rl.policy_loading import load_policy

    if args.threads < 1:
        raise CliError(f"--threads: expected a positive integer, got {args.threads}")
    import torch

    torch.set_num_threads(args.threads)
    with _user_errors(
        CheckpointError, FileNotFoundError, ValueError, prefix=f"--checkpoint {args.checkpoint}: "
    ):
        lp = load_policy(args.checkpoint, device=args.device)
    lp.num_steps = args.num_steps
    task = _task_arg(args.task) if args.task else lp.spec.name
    result = evaluate(
        lp,
        task,
        episodes=args.episodes,
        num_envs=args.num_envs,
        seed=args.seed,
        n_exec=args.n_exec,
        video_dir=args.videos_dir,
        num_videos=args.videos,
        progress=not args.no_progress,
    )
    print(result.summary())
    out = {"checkpoint": args.checkpoint, "commit": lp.commit, **result.to_dict()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))
        print(f"results: {args.out}")
    for v in result.videos:
        print(f"video: {v}")
    return 0


# ---------------------------------------------------------------------------- serving
def cmd_serve(args: argparse.Namespace) -> int:
    from server.policy_server import serve

    follow: bool | str | None = args.follow
    if follow == "self":
        follow = True
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("--tls-cert and --tls-key go together (PEM certificate chain and its private key)")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not path.is_file():
            raise CliError(f"{flag} {path}: no such file")
    serve(
        args.checkpoint,
        follow=follow,
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_wait_us=args.max_wait_us,
        token=args.token or None,
        model_id=args.model_id,
        max_queue=args.max_queue,
        follow_interval_s=args.follow_interval,
        device=args.device,
        adaptive_wait=not args.no_adaptive_wait,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    return 0


def cmd_client_act(args: argparse.Namespace) -> int:
    import numpy as np

    from server.client import PolicyClient, PolicyError
    from sim.registry import make_env

    if args.tls_ca is not None and not args.tls_ca.is_file():
        raise CliError(f"--tls-ca {args.tls_ca}: no such file")
    client = PolicyClient(args.server, timeout_s=args.timeout, tls_ca=args.tls_ca)
    with _user_errors(PolicyError, prefix=f"{args.server}: "):
        info = client.info()
        model = info[args.model_id] if args.model_id else next(iter(info.values()))
        spec = json.loads(model.robot_spec_json)
        task = _task_arg(args.task) if args.task else spec["name"]
        obs_mode = "rgb" if spec.get("cameras") else "state"
        image_size = spec["cameras"][0]["height"] if spec.get("cameras") else 128
        with make_env(task, obs=obs_mode, image_size=image_size) as env:  # type: ignore[arg-type]
            obs, _ = env.reset(seed=args.seed)
        batch_obs = {"state": obs["state"], "cameras": obs["cameras"], "instruction": obs["instruction"]}
        res = client.act(batch_obs, seed=args.seed, model_id=model.model_id)
    np.set_printoptions(precision=3, suppress=True)
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
def cmd_collect(args: argparse.Namespace) -> int:
    from fleet.collector import serve

    robots = {r.strip() for r in args.robots.split(",") if r.strip()} if args.robots else None
    with _user_errors(ValueError, RuntimeError, OSError, prefix="collect: "):
        serve(
            args.store,
            args.db,
            host=args.host,
            port=args.port,
            token=args.token or None,
            fsync=args.fsync,
            chunk_len=args.chunk_len,
            camera_zstd_level=args.camera_zstd_level,
            max_batch_frames=args.max_batch_frames,
            max_pending_bytes=int(args.max_pending_mb * 1024 * 1024),
            store_writers=args.store_writers,
            store_writer_nice=args.store_writer_nice,
            allowed_robots=robots,
            metrics_port=args.metrics_port,
        )
    return 0


def cmd_fleet_sim(args: argparse.Namespace) -> int:
    from sim.fleet_runner import FleetConfig, run_sim_fleet
    from sim.operator import OperatorRules

    if args.robots < 1 or args.episodes < 1:
        raise CliError("--robots and --episodes must be >= 1")
    with _user_errors(ValueError, prefix="operator rules: "):
        rules = OperatorRules(
            stall_steps=args.stall_steps,
            drift_radius=args.drift_radius,
            spot_check_prob=args.spot_check,
            drive_steps=args.drive_steps,
            max_takeovers=args.max_takeovers,
            max_fraction=args.max_fraction,
            noise=args.operator_noise,
        )
    cfg = FleetConfig(
        robots=args.robots,
        server=args.server,
        collector=args.collector,
        task=_task_arg(args.task) if args.task else None,
        episodes=args.episodes,
        seed=args.seed,
        operators=args.operators,
        rules=rules,
        collector_token=args.token or None,
        model_id=args.model_id,
        max_episode_steps=args.max_steps,
        record_dir=str(args.record_dir) if args.record_dir else None,
        robot_prefix=args.robot_prefix,
    )
    with _user_errors(RuntimeError):
        result = run_sim_fleet(cfg, progress=not args.no_progress)
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
def cmd_hub_serve(args: argparse.Namespace) -> int:
    from vla_rl.hub.server import serve

    serve(args.data, host=args.host, port=args.port, token=args.token or None)
    return 0


def cmd_hub_push(args: argparse.Namespace) -> int:
    from vla_rl.hub.registry import push_folder

    sha = push_folder(args.folder, args.repo, message=args.message, tag=args.tag, branch=args.branch)
    print(f"hub://{args.repo}@{sha}" + (f"  (tag {args.tag})" if args.tag else ""))
    return 0


def cmd_hub_pull(args: argparse.Namespace) -> int:
    from vla_rl.checkpoint import load_checkpoint
    from vla_rl.hub.registry import pull

    ckpt = pull(args.ref, cache_dir=args.cache_dir)
    load_checkpoint(ckpt.path)  # verify hashes before telling anyone to use it
    print(f"{ckpt.path}  (commit {ckpt.commit}, hashes verified)")
    return 0


# ---------------------------------------------------------------------------- main job
def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded main job: demos -> store -> SFT -> registry -> eval (see vla_rl.main_job)."""
    from vla_rl.main_job import DemoJobConfig, run_demo

    res = run_demo(
        DemoJobConfig(
            workdir=args.workdir,
            task=args.task,
            demos=args.episodes,
            noise=args.noise,
            steps=args.steps,
            eval_episodes=args.eval_episodes,
            num_envs=args.num_envs,
            seed=args.seed,
            progress=not args.no_progress,
        )
    )
    print()
    cmd_store_info(argparse.Namespace(path=res.store, db=None, json=False))
    print()
    status = cmd_store_verify(argparse.Namespace(path=res.store, db=None, no_db=False))
    print()
    print(f"checkpoint  {res.checkpoint_ref} (commit {res.commit[:12]})")
    print(f"expert      {res.demo_success:.0%} success on the demonstrations")
    print(f"policy      {res.eval.summary()}")
    for v in res.eval.videos:
        print(f"video       {v}")
    print(f"total       {res.minutes:.1f} min")
    return status


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="vla-rl",
        description="Improve robot VLA policies while they are deployed: simulated robots, an episode "
        "store for the fleet's data, flow-matching policies trained with SFT, a Hub-compatible checkpoint "
        "registry, a batched gRPC policy server, and post-training rounds that publish better checkpoints.",
        epilog="Start with `vla-rl demo` (the whole loop at small scale, ~4 min), then "
        "`vla-rl store info runs/demo/store` and `vla-rl eval --checkpoint runs/demo/sft/checkpoints/last`.",
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"vla-rl {__version__}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"], help="json: one object per line")
    p.add_argument(
        "--hub",
        default=os.environ.get("VLA_RL_HUB", DEFAULT_HUB),
        help="Hub endpoint for hub:// refs (env VLA_RL_HUB; default %(default)s, the embedded registry; "
        "https://huggingface.co for the real Hub)",
    )
    p.add_argument("--hub-token", default=None, help="Hub token (env VLA_RL_HUB_TOKEN or HF_TOKEN)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(
        parent: Any, name: str, func: Callable[[argparse.Namespace], int], help_: str, desc: str = ""
    ) -> Any:
        sp = parent.add_parser(name, help=help_, description=desc or help_, formatter_class=fmt)
        sp.set_defaults(func=func)
        return sp

    def demo_options(sp: argparse.ArgumentParser, episodes: int, obs_options: bool = True) -> None:
        sp.add_argument(
            "--episodes", type=int, default=episodes, help="episodes to record (default %(default)s)"
        )
        sp.add_argument(
            "--noise",
            type=float,
            default=0.0,
            help="expert sloppiness in [0, 2]: 0 = clean demos; 0.3 still ~100%% success; "
            "1.0 leaves 15-65%% depending on the task (default %(default)s)",
        )
        sp.add_argument("--seed", type=int, default=0, help="first episode seed (default %(default)s)")
        if obs_options:
            sp.add_argument("--obs", choices=["state", "rgb"], default="state", help="observation mode")
            sp.add_argument("--image-size", type=int, default=128, help="camera height = width in rgb mode")
        sp.add_argument("--num-envs", type=int, default=1, help="simulator processes in parallel")
        sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    d = add(
        sub,
        "demo",
        cmd_demo,
        "run the main job on embedded defaults",
        "One pass of the loop on this machine, nothing to start beforehand: record scripted "
        "demonstrations into a Zarr store + SQLite DB, train a flow-matching policy with SFT, push it as a "
        "tagged checkpoint to an embedded Hub-compatible registry, pull it back by tag and evaluate it in "
        "simulation (with a video). Takes ~4 min on 2 CPU cores. WORKDIR is cleared first.",
    )
    d.add_argument(
        "--workdir", type=Path, default=Path("runs/demo"), help="output folder (default %(default)s)"
    )
    d.add_argument("--task", default="maniskill/PushCube-v1", help="task (default %(default)s)")
    d.add_argument("--steps", type=int, default=1500, help="SFT steps (default %(default)s)")
    d.add_argument("--eval-episodes", type=int, default=20)
    demo_options(d, episodes=30, obs_options=False)
    d.set_defaults(noise=0.3, num_envs=2)

    sim_p = add(sub, "sim", lambda a: (sim_p.print_help(), 0)[1], "simulated robots")
    sim_sub = sim_p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    sl = add(sim_sub, "list", cmd_sim_list, "list simulated tasks with their robot specs")
    sl.add_argument("--json", action="store_true", help="machine-readable output")
    sd = add(
        sim_sub,
        "demos",
        cmd_sim_demos,
        "record scripted-expert demonstrations into an episode store",
        "Run the privileged scripted expert for a task and write every frame (cameras, state, action, "
        "reward, flags, controller=scripted) to a Zarr episode store, with one row per episode in the "
        "metadata DB.\n\nexample:\n  vla-rl sim demos --task PickCube --episodes 50 --noise 0.5 "
        "--store runs/pick/store",
    )
    sd.add_argument("--task", required=True, help="task id or a unique part of it (see `vla-rl sim list`)")
    sd.add_argument("--store", type=Path, required=True, help="episode store directory (created if missing)")
    sd.add_argument("--db", default=None, help="metadata DB URL (default: sqlite file inside the store)")
    sd.add_argument("--max-steps", type=int, default=None, help="episode length limit (default: the task's)")
    demo_options(sd, episodes=10)

    store_p = add(sub, "store", lambda a: (store_p.print_help(), 0)[1], "inspect and check episode stores")
    store_sub = store_p.add_subparsers(dest="store_command", metavar="SUBCOMMAND")
    si = add(
        store_sub,
        "info",
        cmd_store_info,
        "episodes, frames, bytes, per-task success and per-robot segments of a store",
        "Summarise a store: episodes, frames and bytes on disk; success per task; and per robot the "
        "segments (autonomous / intervention / reset), how many episodes had a takeover, the fraction of "
        "frames under intervention, and success.",
    )
    si.add_argument("path", type=Path)
    si.add_argument("--db", default=None, help="metadata DB URL (default: sqlite file inside the store)")
    si.add_argument("--json", action="store_true", help="machine-readable output")
    sv = add(
        store_sub,
        "verify",
        cmd_store_verify,
        "integrity check; exit code 1 on any inconsistency",
        "Check every episode's arrays against its committed length and spec, its controller, segment, "
        "revision and timestamp columns, and (unless --no-db) its row in the metadata DB.",
    )
    sv.add_argument("path", type=Path)
    sv.add_argument("--db", default=None, help="metadata DB URL (default: sqlite file inside the store)")
    sv.add_argument("--no-db", action="store_true", help="check the Zarr store only")
    se = add(
        store_sub,
        "export-lerobot",
        cmd_store_export_lerobot,
        "write episodes as a LeRobot v3 dataset",
        "Export a store's closed episodes (state, action, images, reward, done, success, and controller / "
        "intervention / segment columns) as a LeRobot v3 dataset on local disk.",
    )
    se.add_argument("path", type=Path, help="episode store")
    se.add_argument("out", type=Path, help="new dataset folder (must not exist or be empty)")
    se.add_argument("--repo-id", required=True, help="dataset name, e.g. fleet/pushcube")
    se.add_argument("--task", default=None, help="only this task's episodes")
    se.add_argument("--videos", action="store_true", help="encode cameras as video instead of PNG images")
    sm = add(
        store_sub,
        "import-lerobot",
        cmd_store_import_lerobot,
        "bring a LeRobot v3 dataset into a store",
        "Import a LeRobot v3 dataset from local disk; segments split where the controller (intervention "
        "column) changes; frames without one count as human teleoperation.",
    )
    sm.add_argument("dataset", help="dataset root folder")
    sm.add_argument("store", type=Path, help="episode store (created if missing)")
    sm.add_argument("--robot-id", default="lerobot")
    sm.add_argument("--task", default=None, help="task id to record (default: the dataset's robot type)")

    round_p = add(
        sub,
        "round",
        lambda a: (round_p.print_help(), 0)[1],
        "post-training rounds: train on fleet data, evaluate, push, promote",
    )
    round_sub = round_p.add_subparsers(dest="round_command", metavar="SUBCOMMAND")
    rs = add(
        round_sub,
        "start",
        cmd_round_start,
        "run one post-training round",
        "Select data from the store + DB, train with ALGO starting from BASE, evaluate the result and the "
        "base on the same simulated seeds, push the checkpoint to the Hub with tag round-N, and move the "
        "served ref (--promote-ref, default prod) to it only if it beats the base by more than --margin. "
        "Every round is recorded in the metadata DB (vla-rl round list|show).\n\n"
        "algorithms: sft (retrain on the selection), awr (advantage-weighted flow matching), recap "
        "(advantage-conditioned, RECAP), qam (Q-learning with adjoint matching), flow-noise / flow-sde "
        "(π-RL noise injection + PPO in simulation).\n\n"
        "example:\n  vla-rl round start --algo awr --base hub://fleet/pick@prod --store runs/fleet/store \\\n"
        "      --data 'since=2026-11-01,robot=arm-1|arm-2' --margin 0.05 --set steps=1000 --set beta=0.5",
    )
    rs.add_argument("--algo", required=True, choices=["sft", "awr", "recap", "qam", "flow-noise", "flow-sde"])
    rs.add_argument("--base", required=True, help="checkpoint to improve: hub://org/name@rev or a folder")
    rs.add_argument("--store", type=Path, required=True, help="episode store with the experience")
    rs.add_argument(
        "--data",
        default=None,
        help="data selection: comma-separated key=value with | between alternatives; keys robot, since, "
        "until (unix or ISO date), revision, round, success, max, label.<name> (default: all episodes)",
    )
    rs.add_argument("--task", default=None, help="task (default: the base checkpoint's)")
    rs.add_argument("--db", default=None, help="metadata DB URL (default: sqlite next to the store)")
    rs.add_argument("--out", type=Path, default=Path("runs/rounds"), help="work folder (default %(default)s)")
    rs.add_argument("--repo", default=None, help="Hub repo to push to (default: the base ref's repo)")
    rs.add_argument("--no-push", action="store_true", help="keep the checkpoint local (no promotion)")
    rs.add_argument("--promote-ref", default="prod", help="ref that servers follow (default %(default)s)")
    rs.add_argument(
        "--margin",
        type=float,
        default=0.0,
        help="promote only if success beats the base's by more than this fraction (default %(default)s)",
    )
    rs.add_argument("--eval-episodes", type=int, default=50, help="evaluation episodes for both checkpoints")
    rs.add_argument("--eval-envs", type=int, default=2, help="simulator processes for evaluation")
    rs.add_argument("--eval-seed", type=int, default=100_000, help="first evaluation seed")
    rs.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="algorithm hyper-parameter (repeatable; JSON values), e.g. --set steps=1000 --set beta=0.5",
    )
    rs.add_argument("--seed", type=int, default=0)
    rs.add_argument("--no-progress", action="store_true")
    for name, func, help_ in (
        ("list", cmd_round_list, "list rounds with their scores and promotion"),
        ("show", cmd_round_show, "one round's full record (config, data, metrics, curve) as JSON"),
    ):
        rp = add(round_sub, name, func, help_)
        if name == "show":
            rp.add_argument("round", type=int, help="round number")
        rp.add_argument("--store", type=Path, required=True, help="episode store (its DB holds the rounds)")
        rp.add_argument("--db", default=None, help="metadata DB URL (default: sqlite next to the store)")
        if name == "list":
            rp.add_argument("--task", default=None)
            rp.add_argument("--json", action="store_true")

    train_p = add(sub, "train", lambda a: (train_p.print_help(), 0)[1], "train policies")
    train_sub = train_p.add_subparsers(dest="train_command", metavar="SUBCOMMAND")
    ts = add(
        train_sub,
        "sft",
        cmd_train_sft,
        "supervised flow-matching training on demonstrations",
        "Train a flow-matching VLA on a store's episodes of one task: AdamW, warmup + cosine, EMA, grad "
        "clipping, bf16 on CUDA. Writes checkpoints to OUT/checkpoints (last = OUT/checkpoints/last), "
        "TensorBoard logs to OUT/tb, and resumes exactly from OUT/train_state.pt when re-run.\n\n"
        "example:\n  vla-rl train sft --task PushCube --store runs/push/store --out runs/push/sft --steps 3000",
    )
    ts.add_argument("--task", required=True, help="task id or a unique part of it")
    ts.add_argument("--store", type=Path, required=True, help="episode store with demonstrations")
    ts.add_argument("--out", type=Path, required=True, help="run folder (checkpoints, logs, train state)")
    ts.add_argument("--steps", type=int, default=3000, help="optimiser steps (default %(default)s)")
    ts.add_argument("--batch-size", type=int, default=128)
    ts.add_argument("--lr", type=float, default=3e-4)
    ts.add_argument("--seed", type=int, default=0)
    ts.add_argument("--chunk-len", type=int, default=10, help="actions per chunk H (default %(default)s)")
    ts.add_argument("--n-exec", type=int, default=5, help="actions executed per chunk (default %(default)s)")
    ts.add_argument("--d-model", type=int, default=128, help="transformer width (default %(default)s)")
    ts.add_argument("--instruction-encoder", choices=["minilm", "none"], default="minilm")
    ts.add_argument("--success-only", action="store_true", help="train on successful episodes only")
    ts.add_argument("--max-episodes", type=int, default=None, help="use at most N episodes (oldest first)")
    ts.add_argument("--checkpoint-every", type=int, default=1000)
    ts.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1, ...")
    ts.add_argument("--no-resume", action="store_true", help="start over even if OUT has a train state")
    ts.add_argument("--push", default=None, metavar="hub://org/name", help="push the final checkpoint there")
    ts.add_argument("--tag", default=None, help="tag the pushed commit (with --push)")
    ts.add_argument("--no-progress", action="store_true")

    tp = add(
        train_sub,
        "ppo",
        cmd_train_ppo,
        "PPO fine-tuning in simulation with noise injected into the flow (π_RL Flow-Noise / Flow-SDE)",
        "Start from a flow_vla checkpoint and fine-tune it with PPO in the vectorised simulator. The RL "
        "action is the executed sub-chunk; its log-likelihood comes from noise injected into the "
        "denoising chain: 'noise' learns a bounded per-step std on every step, 'sde' makes one random "
        "step an SDE step. Writes OUT/checkpoints/last (lineage: flow-noise|flow-sde, parent = base "
        "commit), OUT/curve.json and TensorBoard logs in OUT/tb.\n\n"
        "example:\n  vla-rl train ppo --base runs/pick/sft/checkpoints/last --out runs/pick/ppo "
        "--method noise --env-steps 30000",
    )
    tp.add_argument("--base", required=True, help="checkpoint to start from: hub://org/name@rev or a folder")
    tp.add_argument("--out", type=Path, required=True, help="run folder (checkpoints, curve, logs)")
    tp.add_argument("--task", default=None, help="task (default: the checkpoint's robot spec)")
    tp.add_argument("--method", choices=["noise", "sde"], default="noise", help="default %(default)s")
    tp.add_argument("--num-steps", type=int, default=4, help="denoising steps K during RL (default 4)")
    tp.add_argument("--noise-level", type=float, default=0.5, help="Flow-SDE noise level a (default 0.5)")
    tp.add_argument(
        "--sde-steps",
        choices=["one", "all"],
        default="one",
        help="Flow-SDE: 'one' random SDE step per call (pi-RL) or 'all' steps (exact chain log-prob)",
    )
    tp.add_argument(
        "--noise-std",
        type=float,
        nargs=2,
        default=None,
        metavar=("MIN", "MAX"),
        help="Flow-Noise std bounds (default: the checkpoint's, 0.08 0.16)",
    )
    tp.add_argument("--entropy-coef", type=float, default=0.005)
    tp.add_argument("--num-envs", type=int, default=4, help="simulator processes (default 4)")
    tp.add_argument("--env-steps", type=int, default=50_000, help="env-step budget (default 50000)")
    tp.add_argument("--rollout-steps", type=int, default=400, help="vector steps per iteration")
    tp.add_argument(
        "--reward",
        choices=["sparse", "dense"],
        default="dense",
        help="sparse success, or success + potential shaping by the sim's dense reward (default)",
    )
    tp.add_argument("--gamma", type=float, default=0.99)
    tp.add_argument("--gae-lambda", type=float, default=0.95)
    tp.add_argument(
        "--advantage",
        choices=["gae", "grpo"],
        default="gae",
        help="gae (critic) or grpo (success standardised over --group-size replays of each start)",
    )
    tp.add_argument("--group-size", type=int, default=8, help="GRPO episodes per initial state")
    tp.add_argument("--epochs", type=int, default=4, help="PPO epochs per iteration")
    tp.add_argument("--minibatch-size", type=int, default=160, help="chunks per gradient step")
    tp.add_argument("--actor-lr", type=float, default=3e-6, help="3e-6 worked for sde; try ~1e-6 for noise")
    tp.add_argument("--critic-lr", type=float, default=3e-4)
    tp.add_argument("--critic", choices=["state", "prefix"], default="state", help="value head input")
    tp.add_argument("--eval-episodes", type=int, default=0, help="evaluate the result (seeds from 100000)")
    tp.add_argument("--seed", type=int, default=0)
    tp.add_argument("--device", default="auto")
    tp.add_argument("--no-progress", action="store_true")

    tq = add(
        train_sub,
        "qam",
        cmd_train_qam,
        "Q-learning with adjoint matching from a base checkpoint (offline, then optionally online)",
        "QAM (algorithms.md section 2): a chunked critic ensemble trained by n-step TD, and a fine copy of "
        "the base flow policy trained by adjoint matching toward base * exp(inv_temp * Q). Offline updates "
        "on the store's episodes, then --env-steps of online rollouts in simulation appended to the replay. "
        "Writes OUT/checkpoints/last (lineage algorithm qam), OUT/tb and OUT/curve.json; resumes from "
        "OUT/train_state.pt.\n\n"
        "example:\n  vla-rl train qam --base runs/pick/sft/checkpoints/last --store runs/pick/store "
        "--out runs/pick/qam --critic-mc-steps 1000 --critic-warmup 2000 --offline-steps 3000 "
        "--inv-temp 10 --env-steps 10000 --utd 0.1",
    )
    tq.add_argument("--base", required=True, help="base (SFT) checkpoint: hub://org/name@rev or a folder")
    tq.add_argument("--store", type=Path, required=True, help="episode store with the offline data")
    tq.add_argument("--out", type=Path, required=True, help="run folder (checkpoints, logs, train state)")
    tq.add_argument("--task", default=None, help="task id (default: the base checkpoint's)")
    tq.add_argument(
        "--data", default=None, help="data selection, e.g. 'robot=arm-1,since=2026-11-01,max=200'"
    )
    tq.add_argument(
        "--reward",
        choices=["steps_to_go", "sparse", "dense", "shaped"],
        default="steps_to_go",
        help="reward relabelling (default %(default)s; shaped = success + potential-based dense shaping)",
    )
    tq.add_argument("--gamma", type=float, default=0.99)
    tq.add_argument(
        "--inv-temp", type=float, default=10.0, help="lambda: target base*exp(lambda*Q) (default %(default)s)"
    )
    tq.add_argument("--rho", type=float, default=0.5, help="ensemble pessimism (mean - rho*std)")
    tq.add_argument("--members", type=int, default=10, help="critic ensemble size")
    tq.add_argument("--critic-hidden", type=int, nargs="+", default=[512, 512, 512, 512])
    tq.add_argument("--flow-steps", type=int, default=10, help="denoising steps K (default %(default)s)")
    tq.add_argument("--train-base", action="store_true", help="keep training the behaviour flow (L_BC)")
    tq.add_argument("--batch-size", type=int, default=256)
    tq.add_argument("--actor-lr", type=float, default=3e-5)
    tq.add_argument("--critic-lr", type=float, default=3e-4)
    tq.add_argument(
        "--offline-steps", type=int, default=3000, help="updates on the offline data, warm-up included"
    )
    tq.add_argument(
        "--critic-mc-steps",
        type=int,
        default=1000,
        help="first updates fit Q to Monte-Carlo returns (cheap critic warm start; default %(default)s)",
    )
    tq.add_argument(
        "--critic-warmup",
        type=int,
        default=2000,
        help="updates before the actor starts following the critic (default %(default)s)",
    )
    tq.add_argument("--max-seconds", type=float, default=None, help="wall-clock budget; stops and saves")
    tq.add_argument("--env-steps", type=int, default=0, help="online env-step budget (0 = offline only)")
    tq.add_argument("--utd", type=float, default=1.0, help="updates per env step online")
    tq.add_argument(
        "--offline-fraction",
        type=float,
        default=None,
        help="online: share of each batch from the offline data (0.5 = RLPD; default: uniform replay)",
    )
    tq.add_argument(
        "--reanchor-every",
        type=int,
        default=0,
        help="online: make the fine policy the prior at the first online update and every N online "
        "updates after (keeps the offline gain when on-policy TD flattens the critic; default 0 = never)",
    )
    tq.add_argument(
        "--actor-every",
        type=int,
        default=1,
        help="train the actor on every N-th update after the warm-up, the critic on all (default 1)",
    )
    tq.add_argument(
        "--next-action-cache",
        type=int,
        default=0,
        help="sample the TD target's next chunks for the whole replay every N updates and look them up "
        "(~10x cheaper critic updates on CPU, so a high --utd is affordable; default 0 = per batch)",
    )
    tq.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from another QAM run's OUT folder (critic, policies, counters, online episodes); "
        "budgets are totals, e.g. --offline-steps = its step then --env-steps N goes straight online",
    )
    tq.add_argument(
        "--init-reset-actor",
        action="store_true",
        help="with --init-from: keep its critic, restart the fine policy from --base (re-extraction)",
    )
    tq.add_argument("--start-online-after", type=int, default=0, help="env steps before online updates")
    tq.add_argument("--num-envs", type=int, default=2, help="simulator processes online")
    tq.add_argument("--eval-episodes", type=int, default=0, help="final evaluation episodes (0 = none)")
    tq.add_argument("--seed", type=int, default=0)
    tq.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, ...")
    tq.add_argument("--no-resume", action="store_true", help="start over even if OUT has a train state")
    tq.add_argument("--no-progress", action="store_true")

    ev = add(
        sub,
        "eval",
        cmd_eval,
        "evaluate a checkpoint in simulation",
        "Vectorised sim rollouts with receding-horizon chunk execution. Reports success with a 95% Wilson "
        "interval and mean episode length; optionally saves rollout videos and a JSON result.\n\n"
        "example:\n  vla-rl eval --checkpoint runs/push/sft/checkpoints/last --episodes 50 --num-envs 2",
    )
    ev.add_argument("--checkpoint", required=True, help="hub://org/name@rev or a checkpoint folder")
    ev.add_argument("--task", default=None, help="task (default: the checkpoint's robot spec)")
    ev.add_argument("--episodes", type=int, default=20)
    ev.add_argument("--num-envs", type=int, default=2, help="simulator processes")
    ev.add_argument("--seed", type=int, default=100_000, help="first episode seed (default %(default)s)")
    ev.add_argument("--n-exec", type=int, default=None, help="actions executed per chunk (default H/2)")
    ev.add_argument("--num-steps", type=int, default=None, help="denoising steps K (default: the model's)")
    ev.add_argument("--videos", type=int, default=0, help="save this many rollouts as MP4/GIF")
    ev.add_argument("--videos-dir", type=Path, default=Path("runs/eval_videos"))
    ev.add_argument("--out", type=Path, default=None, help="write results JSON here")
    ev.add_argument("--device", default="auto")
    ev.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: small policies gain nothing from more, and on a busy "
        "machine extra threads made inference 4x slower)",
    )
    ev.add_argument("--no-progress", action="store_true")

    sv_p = add(
        sub,
        "serve",
        cmd_serve,
        "serve action chunks over gRPC (batched, hot-swappable)",
        "Serve a checkpoint to many robots: dynamic batching across clients, bounded queue "
        "(RESOURCE_EXHAUSTED when full), deadlines, health + reflection, and live checkpoint swaps "
        "(LoadCheckpoint / Promote / Rollback with the token, or --follow a moving ref such as "
        "hub://org/name@prod). --checkpoint may also be a LeRobot policy folder (config.json with a "
        '"type", e.g. ACT or Diffusion, saved by save_pretrained with its processors). '
        "Binds 127.0.0.1 unless told otherwise; --tls-cert/--tls-key serve over TLS.\n\n"
        "examples:\n  vla-rl serve --checkpoint hub://fleet/push@prod --follow self --token $TOKEN\n"
        "  vla-rl serve --checkpoint outputs/train/act_so100/checkpoints/last/pretrained_model",
    )
    sv_p.add_argument("--checkpoint", required=True, help="hub://org/name@rev or a checkpoint folder")
    sv_p.add_argument(
        "--follow", default=None, help="a ref to follow for new revisions ('self' = --checkpoint)"
    )
    sv_p.add_argument("--follow-interval", type=float, default=30.0, help="seconds between ref polls")
    sv_p.add_argument("--host", default="127.0.0.1")
    sv_p.add_argument("--port", type=int, default=50061)
    sv_p.add_argument("--max-batch", type=int, default=16, help="largest batch per forward pass")
    sv_p.add_argument(
        "--max-wait-us", type=int, default=2000, help="longest a batch waits to fill (default %(default)s)"
    )
    sv_p.add_argument(
        "--no-adaptive-wait",
        action="store_true",
        help="always wait --max-wait-us for a batch to fill, even when every active robot is already in it",
    )
    sv_p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve over TLS")
    sv_p.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    sv_p.add_argument("--max-queue", type=int, default=256, help="queued requests before RESOURCE_EXHAUSTED")
    sv_p.add_argument("--model-id", default="default")
    sv_p.add_argument("--token", default=os.environ.get("VLA_RL_SERVER_TOKEN"), help="enables control calls")
    sv_p.add_argument("--device", default="auto")

    co = add(
        sub,
        "collect",
        cmd_collect,
        "run the fleet collector (robots stream episodes into a store)",
        "Receive frames, segments (autonomous / intervention / reset, with who was in control and why) and "
        "episode outcomes from many robots over gRPC (fleet/proto/collector.proto) and write them into an "
        "episode store + metadata DB. A message is acknowledged once it is durable (in the store's "
        "write-ahead log; with --fsync, on disk); robots resend what is not acknowledged after a reconnect "
        "and duplicates are dropped, so every frame is stored exactly once, across collector restarts too. "
        "Bad frames are refused with a message naming the field. Per-robot counters in Prometheus format "
        "on --metrics-port (/metrics) and through the GetStats call.\n\n"
        "example:\n  vla-rl collect --store runs/fleet/store --port 50071 --token $VLA_RL_COLLECTOR_TOKEN "
        "--metrics-port 9171",
    )
    co.add_argument("--store", type=Path, required=True, help="episode store directory (created if missing)")
    co.add_argument("--db", default=None, help="metadata DB URL (default: sqlite file inside the store)")
    co.add_argument("--host", default="127.0.0.1", help="bind address (anything but loopback needs --token)")
    co.add_argument("--port", type=int, default=50071, help="gRPC port (0 = any free port; printed on start)")
    co.add_argument(
        "--token",
        default=os.environ.get("VLA_RL_COLLECTOR_TOKEN"),
        help="robots must send it (env VLA_RL_COLLECTOR_TOKEN)",
    )
    co.add_argument(
        "--fsync", action="store_true", help="fsync every acknowledged message (power-loss safe, slower)"
    )
    co.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    co.add_argument("--robots", default=None, help="comma-separated robot ids to accept (default: any)")
    co.add_argument("--chunk-len", type=int, default=128, help="frames per Zarr chunk (default %(default)s)")
    co.add_argument(
        "--camera-zstd-level",
        type=int,
        default=-3,
        help="zstd level of camera arrays (default %(default)s: fast; 1 or 3 = ~10-20%% smaller, 1.5-3x the CPU)",
    )
    co.add_argument("--max-batch-frames", type=int, default=64, help="largest FrameBatch accepted")
    co.add_argument(
        "--max-pending-mb",
        type=float,
        default=1024,
        help="frame MB waiting for the store before robots are slowed",
    )
    co.add_argument(
        "--store-writers",
        type=int,
        default=1,
        help="processes writing the logged frames into Zarr, beside the one taking messages (default "
        "%(default)s; 0 = a thread in the collector's process, which then shares its one core)",
    )
    co.add_argument(
        "--store-writer-nice",
        type=int,
        default=10,
        help="how much lower the store writers' CPU priority is (0-19, default %(default)s): on busy "
        "cores the intake and its acks go first; the log absorbs the writers' lag",
    )

    fl_p = add(sub, "fleet", lambda a: (fl_p.print_help(), 0)[1], "simulated robot fleets")
    fl_sub = fl_p.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND")
    fs = add(
        fl_sub,
        "sim",
        cmd_fleet_sim,
        "N simulated robots acting through a policy server, streaming to a collector",
        "Run N simulated robots (one process each) that get action chunks from the policy server and stream "
        "every frame, segment and outcome to the collector. A simulated operator (the task's privileged "
        "scripted expert) watches them and takes over when the policy stalls (no progress for --stall-steps), "
        "drifts (gripper farther than --drift-radius from the object) or at random (--spot-check), drives "
        "for --drive-steps and hands back, within a budget per episode (--max-takeovers, --max-fraction). "
        "--operators robots can be driven at once (default 1: one teleoperator watching the whole fleet). "
        "Episode outcomes and intervention rates are reported live; a per-robot table at the end.\n\n"
        "example:\n  vla-rl fleet sim --robots 4 --episodes 20 --server 127.0.0.1:50061 "
        "--collector 127.0.0.1:50071",
    )
    fs.add_argument("--robots", type=int, default=4, help="simulated robots (processes)")
    fs.add_argument("--episodes", type=int, default=5, help="episodes per robot")
    fs.add_argument("--task", default=None, help="task (default: the served model's robot spec)")
    fs.add_argument("--server", default="127.0.0.1:50061", help="policy server address")
    fs.add_argument("--collector", default="127.0.0.1:50071", help="collector address")
    fs.add_argument("--token", default=os.environ.get("VLA_RL_COLLECTOR_TOKEN"), help="collector token")
    fs.add_argument("--model-id", default="", help="served model (default: the only one)")
    fs.add_argument("--seed", type=int, default=0)
    fs.add_argument("--max-steps", type=int, default=None, help="episode step limit (default: the task's)")
    fs.add_argument("--operators", type=int, default=1, help="robots the operator can drive at once")
    fs.add_argument(
        "--stall-steps", type=int, default=8, help="take over after N steps without progress (0 = off)"
    )
    fs.add_argument(
        "--drift-radius",
        type=float,
        default=0.3,
        help="take over when the gripper is this far (m) from the object",
    )
    fs.add_argument("--spot-check", type=float, default=0.0, help="chance per step of a random takeover")
    fs.add_argument("--drive-steps", type=int, default=15, help="steps per takeover (0 = to the end)")
    fs.add_argument("--max-takeovers", type=int, default=3, help="per episode")
    fs.add_argument(
        "--max-fraction", type=float, default=0.5, help="of an episode's steps under operator control"
    )
    fs.add_argument("--operator-noise", type=float, default=0.0, help="operator sloppiness (expert noise)")
    fs.add_argument(
        "--record-dir", type=Path, default=None, help="write what each robot did, frame by frame (JSON lines)"
    )
    fs.add_argument("--robot-prefix", default="sim", help="robot ids are PREFIX-0, PREFIX-1, ...")
    fs.add_argument("--no-progress", action="store_true")

    cl_p = add(sub, "client", lambda a: (cl_p.print_help(), 0)[1], "talk to a policy server")
    cl_sub = cl_p.add_subparsers(dest="client_command", metavar="SUBCOMMAND")
    ca = add(
        cl_sub,
        "act",
        cmd_client_act,
        "one action chunk for a simulated observation (a quick check)",
        "Reset the task's simulator, send its first observation to the server, print the chunk and timing.",
    )
    ca.add_argument("--server", default="127.0.0.1:50061")
    ca.add_argument("--task", default=None, help="task (default: the served model's robot spec)")
    ca.add_argument("--model-id", default="")
    ca.add_argument("--seed", type=int, default=0)
    ca.add_argument("--timeout", type=float, default=10.0)
    ca.add_argument("--tls-ca", type=Path, default=None, help="PEM root certificate(s): connect over TLS")

    hub_p = add(sub, "hub", lambda a: (hub_p.print_help(), 0)[1], "checkpoint registry (Hub-compatible)")
    hub_sub = hub_p.add_subparsers(dest="hub_command", metavar="SUBCOMMAND")
    hs = add(
        hub_sub,
        "serve",
        cmd_hub_serve,
        "run the embedded Hub-compatible registry",
        "Serve model repos stored under --data with the Hugging Face Hub's HTTP API, so the real "
        "huggingface_hub client pushes and pulls checkpoints here. Writes need the token when one is set "
        "(--token or VLA_RL_HUB_TOKEN). Binds 127.0.0.1 unless told otherwise.",
    )
    hs.add_argument("--data", type=Path, default=Path("runs/hub"), help="repository storage folder")
    hs.add_argument("--host", default="127.0.0.1")
    hs.add_argument("--port", type=int, default=8808)
    hs.add_argument("--token", default=os.environ.get("VLA_RL_HUB_TOKEN"), help="write token")
    hp = add(hub_sub, "push", cmd_hub_push, "push a checkpoint folder as a commit (and tag)")
    hp.add_argument("folder", type=Path)
    hp.add_argument("--repo", required=True, help="org/name")
    hp.add_argument("--tag", default=None)
    hp.add_argument("--branch", default="main")
    hp.add_argument("--message", default="upload checkpoint")
    hl = add(hub_sub, "pull", cmd_hub_pull, "download a checkpoint by ref and verify its hashes")
    hl.add_argument("ref", help="hub://org/name@rev (branch, tag or commit)")
    hl.add_argument("--cache-dir", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    from vla_rl.hub.registry import configure_hub

    # Before anything imports huggingface_hub (lerobot, transformers): it reads these at import.
    configure_hub(
        args.hub, args.hub_token or os.environ.get("VLA_RL_HUB_TOKEN") or os.environ.get("HF_TOKEN")
    )
    try:
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
