"""Check and measure the "GPU when present" paths in one run: serving, inference, training steps.

Made for one short run on a GPU machine that has torch but not our environment (the extra packages
travel as wheels), and runnable on CPU here (``--device cpu --quick``) to test the script itself.
Each section is timed and wrapped: a failure is recorded with its traceback and the rest still runs.

1. **serve**: ``vla-rl serve`` (``python -m vla_rl.cli``) in its own process on the device, following a
   local checkpoint folder (``--follow self``), with a randomly initialised default-size flow VLA
   (one 224x224 camera + 6-d state, K=10, random normalisation stats). Served chunks must equal the
   CPU policy's for the same seed (device-placement bugs); then 1/4/16 closed-loop streaming clients
   (bench/serve.py's load generator): chunks/s, p50/p99 latency, the server's forward time; then a live
   swap (the followed folder gets new weights) while 4 clients stream: no failed request, both
   commits served, the new answers match the new weights.
2. **inference**: bench/inference.py's measurement, K in {1,5,10}, batch in {1,16,64}.
3. **train**: SFT (``train_sft`` on a kinematic-sim camera store) and QAM (``train_qam`` offline, from
   that SFT checkpoint) end to end on the device; one PPO update (``_update`` on sampled chunks, Flow-Noise
   and Flow-SDE) and one QAM learner update at realistic sizes, timed on the device and on the CPU.
   Every update must give finite losses and change the parameters.

    python bench/gpu_check.py --device cuda [--out $OUT/gpu_check.json]
    nice -n 19 .venv/bin/python bench/gpu_check.py --device cpu --quick --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vla_rl_client.policy_client import PolicyClient
from vla_rl_client.spec import CameraSpec, RobotSpec

from bench import inference
from bench.common import table, write_results
from bench.serve import SPEC, free_port, obs, our_client, run_clients, wait_until_serving
from policies.flow_vla import FlowVLAConfig, FlowVLAPolicy, compute_normalization_stats
from policies.loading import load_policy
from server.slots import ServedVersion, initial_noise
from vla_rl.hub.checkpoint import CARD_FILE, WEIGHTS_FILE, CheckpointInfo, Lineage, save_checkpoint

ROOT = Path(__file__).resolve().parent.parent

TOKEN = "gpu-check-token"
TOL = 1e-3  # env-unit actions, device vs CPU (float32; TF32 convolutions can cost ~1e-4)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in module.parameters()])


# ------------------------------------------------------------------------------------------------ 1. serve
def save_random_checkpoint(folder: Path, seed: int) -> Path:
    """Default-size flow VLA for bench/serve.py's SPEC (224x224 camera), random weights and stats."""
    rng = np.random.default_rng(seed)
    stats = compute_normalization_stats(
        rng.normal(size=(500, SPEC.state_dim)), rng.uniform(-2, 2, size=(500, SPEC.action_dim))
    )
    cfg = FlowVLAConfig.from_robot_spec(
        SPEC, instruction_encoder="none", num_inference_steps=10, normalization_stats=stats
    )
    torch.manual_seed(seed)
    info = CheckpointInfo("flow_vla", cfg.to_dict(), SPEC, stats, Lineage("gpu-check"))
    save_checkpoint(folder, FlowVLAPolicy(cfg).state_dict(), info)
    return folder


@contextlib.contextmanager
def cli_server(checkpoint: Path, device: str, threads: int, log_path: Path) -> Iterator[str]:
    """``vla-rl serve`` (as ``python -m vla_rl.cli``) following ``checkpoint``; stopped with SIGINT."""
    port = free_port()
    cmd = [sys.executable, "-m", "vla_rl.cli", "serve", "--checkpoint", str(checkpoint)]
    cmd += ["--follow", "self", "--follow-interval", "0.5", "--device", device, "--port", str(port)]
    cmd += ["--model-id", "flow", "--max-batch", "16"]
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": path, "VLA_RL_SERVER_TOKEN": TOKEN}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_until_serving(address, proc, 180, lambda: log_path.read_text()[-3000:])
        yield address
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def reference_chunk(version: ServedVersion, o: dict[str, Any], seed: int) -> np.ndarray:
    cams = {k: v[None] for k, v in o["cameras"].items()}
    noise = initial_noise(seed, version.chunk_len, version.action_dim)[None]
    return version.infer(o["state"][None], cams, [SPEC.instruction], noise)[0]


def parity(client: PolicyClient, cpu: ServedVersion, seeds: range) -> dict[str, Any]:
    """Served chunks vs the CPU policy's, same observation and seed (max abs difference, env units)."""
    rng = np.random.default_rng(7)
    diffs, commits = [], set()
    for seed in seeds:
        o = obs(rng)
        r = client.act(o, seed=seed, timeout_s=60)
        diffs.append(float(np.abs(r.actions - reference_chunk(cpu, o, seed)).max()))
        commits.add(r.commit)
    return {"max_abs_diff": max(diffs), "ok": max(diffs) < TOL, "commits": sorted(commits)}


def in_process_parity(ckpt: Path, device: str, cpu: ServedVersion) -> dict[str, Any]:
    """The same comparison without the server, with TF32 on (torch's default for cuDNN) and off: tells a
    placement bug (both off) from TF32 rounding (only the TF32 one off)."""
    dev = ServedVersion(load_policy(ckpt, device=device))
    o = obs(np.random.default_rng(3))
    out: dict[str, Any] = {"device": str(dev.model.device)}
    flags = (True, False) if device.startswith("cuda") else (False,)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        for tf32 in flags:
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
            diff = float(np.abs(reference_chunk(dev, o, 5) - reference_chunk(cpu, o, 5)).max())
            out[f"max_abs_diff_tf32_{'on' if tf32 else 'off'}"] = diff
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    return out


def check_serve(args: argparse.Namespace, work: Path, out: dict[str, Any]) -> None:
    a = save_random_checkpoint(work / "ckpt_a", 0)
    b = save_random_checkpoint(work / "ckpt_b", 1)
    live = work / "live"
    shutil.copytree(a, live)
    cpu_a = ServedVersion(load_policy(a, device="cpu"))
    cpu_b = ServedVersion(load_policy(b, device="cpu"))
    out["in_process"] = in_process_parity(a, args.device, cpu_a)
    with (
        cli_server(live, args.device, args.threads, work / "server.log") as address,
        PolicyClient(address, timeout_s=60, token=TOKEN, model_id="flow") as client,
    ):
        info = client.info()["flow"]
        out["server_device"] = info.device
        assert info.device.startswith(args.device), f"served on {info.device}, asked for {args.device}"
        out["parity_a"] = parity(client, cpu_a, range(8))
        out["load"] = []
        for n in args.clients:
            r = run_clients(n, args.duration, our_client(address, "flow"))
            out["load"].append(r)
            print(f"  serve {n:>2} clients: {r['chunks_per_s']} chunks/s p50 {r['p50_ms']} ms", flush=True)
        out["swap"] = live_swap(args, client, address, live, b)
        out["parity_b"] = parity(client, cpu_b, range(8))
    assert out["parity_a"]["ok"] and out["parity_b"]["ok"], "served chunks differ from the CPU policy's"
    swap = out["swap"]
    assert swap["errors"] == 0, f"requests failed during the swap: {swap['error_samples']}"
    assert swap["swapped"] and len(swap["commits"]) == 2, f"no live swap seen: {swap['commits']}"


def live_swap(
    args: argparse.Namespace, client: PolicyClient, address: str, live: Path, new: Path
) -> dict[str, Any]:
    """4 streaming clients; a third of the way in, the followed folder gets ``new``'s files (config last,
    as a sync tool would): the follower loads, verifies, warms up and swaps between batches."""
    from vla_rl.hub.registry import resolve

    before = client.info()["flow"].commit
    box: dict[str, Any] = {}
    duration = max(args.duration, 6.0)
    load = threading.Thread(
        target=lambda: box.update(run_clients(4, duration, our_client(address, "flow"))), daemon=True
    )
    load.start()
    time.sleep(duration / 3)
    for name in (WEIGHTS_FILE, CARD_FILE, "config.json"):
        shutil.copy2(new / name, live / name)
    want = resolve(str(live))
    t0 = time.monotonic()
    while client.info()["flow"].commit != want and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    swap_s = time.monotonic() - t0
    load.join(duration + 180)
    info = client.info()["flow"]
    return {
        **box,
        "before": before,
        "after": info.commit,
        "swapped": info.commit == want != before,
        "seconds_to_swap": round(swap_s, 2),
        "last_load_error": info.last_load_error,
    }


# ------------------------------------------------------------------------------------------------ 2. inference
def check_inference(args: argparse.Namespace, work: Path, out: dict[str, Any]) -> None:
    device = torch.device(args.device)
    models = inference.default_models()
    models["224px camera + state"] = FlowVLAConfig(
        state_dim=6, action_dim=6, cameras=(CameraSpec("front", 224, 224),)
    )
    batches, ks, repeats = ((1, 4), (1, 5), 3) if args.quick else ((1, 16, 64), (1, 5, 10), 20)
    out["rows"] = []
    for name, cfg in models.items():
        out["rows"] += inference.measure(name, cfg, device, batches, ks, repeats)


# ------------------------------------------------------------------------------------------------ 3. training
KIN_TASK = "kinematic/Reach-v0"


def check_train(args: argparse.Namespace, work: Path, out: dict[str, Any]) -> None:
    parts = {"sft_qam_e2e": train_end_to_end, "ppo_update": ppo_update, "qam_update": qam_update}
    for name, fn in parts.items():
        run_section(name, lambda res, fn=fn: fn(args, work, res), out)
    failed = [k for k in parts if not out[k]["ok"]]
    assert not failed, f"failed: {failed}"


def train_end_to_end(args: argparse.Namespace, work: Path, res: dict[str, Any]) -> None:
    """train_sft then train_qam (offline) on the device, on a kinematic-sim camera store."""
    from fleet.store import EpisodeStore
    from sim.demos import record_demos
    from vla_rl.hub.checkpoint import load_checkpoint
    from vla_rl.train.qam import QAMConfig, train_qam
    from vla_rl.train.sft import SFTConfig, train_sft

    store = EpisodeStore(work / "store", create=True)
    record_demos(store, KIN_TASK, episodes=4, noise=0.5, seed=0, obs="rgb", image_size=64, progress=False)
    steps = 3 if args.quick else 30
    sft_cfg = SFTConfig(
        task=KIN_TASK,
        store=store.root,
        out=work / "sft",
        steps=steps,
        batch_size=16 if args.quick else 128,
        warmup_steps=1,
        checkpoint_every=steps,
        instruction_encoder="none",
        device=args.device,
        threads=args.threads,
        ema_decay=0.0,  # the shipped (EMA) weights are the trained ones: a change is visible
        progress=False,
    )
    sft = train_sft(sft_cfg)
    info, trained = load_checkpoint(sft.checkpoint)
    torch.manual_seed(sft_cfg.seed)  # train_sft's initialisation, rebuilt
    init = FlowVLAPolicy(FlowVLAConfig.from_dict(info.model_config)).state_dict()
    changed = max(float((trained[k].float() - init[k].float()).abs().max()) for k in init)
    res["sft"] = {
        "steps": sft.steps,
        "first_loss": sft.first_loss,
        "final_loss": sft.final_loss,
        "samples_per_s": round(sft.samples_per_s, 1),
        "seconds": round(sft.seconds, 2),
        "max_weight_change": changed,
    }
    assert np.isfinite([sft.first_loss, sft.final_loss]).all() and changed > 0, res["sft"]
    qam = train_qam(
        QAMConfig(
            base=str(sft.checkpoint),
            store=store.root,
            out=work / "qam",
            offline_steps=4 if args.quick else 20,
            critic_mc_steps=1 if args.quick else 5,  # every phase: MC warm start, TD only, actor
            critic_warmup=2 if args.quick else 10,
            batch_size=16 if args.quick else 128,
            members=2 if args.quick else 10,
            critic_hidden=(32, 32) if args.quick else (512, 512, 512, 512),
            flow_steps=3 if args.quick else 10,
            log_every=2,
            checkpoint_every=1000,
            device=args.device,
            threads=args.threads,
            progress=False,
        )
    )
    last = qam.curve[-1] if qam.curve else {}
    res["qam"] = {"steps": qam.steps, "seconds": round(qam.seconds, 2), "last": last}
    assert qam.steps > 0 and all(np.isfinite(v) for v in last.values() if isinstance(v, float)), last


def realistic_policy(device: torch.device, chunk_len: int = 10) -> FlowVLAPolicy:
    """Default size, one 64 px camera (what the kinematic and ManiSkill camera tasks train)."""
    torch.manual_seed(0)
    cfg = FlowVLAConfig(
        state_dim=29, action_dim=4, chunk_len=chunk_len, cameras=(CameraSpec("base_camera", 64, 64),)
    )
    return FlowVLAPolicy(cfg).to(device)


def random_rows(n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    return [
        {
            "state": rng.normal(size=29).astype(np.float32),
            "cameras": {"base_camera": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
        }
        for _ in range(n)
    ]


def ppo_update(args: argparse.Namespace, work: Path, res: dict[str, Any]) -> None:
    """One PPO iteration's update (_update: epochs x minibatches) on sampled chunks with made-up
    advantages, as train_ppo runs it after a rollout; device vs CPU."""
    from policies.flow_policy import FlowVLAFlowPolicy
    from policies.flow_rl import FlowVLAStochastic
    from policies.flow_vla import SDESchedule
    from vla_rl.train.ppo import PPOConfig, _actor_params, _update
    from vla_rl.train.ppo_math import score_chain, stored_chain
    from vla_rl.train.ppo_rollout import Sampler, ValueFn, stack_obs

    chunks_n = 32 if args.quick else 320  # 4 robots x 400 steps / n_exec 5
    rows = random_rows(chunks_n, np.random.default_rng(0))
    res["chunks"] = chunks_n
    for method in ("noise", "sde"):
        for dev in device_and_cpu(args):
            cfg = PPOConfig(
                base="unused",
                out=work / "ppo",
                method=method,
                minibatch_size=16 if args.quick else 160,
                update_epochs=1 if args.quick else 4,
                critic_warmup_iterations=0,
            )
            policy = realistic_policy(dev).eval()
            spec = RobotSpec("bench", 29, 4, 10.0, "x", cameras=(CameraSpec("base_camera", 64, 64),))
            emb = torch.randn(1, 384, device=dev)  # the task's (MiniLM) instruction embedding
            rl = FlowVLAStochastic(FlowVLAFlowPolicy(policy, spec), "x", embedding=emb)
            value_fn = ValueFn(cfg, rl)
            sampler = Sampler(cfg, rl, value_fn)
            (chunks, _), sample_s = timed(dev, lambda: sampler.act(rows))  # noqa: B023
            # the stored chains re-scored on the device must give the recorded log-probs (ratio 1)
            with torch.no_grad():
                few = chunks[:16]
                chain = stored_chain(
                    torch.as_tensor(np.stack([c.iterates for c in few]), device=dev),
                    torch.as_tensor(np.stack([c.stochastic for c in few]), device=dev),
                    method,
                    SDESchedule("flow_sde", cfg.noise_level) if method == "sde" else None,
                    policy.config.n_exec,
                )
                logp, _ = score_chain(rl, rl.encode_prefix(stack_obs([c.obs for c in few])), chain)
                recorded = torch.tensor([c.logp for c in few])
                rescore_diff = float((logp[:, 0].cpu() - recorded).abs().max())
            adv = np.random.default_rng(1).normal(size=chunks_n)
            ret = adv + np.array([c.value for c in chunks])
            actor_opt = torch.optim.AdamW(_actor_params(rl, cfg), lr=cfg.actor_lr)
            critic_opt = torch.optim.AdamW(value_fn.net.parameters(), lr=cfg.critic_lr)
            before = flat_params(policy)
            stats, update_s = timed(
                dev,
                lambda: _update(cfg, rl, value_fn, chunks, adv, ret, actor_opt, critic_opt, 0),  # noqa: B023
            )
            moved = float((flat_params(policy) - before).abs().max())
            row = {
                "sample_s": round(sample_s, 3),
                "update_s": round(update_s, 3),
                "policy_loss": stats["policy_loss"],
                "value_loss": stats["value_loss"],
                "approx_kl": stats["approx_kl"],
                "max_param_change": moved,
                "rescore_max_abs_diff": rescore_diff,
                "recorded_logp_mean": float(recorded.mean()),
            }
            res[f"{method}_{dev.type}"] = row
            print(f"  ppo {method} on {dev.type}: {row}", flush=True)
            assert np.isfinite([row["policy_loss"], row["value_loss"]]).all() and moved > 0, row
            assert rescore_diff < 1e-2, f"re-scored log-probs differ from the recorded ones: {row}"


def qam_update(args: argparse.Namespace, work: Path, res: dict[str, Any]) -> None:
    """QAMLearner.losses + backward + optimiser steps (train_qam's update) at batch 256, K 10, the default
    critic ensemble, trunk features; device vs CPU."""
    from vla_rl.train.qam import QAMConfig, QAMLearner

    b = 16 if args.quick else 256
    cfg = QAMConfig(
        base="unused",
        store=work,
        out=work / "qam_u",
        batch_size=b,
        flow_steps=3 if args.quick else 10,
        members=2 if args.quick else 10,
        critic_hidden=(32, 32) if args.quick else (512, 512, 512, 512),
        inv_temp=5.0,
    )
    res.update(batch=b, K=cfg.flow_steps, members=cfg.members)
    for dev in device_and_cpu(args):
        learner = QAMLearner(realistic_policy(dev), cfg).to(dev)
        learner.base.eval()
        opt_c = torch.optim.Adam(learner.critic.parameters(), lr=cfg.critic_lr)
        opt_a = torch.optim.Adam(learner.fine.parameters(), lr=cfg.actor_lr)
        rng = np.random.default_rng(2)
        cur, nxt = (inference.obs_batch(learner.base.config, b, dev) for _ in range(2))
        batch = cur | {
            "action": torch.as_tensor(
                rng.uniform(-1, 1, (b, learner.horizon, learner.action_dim)), device=dev
            ).float(),
            "action_is_pad": torch.zeros(b, learner.horizon, dtype=torch.bool, device=dev),
            "reward_n": torch.full((b,), -0.1, device=dev),
            "bootstrap": torch.ones(b, device=dev),
            "valid": torch.ones(b, device=dev),
        }

        def step() -> dict[str, float]:
            out = learner.losses(batch, nxt, train_actor=True)  # noqa: B023
            opt_c.zero_grad(set_to_none=True)  # noqa: B023
            opt_a.zero_grad(set_to_none=True)  # noqa: B023
            (out["loss_q"] + out["loss_am"]).backward()
            opt_c.step()  # noqa: B023
            opt_a.step()  # noqa: B023
            return {k: float(v.detach()) for k, v in out.items()}

        fine0, critic0 = flat_params(learner.fine), flat_params(learner.critic)
        repeats = 1 if (args.quick or dev.type == "cpu") else 5
        times, losses = [], {}
        for _ in range(1 + repeats):  # the first one warms up (kernels, allocator)
            losses, s = timed(dev, step)
            times.append(s)
        row = {
            "seconds_per_update": round(float(np.median(times[1:])), 4),
            "first_update_s": round(times[0], 3),
            "loss_q": losses["loss_q"],
            "loss_am": losses["loss_am"],
            "fine_change": float((flat_params(learner.fine) - fine0).abs().max()),
            "critic_change": float((flat_params(learner.critic) - critic0).abs().max()),
        }
        res[dev.type] = row
        print(f"  qam update on {dev.type}: {row}", flush=True)
        assert np.isfinite([row["loss_q"], row["loss_am"]]).all(), row
        assert row["fine_change"] > 0 and row["critic_change"] > 0, row


def device_and_cpu(args: argparse.Namespace) -> list[torch.device]:
    """The device, then the CPU for comparison when it is another device and time allows."""
    devs = [torch.device(args.device)]
    if args.device != "cpu" and not args.no_cpu_compare and time.monotonic() - T0 < args.cpu_compare_until_s:
        devs.append(torch.device("cpu"))
    return devs


# ------------------------------------------------------------------------------------------------ main
T0 = time.monotonic()


def run_section(name: str, fn: Callable[[dict[str, Any]], None], results: dict[str, Any]) -> None:
    """``fn(out)`` fills ``results[name]`` as it goes, so a failure keeps what was measured before it."""
    print(f"== {name}", flush=True)
    out: dict[str, Any] = {"ok": True}
    results[name] = out
    t0 = time.perf_counter()
    try:
        fn(out)
    except Exception as e:  # recorded, not fatal: the other sections still run
        out.update(ok=False, error=f"{type(e).__name__}: {e}"[:500], traceback=traceback.format_exc())
        print(out["traceback"], flush=True)
    out["seconds"] = round(time.perf_counter() - t0, 2)


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "numpy": np.__version__, "device": device}
    if device.startswith("cuda"):
        env |= {
            "gpu": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        }
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (or cuda:N) on the GPU machine, cpu to test here")
    p.add_argument("--quick", action="store_true", help="small sizes and short runs (CPU self-test)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = all cores)")
    p.add_argument("--sections", default="serve,inference,train")
    p.add_argument("--no-cpu-compare", action="store_true", help="skip the CPU timings of the updates")
    p.add_argument(
        "--cpu-compare-until-s", type=float, default=240.0, help="no CPU comparison after this many seconds"
    )
    p.add_argument("--deadline-s", type=float, default=420.0, help="start no section after this many seconds")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(args.threads)
    args.duration = 2.0 if args.quick else 10.0
    args.clients = (1, 4) if args.quick else (1, 4, 16)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but torch sees no CUDA device; use --device cpu")
    checks = {"serve": check_serve, "inference": check_inference, "train": check_train}
    results: dict[str, Any] = {"environment": environment(args.device), "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name in args.sections.split(","):
            if time.monotonic() - T0 > args.deadline_s:
                results[name] = {"ok": False, "error": f"skipped: past --deadline-s {args.deadline_s}"}
                continue
            work = Path(tmp) / name
            work.mkdir()
            run_section(name, lambda out, name=name, work=work: checks[name](args, work, out), results)
            write_results("gpu_check", results, args.out)  # what is done survives a kill
    results["total_seconds"] = round(time.monotonic() - T0, 1)
    print_summary(results)
    path = write_results("gpu_check", results, args.out)
    print(f"\nwrote {path}")
    sys.exit(0 if all(results[s]["ok"] for s in args.sections.split(",")) else 1)


def print_summary(results: dict[str, Any]) -> None:
    sections = [k for k, v in results.items() if isinstance(v, dict) and "ok" in v]
    print()
    print(
        table(
            [
                [s, v["ok"], v.get("seconds"), v.get("error", "")[:100]]
                for s, v in results.items()
                if s in sections
            ],
            ["section", "ok", "seconds", "error"],
        )
    )
    serve = results.get("serve", {})
    facts = {
        "served vs CPU chunk, max abs diff": [
            serve.get(k, {}).get("max_abs_diff") for k in ("parity_a", "parity_b")
        ],
        "in-process device vs CPU": serve.get("in_process"),
        "live swap": {
            k: serve.get("swap", {}).get(k) for k in ("swapped", "errors", "commits", "seconds_to_swap")
        },
        "sft": results.get("train", {}).get("sft_qam_e2e", {}).get("sft"),
    }
    print()
    for k, v in facts.items():
        print(f"- {k}: {v}")
    if serve.get("load"):
        rows = [
            [
                r["clients"],
                r["chunks_per_s"],
                r["p50_ms"],
                r["p99_ms"],
                r.get("inference_p50_ms"),
                r["mean_batch"],
                r["errors"],
            ]
            for r in serve["load"]
        ]
        print()
        print(
            table(rows, ["clients", "chunks/s", "p50 ms", "p99 ms", "server forward p50 ms", "batch", "err"])
        )
    if "rows" in results.get("inference", {}):
        print()
        print(
            table(
                [
                    [r["model"], r["batch"], r["K"], r["median_ms"], r["chunks_per_s"]]
                    for r in results["inference"]["rows"]
                ],
                ["model", "batch", "K", "median ms", "chunks/s"],
            )
        )
    train = results.get("train", {})
    rows = []
    for key, label in (("ppo_update", "PPO update"), ("qam_update", "QAM update")):
        for dev_key, v in train.get(key, {}).items():
            if isinstance(v, dict) and ("update_s" in v or "seconds_per_update" in v):
                rows.append([label, dev_key, v.get("update_s", v.get("seconds_per_update"))])
    if rows:
        print()
        print(table(rows, ["what", "method / device", "seconds"]))


if __name__ == "__main__":
    main()
