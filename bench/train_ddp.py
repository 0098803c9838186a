"""Data-parallel training throughput: samples/s of SFT and QAM offline at 1, 2, ... processes.

Each setting is a real run: one process (``python bench/train_ddp.py --worker``, the single-process
code path, no process group) or N processes under torchrun (``python -m torch.distributed.run
--nproc-per-node N``, gloo on CPU, NCCL on CUDA with one GPU per process), the same global batch in
every setting. samples/s = global batch x updates / the time from the trainer's "start" log line to its
last checkpoint line (data loading, model building and process start-up are not counted). Prints a
markdown table and writes bench/results/train_ddp.json.

    python bench/train_ddp.py                                  # CPU: 1 process (1 and 2 threads), 2 processes
    python bench/train_ddp.py --device cuda --procs 1 2 4 --threads 0   # GPUs: up to one process each

On a CPU the question is whether N processes of T threads beat one process of N*T threads on the same
cores; on GPUs it is how close N GPUs come to N times one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASK = "maniskill/PushCube-v1"
MODEL = dict(
    d_model=128, n_layers=2, expert_n_layers=4, n_heads=4, chunk_len=10, n_exec=5, instruction_encoder="none"
)


def _sft_config(work: Path, out: Path, args: argparse.Namespace, threads: int) -> Any:
    from vla_rl.train.sft import SFTConfig

    return SFTConfig(
        task=TASK,
        store=work / "store",
        out=out,
        steps=args.steps,
        batch_size=args.batch_size,
        checkpoint_every=args.steps,
        log_every=args.steps,
        threads=threads,
        progress=False,
        device=args.device,
        **MODEL,  # type: ignore[arg-type]
    )


def _qam_config(work: Path, out: Path, args: argparse.Namespace, threads: int) -> Any:
    from vla_rl.train.qam import QAMConfig

    return QAMConfig(
        base=str(work / "base" / "checkpoints" / "last"),
        store=work / "store",
        out=out,
        offline_steps=args.qam_steps,
        batch_size=args.batch_size,
        members=4,
        critic_hidden=(256, 256),
        flow_steps=5,
        critic_mc_steps=0,
        critic_warmup=0,
        checkpoint_every=args.qam_steps,
        log_every=args.qam_steps,
        threads=threads,
        progress=False,
        device=args.device,
    )


class _Times(logging.Handler):
    """Wall-clock times of the trainer's start line and of its last checkpoint line."""

    def __init__(self) -> None:
        super().__init__()
        self.start: float | None = None
        self.end: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.endswith(" start"):
            self.start = record.created
        elif msg == "checkpoint":
            self.end = record.created


def worker(args: argparse.Namespace) -> None:
    """One run (this process is one rank, or the only process); rank 0 writes its numbers."""
    import torch

    from vla_rl.train.algorithms import train

    times = _Times()
    root = logging.getLogger()
    root.addHandler(times)
    root.setLevel(logging.INFO)
    work, out = Path(args.work), Path(args.run_out)
    make = _sft_config if args.algo == "sft" else _qam_config
    cfg = make(work, out, args, args.threads)
    res = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        steps = args.steps if args.algo == "sft" else args.qam_steps
        assert times.start is not None and times.end is not None, "no start/checkpoint log lines"
        seconds = times.end - times.start
        Path(args.result).write_text(
            json.dumps(
                {
                    "samples_per_s": steps * args.batch_size / seconds,
                    "train_seconds": seconds,
                    "total_seconds": res.seconds,
                    "device": str(torch.device(args.device if args.device != "auto" else "cpu")),
                }
            )
        )


def _prepare(work: Path) -> None:
    """Demos and (for QAM) a base checkpoint, once."""
    from fleet.store import EpisodeStore
    from sim.demos import record_demos
    from vla_rl.train.sft import SFTConfig, train_sft

    if not (work / "store").exists():
        record_demos(
            EpisodeStore(work / "store", create=True), TASK, episodes=10, noise=0.3, seed=0, progress=False
        )
    if not (work / "base" / "checkpoints" / "last").exists():
        train_sft(
            SFTConfig(
                task=TASK,
                store=work / "store",
                out=work / "base",
                steps=20,
                batch_size=32,
                progress=False,
                **MODEL,
            )  # type: ignore[arg-type]
        )


def _run(args: argparse.Namespace, algo: str, procs: int, threads: int, work: Path, n: int) -> dict[str, Any]:
    out = work / f"{algo}-p{procs}-t{threads}-{n}"
    result = work / f"{out.name}.json"
    flags = [
        "--worker",
        "--algo",
        algo,
        "--work",
        str(work),
        "--run-out",
        str(out),
        "--result",
        str(result),
        "--threads",
        str(threads),
        "--device",
        args.device,
        "--steps",
        str(args.steps),
        "--qam-steps",
        str(args.qam_steps),
        "--batch-size",
        str(args.batch_size),
    ]
    script = str(Path(__file__).resolve())
    if procs == 1:
        cmd = [sys.executable, script, *flags]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(procs),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "127.0.0.1:0",
            script,
            *flags,
        ]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(threads, 1))}
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text()) | {"wall_seconds": time.perf_counter() - t}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", nargs="+", default=["sft", "qam"], choices=["sft", "qam"])
    p.add_argument("--procs", nargs="+", type=int, default=[1, 2])
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per process (0: the trainer's default)"
    )
    p.add_argument(
        "--single-threads",
        type=int,
        nargs="*",
        default=None,
        help="extra 1-process settings with these thread counts (default on CPU: max(procs) x threads)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (NCCL, one GPU per process)")
    p.add_argument("--steps", type=int, default=60, help="SFT updates per run")
    p.add_argument("--qam-steps", type=int, default=20, help="QAM offline updates per run")
    p.add_argument("--batch-size", type=int, default=128, help="global batch (split between the processes)")
    p.add_argument(
        "--repeats", type=int, default=2, help="runs per setting; the best counts (a shared machine)"
    )
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument(
        "--out", type=Path, default=None, help="results file (default bench/results/train_ddp.json)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--algo", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--run-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, str(ROOT))
    from bench.common import LoadSampler, loadavg, table, write_results

    if args.device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count()
        skipped = [n for n in args.procs if n > gpus]
        if skipped:
            print(f"skipping {skipped} processes: NCCL needs one GPU per process and {gpus} are visible")
        args.procs = [n for n in args.procs if n <= gpus]
    settings = [(n, args.threads) for n in args.procs]
    single = args.single_threads
    if single is None and args.device == "cpu":
        single = [max(args.procs) * max(args.threads, 1)]
    settings += [(1, t) for t in single or [] if (1, t) not in settings]
    rows, results = [], []
    with LoadSampler() as load, tempfile.TemporaryDirectory(prefix="train_ddp_") as tmp:
        work = args.work or Path(tmp)
        _prepare(work)
        for algo in args.algos:
            base: float | None = None
            for procs, threads in settings:
                runs = [_run(args, algo, procs, threads, work, i) for i in range(args.repeats)]
                best = max(runs, key=lambda r: r["samples_per_s"])
                base = best["samples_per_s"] if base is None else base
                r = {
                    "algo": algo,
                    "processes": procs,
                    "threads_per_process": threads,
                    "device": args.device,
                    "global_batch": args.batch_size,
                    "updates": args.steps if algo == "sft" else args.qam_steps,
                    "samples_per_s": round(best["samples_per_s"], 1),
                    "all_samples_per_s": [round(x["samples_per_s"], 1) for x in runs],
                    "train_seconds": round(best["train_seconds"], 2),
                    "wall_seconds": round(best["wall_seconds"], 1),
                    "speedup_vs_first": round(best["samples_per_s"] / base, 2),
                }
                results.append(r)
                rows.append(
                    [
                        algo,
                        procs,
                        threads,
                        args.batch_size,
                        r["samples_per_s"],
                        r["speedup_vs_first"],
                        r["wall_seconds"],
                    ]
                )
                print(rows[-1], flush=True)
    print(
        table(rows, ["algo", "processes", "threads each", "global batch", "samples/s", "x first", "wall s"])
    )
    path = write_results(
        "train_ddp",
        {"settings": results, "load_average_1_5_15": loadavg(), "load": load.summary()},
        args.out,
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
