"""``bench.rl`` on a borrowed GPU machine unpacked from ``scripts/device_bundle.py``'s bundle.

Same arguments as ``python -m bench.rl`` (use ``--train-only``: the checkpoints come back and are
evaluated on this project's CPU machine, like every other PickCube number). On top of bench.rl it

* seeds the instruction embedder with the bundle's precomputed vectors (the encoder is not there);
* with ``--deadline UNIX_TIME``, gives each online run the minutes left until then as its time budget
  (``max_minutes``): it stops starting iterations and ships what it learned, with the env steps reached;
* retries a stage on the CPU if it fails on the GPU (SFT or the trainer), saying so in the log, so a
  CUDA-only problem costs the time of one attempt rather than the run.

    python scripts/device_train.py --site /tmp/site --deadline $((T0 + 480)) -- \\
        --algos flow-sde --seeds 0 --rollouts 0 --train-only --work runs/pc --env-steps 100000

Online algorithms with a time budget: the PPO family (``--ppo``) and awr-pi (``--awr-pi``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("device_train")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", type=Path, required=True, help="where the bundle was unpacked")
    p.add_argument("--deadline", type=float, default=None, help="unix time by which online runs stop")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="bench.rl's arguments (after --)")
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]

    from policies.flow_vla.encoders import MiniLMEmbedder

    MiniLMEmbedder.add_precomputed(json.loads((args.site / "instruction_embeddings.json").read_text()))

    import bench.rl as rl

    train_sft, train_algo = rl.train_sft, rl._train

    def sft_with_fallback(cfg: Any) -> Any:
        try:
            return train_sft(cfg)
        except Exception:
            log.exception("SFT failed on %s; retrying on the CPU", cfg.device)
            cfg.device = "cpu"
            return train_sft(cfg)

    def train_with_budget(algo: str, base: Path, store: Path, out: Path, seed: int, ns: Any) -> Any:
        # the overrides this algorithm reads (bench.rl's --ppo or --awr-pi); both have max_minutes and device
        knobs = "awr_pi" if algo == "awr-pi" else "ppo"

        def budget() -> None:
            if args.deadline is not None:
                minutes = max((args.deadline - time.time()) / 60, 0.5)
                setattr(ns, knobs, {**getattr(ns, knobs), "max_minutes": minutes})
                log.info("seed %d %s: %.1f minutes to the deadline", seed, algo, minutes)

        budget()
        try:
            return train_algo(algo, base, store, out, seed, ns)
        except Exception:
            if getattr(ns, knobs).get("device") == "cpu":
                raise
            log.exception("%s failed on the GPU; retrying on the CPU", algo)
            setattr(ns, knobs, {**getattr(ns, knobs), "device": "cpu"})
            budget()
            return train_algo(algo, base, store, out, seed, ns)

    rl.train_sft, rl._train = sft_with_fallback, train_with_budget
    sys.argv = ["bench.rl", *bench_args]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rl.main()


if __name__ == "__main__":
    main()
