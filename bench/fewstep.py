"""Few-step action heads: a K = 10 parent against its K = 1 and K = 2 distilled students, in one run.

Per setting (PushCube state, PickCube state, and the 64 px PushCube camera task), every stage cached under
``--work`` so a rerun skips finished work:

1. record ``--demos`` scripted demonstrations at ``--noise`` (seeds 0+, as ``bench/sft.py``);
2. the parent: SFT from those demos with ``bench/sft.py``'s recipe, served at K = 10;
3. the students: ``distill`` (:mod:`vla_rl.train.fewstep`) from the parent on the demos' observations, one
   run per K in ``--student-steps`` (1 and 2 by default) and per ``--variant`` (other knobs, e.g. the
   student's own episodes: ``dagger_rounds``), through the algorithm table as a round runs it;
4. every checkpoint is scored on the SAME held-out seeds (``--eval-seed``, 200000+: no setting is chosen on
   them) with a 95% interval, and its inference time per chunk is measured at batch 1 and 16 (the
   checkpoint's own K, the median of interleaved calls so the parent and students share the machine's load).

Prints a markdown table (success, CI, points against the parent, ms per chunk, time ratio) and writes
bench/results/fewstep.json, with the target (within 3 points of the parent at <= 1/5 of its time) marked
per student.

    python -m bench.fewstep                                   # state tasks (about an hour on 2 cores)
    python -m bench.fewstep --settings push-state --eval-episodes 20   # a quick look
    python -m bench.fewstep --parents-only                    # record demos and train parents, no more
    python -m bench.fewstep --settings pick-state --student-steps 1 \
        --variant 'dagger={"dagger_rounds": 3}'              # a further student on its own states too
    python -m bench.fewstep ... --pool 200100:200 200300:200  # pool cached evaluations, run nothing
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import table, write_results
from bench.inference import obs_batch
from bench.rl import _cached as cached
from bench.rl import check_cached_knobs, knobs
from bench.sft import SETTINGS
from fleet.selection import Selection
from fleet.store import EpisodeStore
from policies.loading import load_flow_checkpoint, load_policy
from sim.demos import record_demos
from vla_rl.core.seeds import check_disjoint
from vla_rl.evaluation import evaluate, wilson_interval
from vla_rl.train.algorithms import make_config, train
from vla_rl.train.contract import PolicyInputs
from vla_rl.train.fewstep import observations
from vla_rl.train.sft import SFTConfig, train_sft
from vla_rl.train.transitions import load_transitions

HELD_OUT = 200_000
TARGET_POINTS = 3.0
"""A student meets the target within this many points of its parent's success ..."""
TARGET_TIME_RATIO = 0.2
"""... at no more than this fraction of its parent's inference time per chunk."""
DISTILL = {"steps": 600, "batch_size": 64, "warmup_steps": 50, "pairs_per_frame": 8}
"""The students' knobs (``--distill`` overrides them): a pool of 8 teacher pairs per demo frame, 600 updates
of 64, sized for a loaded 2-core CPU."""


def parent_steps(name: str, args: argparse.Namespace) -> int:
    """The parent's SFT updates: ``bench/sft.py``'s for the setting unless ``--parent-steps NAME=N``."""
    for item in args.parent_steps:
        setting, _, n = item.partition("=")
        if setting == name:
            return int(n)
    return int(SETTINGS[name]["steps"])


def prepare_parent(name: str, args: argparse.Namespace) -> Path:
    """Demos and the SFT parent of setting ``name`` (cached); returns the parent's checkpoint."""
    s = SETTINGS[name]
    steps = parent_steps(name, args)
    root = args.work / name
    store = root / "store"

    def demos() -> dict[str, Any]:
        rep = record_demos(
            EpisodeStore(store, create=True),
            s["task"],
            episodes=args.demos,
            noise=args.noise,
            seed=0,
            obs=s["obs"],
            image_size=s.get("image_size", 128),
            num_envs=2,
            progress=False,
        )
        return {"success_rate": rep.success_rate, "frames": rep.frames, "seconds": rep.seconds}

    cached(root / "demos.json", demos)

    def parent() -> dict[str, Any]:
        t0 = time.perf_counter()
        r = train_sft(
            SFTConfig(
                task=s["task"],
                store=store,
                out=root / "parent",
                steps=steps,
                batch_size=s["batch_size"],
                seed=0,
                threads=1,
                checkpoint_every=steps,
                progress=False,
                resume=False,
            )
        )
        return {"checkpoint": str(r.checkpoint), "seconds": time.perf_counter() - t0, "steps": steps}

    done = cached(root / "parent.json", parent)
    if done.get("steps", SETTINGS[name]["steps"]) != steps:
        raise SystemExit(
            f"{root / 'parent.json'}: the cached parent ran {done.get('steps')} SFT updates, not {steps}"
        )
    return Path(done["checkpoint"])


def variants(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The students' knob sets per variant name: "" the plain one (``DISTILL`` with ``--distill``), then
    each ``--variant NAME=JSON`` (its knobs over the plain ones)."""
    out: dict[str, dict[str, Any]] = {"": DISTILL | args.distill}
    for item in args.variant:
        name, _, knobs_json = item.partition("=")
        if not name or not name.isidentifier():
            raise SystemExit(f"--variant {item!r}: expected NAME=JSON with NAME a plain word")
        out[name] = out[""] | json.loads(knobs_json)
    return out


def student_tag(k: int, variant: str) -> str:
    """The student's name in the table and its files: ``K=1``, or ``K=1 dagger`` for a variant."""
    return f"K={k}" + (f" {variant}" if variant else "")


def train_student(
    name: str, parent: Path, k: int, args: argparse.Namespace, variant: str = ""
) -> dict[str, Any]:
    """The K = ``k`` student of ``parent`` with the knobs of ``variant`` (:func:`variants`; cached, a cached
    run with other knobs is refused), trained as a round trains it: ``distill`` through the algorithm
    table on the setting's demo store."""
    root = args.work / name
    stem = f"distill-k{k}" + (f"-{variant}" if variant else "")
    cfg = make_config(
        "distill",
        base=str(parent),
        store=root / "store",
        out=root / stem,
        student_steps=k,
        threads=1,
        progress=False,
        **variants(args)[variant],
    )
    check_disjoint(range(args.eval_seed, args.eval_seed + args.eval_episodes), {stem: cfg.collection_seeds()})
    path = root / f"{stem}.json"

    def run() -> dict[str, Any]:
        r = train(cfg)
        return {
            "checkpoint": str(r.checkpoint),
            "seconds": r.seconds,
            "metrics": r.metrics,
            "config": knobs(cfg),
        }

    if path.exists():
        check_cached_knobs(path, json.loads(path.read_text()), cfg)
    return cached(path, run)


def score(ckpt: Path, task: str, args: argparse.Namespace) -> dict[str, Any]:
    """Success on the held-out seeds with its 95% interval and each seed's outcome (for the paired
    difference), the checkpoint served with its own K."""
    ev = evaluate(
        load_policy(ckpt), task, episodes=args.eval_episodes, num_envs=2, seed=args.eval_seed, progress=False
    )
    return {
        "success": ev.success_rate,
        "ci95": list(ev.ci95),
        "mean_length": ev.mean_length,
        "per_seed": {str(e.seed): bool(e.success) for e in ev.per_episode},
    }


def paired_difference(student: dict[str, bool], parent: dict[str, bool]) -> dict[str, float]:
    """Student minus parent in points on the same seeds, with a 95% normal interval of the paired per-seed
    differences (``mean d ± 1.96 sd(d) / sqrt(n)``, d in {-1, 0, 1}), and the discordant counts."""
    seeds = sorted(parent)
    if sorted(student) != seeds:
        raise ValueError("paired_difference: student and parent must be scored on the same seeds")
    d = np.array([float(student[s]) - float(parent[s]) for s in seeds])
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    return {
        "points": 100 * float(d.mean()),
        "ci95_points": [100 * float(d.mean() - half), 100 * float(d.mean() + half)],
        "student_only": int((d > 0).sum()),
        "parent_only": int((d < 0).sum()),
    }


@torch.no_grad()
def chunk_times(
    ckpts: dict[str, Path], batches: tuple[int, ...], repeats: int
) -> dict[str, dict[int, float]]:
    """Median milliseconds of one ``predict_action_chunk`` call (each checkpoint with its own K: the whole
    chunk, encoding included) per checkpoint and batch size; the checkpoints' calls interleaved so that
    a change of the machine's load hits them alike."""
    models = {name: load_policy(c).policy.eval() for name, c in ckpts.items()}
    out: dict[str, dict[int, float]] = {name: {} for name in models}
    for b in batches:
        torch.manual_seed(0)
        first = next(iter(models.values()))
        obs = obs_batch(first.config, b, first.device)
        for m in models.values():  # warm-up
            m.predict_action_chunk(obs)
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(repeats):
            for name, m in models.items():
                t0 = time.perf_counter()
                m.predict_action_chunk(obs)
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name in models:
            out[name][b] = float(np.median(times[name]))
    return out


@torch.no_grad()
def chunk_gaps(
    parent: Path, students: dict[str, Path], stores: dict[str, Path], task: str, frames: int = 1024
) -> dict[str, dict[str, float]]:
    """Per store (name -> folder) and student: the mean squared distance of the student's deployed chunk
    from the parent's (its own K) on the same noise, in the normalised action space over the robot's
    dims, on up to ``frames`` of the store's frames (fixed draws): how completely the distillation took
    where the demonstrator went and where a student went. ``parent K=1`` is the undistilled baseline."""
    load = lambda c: load_flow_checkpoint(str(c), algorithm="distill", device="cpu")  # noqa: E731
    base = load(parent)
    teacher = base.policy
    policies = {"parent K=1": teacher} | {t: load(c).policy for t, c in students.items()}
    out: dict[str, dict[str, float]] = {}
    for name, folder in stores.items():
        buf = load_transitions(
            EpisodeStore(folder), Selection.parse(None, task=task), cameras=bool(base.spec.cameras)
        )
        g = torch.Generator().manual_seed(0)
        rows = torch.randperm(len(buf), generator=g)[:frames].numpy()
        raw = buf.batch(rows, horizon=teacher.chunk_len, n_step=1)
        obs = observations(PolicyInputs(teacher, buf, torch.device("cpu"))(raw))
        z = torch.randn(len(rows), *teacher.event_shape, generator=g)[:, None]
        ref = teacher.sample(obs, noise=z).actions[:, 0, ..., : teacher.action_dim]
        out[name] = {"frames": len(buf)}
        for tag, pol in policies.items():
            chunk = pol.sample(obs, num_steps=1 if tag == "parent K=1" else None, noise=z).actions
            out[name][tag] = float((chunk[:, 0, ..., : teacher.action_dim] - ref).square().mean())
    return out


def gap_stores(root: Path, students: dict[str, Path]) -> dict[str, Path]:
    """The stores :func:`chunk_gaps` reads: the demos, and each student's own on-policy episodes where it
    recorded some (``dagger_rounds``: ``<run>/dagger_store``)."""
    stores = {"demos": root / "store"}
    for tag, ckpt in students.items():
        own = ckpt.parents[1] / "dagger_store"
        if own.exists():
            stores[f"{tag}'s own episodes"] = own
    return stores


def eval_path(root: Path, tag: str, seed: int, episodes: int) -> Path:
    """Where a checkpoint's evaluation on ``episodes`` seeds from ``seed`` is cached."""
    return root / f"{tag.replace('=', '').replace(' ', '-')}.eval-{seed}-{episodes}.json"


def pooled(root: Path, tags: list[str], runs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """The cached evaluations of several runs ((first seed, episodes) each, disjoint seeds) pooled per
    checkpoint in ``tags`` ("parent" first): success over all their episodes with its Wilson interval, and
    each student's paired difference from the parent over the same seeds."""
    per_seed: dict[str, dict[str, bool]] = {tag: {} for tag in tags}
    for tag in tags:
        for seed, episodes in runs:
            got = json.loads(eval_path(root, tag, seed, episodes).read_text())["per_seed"]
            if set(got) & set(per_seed[tag]):
                raise ValueError(f"pooled: the runs' seeds overlap ({seed}, {episodes} episodes)")
            per_seed[tag] |= got
    rows = []
    for tag in tags:
        wins = sum(per_seed[tag].values())
        row: dict[str, Any] = {
            "policy": tag,
            "episodes": len(per_seed[tag]),
            "success": wins / len(per_seed[tag]),
            "ci95": list(wilson_interval(wins, len(per_seed[tag]))),
        }
        if tag != "parent":
            row["vs_parent"] = paired_difference(per_seed[tag], per_seed["parent"])
        rows.append(row)
    return rows


def run_setting(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Parent and students of one setting, scored on the same held-out seeds and timed together."""
    task = SETTINGS[name]["task"]
    parent = prepare_parent(name, args)
    ckpts = {"parent": parent}
    students: dict[str, dict[str, Any]] = {}
    student_k: dict[str, int] = {}
    for k in args.student_steps:
        for variant in variants(args):
            tag = student_tag(k, variant)
            students[tag] = train_student(name, parent, k, args, variant)
            student_k[tag] = k
            ckpts[tag] = Path(students[tag]["checkpoint"])
    if args.train_only:
        return {"setting": name, "students": students}
    evals = {
        tag: cached(
            eval_path(args.work / name, tag, args.eval_seed, args.eval_episodes),
            lambda c=c: score(c, task, args),
        )
        for tag, c in ckpts.items()
    }
    times = chunk_times(ckpts, tuple(args.batches), args.repeats)
    k_parent = load_policy(parent).policy.config.num_inference_steps
    rows = []
    for tag in ckpts:
        row: dict[str, Any] = {
            "setting": name,
            "policy": tag,
            "K": k_parent if tag == "parent" else student_k[tag],
            "success": evals[tag]["success"],
            "ci95": evals[tag]["ci95"],
            "ms": {str(b): round(times[tag][b], 3) for b in args.batches},
            "time_ratio": {str(b): round(times[tag][b] / times["parent"][b], 3) for b in args.batches},
        }
        if tag != "parent":
            trained = students[tag]
            diff = paired_difference(evals[tag]["per_seed"], evals["parent"]["per_seed"])
            row |= {
                "vs_parent": diff,
                "train_seconds": round(trained["seconds"], 1),
                "distill": trained.get("config", {}),
                "distill_loss_first_last": [
                    trained["metrics"].get("first_loss_rollout"),
                    trained["metrics"].get("loss_rollout"),
                ],
                "dagger_success": trained["metrics"].get("dagger_success", []),
                "target_met": diff["points"] >= -TARGET_POINTS
                and all(r <= TARGET_TIME_RATIO for r in row["time_ratio"].values()),
            }
        rows.append(row)
    studs = {tag: c for tag, c in ckpts.items() if tag != "parent"}
    gaps = chunk_gaps(parent, studs, gap_stores(args.work / name, studs), task)
    return {
        "setting": name,
        "task": task,
        "parent_sft_steps": parent_steps(name, args),
        "rows": rows,
        "chunk_gap": gaps,
    }


def _table(rows: list[dict[str, Any]], batches: list[int]) -> str:
    body = []
    for r in rows:
        lo, hi = r["ci95"]
        vs = r.get("vs_parent")
        body.append(
            [
                r["setting"],
                r["policy"],
                r["K"],
                f"{r['success']:.0%} [{lo:.0%}, {hi:.0%}]",
                ""
                if vs is None
                else f"{vs['points']:+.1f} [{vs['ci95_points'][0]:+.1f}, {vs['ci95_points'][1]:+.1f}]",
                *(f"{r['ms'][str(b)]:.2f} ({r['time_ratio'][str(b)]:.2f}x)" for b in batches),
                "" if vs is None else ("yes" if r["target_met"] else "no"),
            ]
        )
    header = ["setting", "policy", "K", "success [95% CI]", "points vs parent [paired 95% CI]"]
    header += [f"ms/chunk b={b} (x parent)" for b in batches] + ["target"]
    return table(body, header)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=["push-state", "pick-state"], choices=list(SETTINGS))
    p.add_argument("--demos", type=int, default=50)
    p.add_argument("--noise", type=float, default=0.5)
    p.add_argument(
        "--parent-steps",
        nargs="*",
        default=[],
        metavar="SETTING=N",
        help="a parent's SFT updates where not bench/sft.py's (e.g. pick-state=1000: a shorter run on a busy CPU)",
    )
    p.add_argument("--student-steps", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--distill",
        type=json.loads,
        default={},
        help='DistillConfig overrides of DISTILL as JSON, e.g. \'{"steps": 1000, "pairs_per_frame": 0}\'',
    )
    p.add_argument(
        "--variant",
        nargs="*",
        default=[],
        metavar="NAME=JSON",
        help="a further student per K with these DistillConfig knobs over the plain ones, "
        'e.g. dagger=\'{"dagger_rounds": 2}\' (the table\'s "K=1 dagger")',
    )
    p.add_argument("--eval-episodes", type=int, default=100)
    p.add_argument("--eval-seed", type=int, default=HELD_OUT, help="first held-out episode seed")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="batch sizes timed")
    p.add_argument("--repeats", type=int, default=50, help="timed calls per checkpoint and batch")
    p.add_argument("--threads", type=int, default=1, help="torch threads (timing included)")
    p.add_argument("--parents-only", action="store_true", help="record demos and train the parents, no more")
    p.add_argument("--train-only", action="store_true", help="train parents and students, evaluate nothing")
    p.add_argument("--work", type=Path, default=Path("runs/bench_fewstep"))
    p.add_argument(
        "--pool",
        nargs="*",
        default=[],
        metavar="SEED:EPISODES",
        help="no run: pool the cached evaluations of these runs (disjoint seed ranges) per checkpoint",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.parents_only:
        for name in args.settings:
            print(name, prepare_parent(name, args), flush=True)
        return
    if args.pool:
        runs = [(int(a), int(b)) for a, _, b in (item.partition(":") for item in args.pool)]
        tags = ["parent"] + [student_tag(k, v) for k in args.student_steps for v in variants(args)]
        res = {name: pooled(args.work / name, tags, runs) for name in args.settings}
        write_results("fewstep_pooled", {"args": {"pool": args.pool}, "settings": res}, args.out)
        print(json.dumps(res, indent=1))
        return
    meta = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    meta |= {"target": {"points": TARGET_POINTS, "time_ratio": TARGET_TIME_RATIO}}
    per_setting = []
    for name in args.settings:
        per_setting.append(run_setting(name, args))
        write_results("fewstep", meta | {"settings": per_setting, "complete": False}, args.out)
    if args.train_only:
        return
    rows = [r for s in per_setting for r in s["rows"]]
    write_results("fewstep", meta | {"settings": per_setting, "complete": True}, args.out)
    print()
    print(_table(rows, args.batches))


if __name__ == "__main__":
    main()
