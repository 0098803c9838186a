"""Two instructions that demand opposite actions from the same state: the language test bed of every
trainer (SFT in test_training.py, AWR in test_awr.py, QAM in test_qam.py).

The state is always 0 and the episodes differ only in their instruction, so a policy can follow "go left"
(act -1) and "go right" (act +1) only by reading the words; one instruction for all must fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from vla_rl_client.spec import RobotSpec

from fleet.store import EpisodeStore

LR_TASK = "toy/left-right"
LR_SPEC = RobotSpec(name=LR_TASK, state_dim=1, action_dim=1, control_hz=10.0, instruction="go somewhere")
INSTRUCTIONS = {"go left": -1.0, "go right": 1.0}


def left_right_store(
    root: Path, episodes_per_instruction: int = 4, length: int = 16, *, mixed: bool = False
) -> Path:
    """State always 0; "go left" episodes act -1, "go right" episodes act +1: only the words differ
    (autonomous frames, outcome success).

    ``mixed``: each instruction gets ``episodes_per_instruction`` episodes acting -1 *and* as many acting
    +1, a success when the sign is the instruction's and a failure otherwise: behaviour cloning sees
    both actions under both instructions (its mean is ~0), only the outcome says which one to follow.
    Its state is the position the actions reached, ``act * t / length`` (0 at the start under both
    instructions): an action moves the robot towards the side that succeeds or fails, so a critic can
    credit it (with one state for all, TD bootstraps from the very state it scores and cannot)."""
    store = EpisodeStore(root, create=True)
    ramp = (np.arange(length, dtype=np.float32) / length)[:, None]
    for _ in range(episodes_per_instruction):
        for text, sign in INSTRUCTIONS.items():
            for act in (sign, -sign) if mixed else (sign,):
                with store.create_episode(LR_SPEC, robot_id="r0", task=LR_TASK, instruction=text) as w:
                    w.add_frames(
                        {
                            "state": act * ramp if mixed else np.zeros((length, 1), np.float32),
                            "action": np.full((length, 1), act, np.float32),
                        }
                    )
                    w.close("success" if act == sign else "failure")
    return store.root


def instruction_means(checkpoint: Path, samples: int = 8, seed: int = 0) -> tuple[float, float]:
    """The policy's mean action under "go left" and under "go right" at the state 0, over ``samples``
    chunks each (seeded noise)."""
    from policies.loading import load_policy

    lp = load_policy(checkpoint, device="cpu")
    texts = [t for t in INSTRUCTIONS for _ in range(samples)]
    chunks = lp.predict_chunks({"state": np.zeros((len(texts), 1), np.float32), "instruction": texts}, seed)
    means = chunks.reshape(len(INSTRUCTIONS), samples, -1).mean(axis=(1, 2))
    return float(means[0]), float(means[1])


def mixed_base(root: Path, steps: int = 60) -> tuple[Path, Path]:
    """The ``mixed`` store and a short MiniLM-conditioned SFT base on it (acts both ways under both
    instructions): what AWR's and QAM's language tests start from."""
    from vla_rl.train.sft import SFTConfig, train_sft

    store = left_right_store(root / "store", episodes_per_instruction=2, mixed=True)
    sft = train_sft(
        SFTConfig(
            task=LR_TASK,
            store=store,
            out=root / "sft",
            steps=steps,
            batch_size=32,
            lr=1e-3,
            warmup_steps=10,
            d_model=32,
            n_heads=2,
            n_layers=1,
            expert_n_layers=1,
            chunk_len=4,
            n_exec=2,
            checkpoint_every=steps,
            threads=1,
            progress=False,
        )
    )
    return store, sft.checkpoint


def spec_instruction_only(buf, device):  # type: ignore[no-untyped-def]
    """A stand-in for ``instruction_table`` that embeds the spec's one instruction for every frame:
    the old behaviour, which the language tests must fail."""
    from policies.flow_vla import embed_instructions

    return embed_instructions([buf.spec.instruction] * len(buf.instructions)).to(device)
