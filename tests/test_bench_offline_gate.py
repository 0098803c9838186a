"""bench/offline_gate.py's pieces (the slow bench itself is not run): the noised candidate, the rank
correlation and the report."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from bench.offline_gate import Noised, report, spearman


class Zero:
    spec = SimpleNamespace(name="toy")
    chunk_len = 3

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        return np.zeros((len(obs["state"]), 3, 2), np.float32)


def test_noised_adds_seeded_noise_of_the_given_scale() -> None:
    obs = {"state": np.zeros((2000, 1))}
    p = Noised(Zero(), 0.5)
    a, b = p.predict_chunks(obs, seed=1), p.predict_chunks(obs, seed=1)
    np.testing.assert_array_equal(a, b)  # deterministic per request seed
    assert a.std() == pytest.approx(0.5, rel=0.05) and not np.array_equal(a, p.predict_chunks(obs, seed=2))
    assert p.chunk_len == 3 and p.spec.name == "toy"


def test_spearman_and_report() -> None:
    assert spearman([0.1, 0.5, 0.9], [1.0, 2.0, 30.0]) == pytest.approx(1.0)
    assert spearman([0.1, 0.5, 0.9], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    r = {
        "candidates": [
            {
                "candidate": "a",
                "true_success": 0.7,
                "true_ci95": [0.6, 0.8],
                "estimated_success": 0.4,
                "action_mse": 0.5,
            }
        ],
        "spearman_estimated_success": 0.78,
        "spearman_neg_action_mse": 0.29,
    }
    text = report(r)
    assert (
        "| a " in text and "70% [60%, 80%]" in text and "estimated success +0.78, -action MSE +0.29" in text
    )
