"""The promotion gate of a round (vla_rl/rounds.py with vla_rl/gate.py): the paired test on the shared
seeds refuses noise the old margin-only rule promoted, the knobs are validated naming the field, and the
success a round reports comes from seeds the gate never saw. In-process, fake evaluations, no simulator."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vla_rl import gate as gate_mod
from vla_rl import rounds
from vla_rl.core.seeds import EVAL, ONLINE, REPORT
from vla_rl.evaluation import EpisodeResult, EvalResult, wilson_interval
from vla_rl.gate import decode_outcomes, encode_outcomes, gate_sentence, known_outcomes
from vla_rl.gate_stats import mcnemar_one_sided
from vla_rl.rounds import ProgressWriter, RoundConfig
from vla_rl.train.algorithms import make_config

COMMON = {"base": "hub://org/arm@prod", "store": Path("s"), "out": Path("o")}


def _cfg(**kw: Any) -> RoundConfig:
    return RoundConfig(train=make_config("awr", **COMMON, progress=False), **kw)


def _eval(wins: set[int], seed: int, n: int) -> EvalResult:
    per = [EpisodeResult(s, s in wins, 10, 0.0) for s in range(seed, seed + n)]
    k = sum(r.success for r in per)
    return EvalResult("toy", n, k, k / n, wilson_interval(k, n), 10.0, 0.0, 4, 0.1, per)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"gate_alpha": 0.0}, "gate_alpha: expected a false-promotion rate in (0, 1]"),
        ({"gate_alpha": 1.5}, "gate_alpha: expected a false-promotion rate in (0, 1]"),
        ({"gate_alpha": float("nan")}, "gate_alpha: expected a finite number"),
        ({"report_episodes": -1}, "report_episodes: expected 0..100_000"),
        ({"report_seed": EVAL + 10}, "report_seed: the report's seeds 100010..100029 overlap the gate's"),
        ({"eval_seed": REPORT - 5}, "report_seed: the report's seeds 500000..500019 overlap the gate's"),
    ],
)
def test_round_config_validates_the_gate_knobs(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as e:
        _cfg(**bad)
    assert str(e.value).startswith(message), str(e.value)


def test_the_report_seeds_are_disjoint_from_the_gate_and_from_training() -> None:
    cfg = _cfg()
    gate_seeds = range(cfg.eval_seed, cfg.eval_seed + cfg.eval_episodes)
    report_seeds = range(cfg.report_seed, cfg.report_seed + cfg.report_episodes)
    assert (cfg.gate_alpha, cfg.report_episodes, cfg.report_seed) == (0.05, 20, REPORT)
    assert not set(gate_seeds) & set(report_seeds) and report_seeds.stop <= ONLINE
    assert _cfg(report_episodes=0, report_seed=EVAL).report_episodes == 0  # off: no range to collide


def test_outcomes_round_trip_as_text() -> None:
    ev = _eval({7, 9}, seed=7, n=4)
    text = encode_outcomes(ev.per_episode, 7, 4)
    assert text == "1010" and decode_outcomes(text, 7) == {7: True, 8: False, 9: True, 10: False}
    assert known_outcomes({"o": text}, "o", 4) == text
    assert known_outcomes({"o": text}, "o", 5) is None and known_outcomes({}, "o", 4) is None
    with pytest.raises(ValueError, match="no episode for seeds \\[11\\]"):
        encode_outcomes(ev.per_episode, 7, 5)
    with pytest.raises(ValueError, match="a string of 0 and 1"):
        decode_outcomes("10x", 0)


def test_gate_sentence_names_the_test_of_what_it_pairs() -> None:
    test = mcnemar_one_sided(7, 1, 42)
    assert gate_sentence(test, 0.05, "seeds") == (
        "paired on 50 seeds: candidate-only 7, base-only 1 (one-sided McNemar p 0.0352, needs <= 0.05)"
    )
    assert "(one-sided sign test p 0.0352, needs <= 0.1)" in gate_sentence(test, 0.1, "episodes")
    with pytest.raises(ValueError, match="what: expected one of \\['episodes', 'seeds'\\], got 'frames'"):
        gate_sentence(test, 0.05, "frames")


def _gate(
    monkeypatch: pytest.MonkeyPatch, cfg: RoundConfig, cand: set[int], base: set[int]
) -> rounds.SimGate:
    """The sim gate over fake evaluations: the candidate wins the seeds ``cand``, the base ``base``."""
    new, old = object(), SimpleNamespace(metrics={}, commit="c0")
    fake = {id(new): cand, id(old): base}
    monkeypatch.setattr(
        rounds, "evaluate", lambda p, task, episodes, seed, **_: _eval(fake[id(p)], seed, episodes)
    )
    db = SimpleNamespace(rounds=lambda task=None: [])
    return rounds._sim_gate(cfg, db, old, new, "toy")  # type: ignore[arg-type]


def test_the_gate_refuses_noise_the_old_rule_promoted(monkeypatch: pytest.MonkeyPatch) -> None:
    """58% vs 52% on the same 50 seeds, 3 seeds won by the candidate alone: the margin-0 rule promoted it;
    the paired test (p = 1/8) does not at alpha 0.05. With 6 seeds changed hands one way it does."""
    base = set(range(EVAL, EVAL + 26))
    noise = base | {EVAL + 26, EVAL + 27, EVAL + 28}
    old_rule = _gate(monkeypatch, _cfg(gate_alpha=1.0), noise, base)
    assert (
        old_rule.promote
        and old_rule.candidate == pytest.approx(0.58)
        and old_rule.base == pytest.approx(0.52)
    )
    gate = _gate(monkeypatch, _cfg(), noise, base)
    assert not gate.promote and gate.test is not None and gate.alpha == 0.05
    assert (gate.test.wins, gate.test.losses) == (3, 0) and gate.test.p_value == pytest.approx(1 / 8)
    assert "candidate-only 3, base-only 0" in gate.why and "McNemar p 0.125, needs <= 0.05" in gate.why
    m = gate.round_metrics()
    assert (m["p_value"], m["candidate_only"], m["base_only"], m["gate_alpha"]) == (
        pytest.approx(1 / 8),
        3,
        0,
        0.05,
    )
    assert m["outcomes"] == "1" * 29 + "0" * 21 and m["base_outcomes"] == "1" * 26 + "0" * 24
    assert gate.checkpoint_metrics()["eval_outcomes"] == m["outcomes"]  # the next round's base reuses it

    better = _gate(monkeypatch, _cfg(), base | set(range(EVAL + 26, EVAL + 32)), base)
    assert better.promote and better.test is not None and better.test.p_value == pytest.approx(1 / 64)
    # the margin still applies on top of the test
    assert not _gate(monkeypatch, _cfg(margin=0.2), base | set(range(EVAL + 26, EVAL + 32)), base).promote


def test_a_candidate_equal_to_the_base_is_never_promoted(monkeypatch: pytest.MonkeyPatch) -> None:
    same = set(range(EVAL, EVAL + 50, 2))
    for alpha in (0.05, 1.0):
        gate = _gate(monkeypatch, _cfg(gate_alpha=alpha), same, same)
        assert not gate.promote and gate.test is not None and gate.test.p_value == 1.0


def test_the_base_is_reused_only_with_its_per_seed_outcomes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A base checkpoint that records its gate's outcomes is not evaluated again; one that records only a
    rate (before the paired gate) is, since the paired test needs each seed."""
    cfg = _cfg(eval_episodes=4)
    rate_only = {"eval_seed": EVAL, "eval_episodes": 4, "success_rate": 0.5}
    base = SimpleNamespace(metrics=rate_only, commit="c0")
    db = SimpleNamespace(rounds=lambda task=None: [])
    assert rounds._known_base_score(db, base, "toy", cfg) is None  # type: ignore[arg-type]
    base.metrics = {**rate_only, "eval_outcomes": "1100"}
    known = rounds._known_base_score(db, base, "toy", cfg)  # type: ignore[arg-type]
    assert known is not None and known["outcomes"] == "1100" and known["source"] == "checkpoint"


def test_a_promoted_candidate_is_reported_on_the_report_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[range] = []

    def fake_evaluate(policy: Any, task: str, episodes: int, seed: int, **_: Any) -> EvalResult:
        calls.append(range(seed, seed + episodes))
        return _eval(set(range(seed, seed + episodes // 2)), seed, episodes)

    monkeypatch.setattr(gate_mod, "evaluate", fake_evaluate)
    cfg = _cfg(report_episodes=10)
    base = set(range(EVAL, EVAL + 20))
    promoted = _gate(monkeypatch, cfg, base | set(range(EVAL + 20, EVAL + 30)), base)
    progress = ProgressWriter(SimpleNamespace(), 1, None)  # type: ignore[arg-type]
    report = rounds._report(cfg, object(), "toy", promoted, progress)
    assert calls == [range(REPORT, REPORT + 10)]
    assert not set(calls[0]) & set(range(cfg.eval_seed, cfg.eval_seed + cfg.eval_episodes))
    assert report == {
        "reported_success": 0.5,
        "reported_ci95": list(wilson_interval(5, 10)),
        "report_episodes": 10,
        "report_seed": REPORT,
    }
    refused = _gate(monkeypatch, cfg, base, base)
    assert rounds._report(cfg, object(), "toy", refused, progress) == {
        "reported_success": None,
        "report_episodes": 0,
    }
    assert (
        rounds._report(_cfg(report_episodes=0), object(), "toy", promoted, progress)["reported_success"]
        is None
    )
    assert len(calls) == 1  # neither a refused candidate nor report_episodes 0 evaluates anything


def test_the_offline_gate_needs_the_sign_test_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """No simulator: the candidate's mean action MSE is lower (one episode much better), but it is better
    on only 3 of 6 held-out episodes: the old rule promoted it, the sign test does not."""
    from vla_rl.evaluation_offline import OfflineEvalResult

    ids = [f"e{i}" for i in range(6)]
    errors = {"base": [1.0] * 6, "new": [0.1, 0.9, 0.9, 1.1, 1.1, 1.1]}

    def fake(policy: str, store: Any, episode_ids: list[str], **_: Any) -> OfflineEvalResult:
        per = dict(zip(episode_ids, errors[policy], strict=True))
        mse = sum(per.values()) / len(per)
        return OfflineEvalResult(
            list(episode_ids), 60, 4, mse, [mse], [mse], {}, {}, None, 0, 0.1, per_episode=per
        )

    monkeypatch.setattr(rounds, "evaluate_offline", fake)
    data = SimpleNamespace(held_out=ids, store=None, selection=SimpleNamespace(task="koch"))
    db = SimpleNamespace(current_labels=lambda ids: {})
    old = rounds._offline_gate(_cfg(gate_alpha=1.0), db, "base", "new", data)  # type: ignore[arg-type]
    assert old.promote and old.candidate < old.base
    gate = rounds._offline_gate(_cfg(), db, "base", "new", data)  # type: ignore[arg-type]
    assert not gate.promote and gate.test is not None and (gate.test.wins, gate.test.losses) == (3, 3)
    assert "sign test p 0.656" in gate.why and gate.round_metrics()["p_value"] == pytest.approx(0.65625)


def test_up_passes_the_gate_knobs_to_its_rounds(tmp_path: Path) -> None:
    from vla_rl.up.config import UpConfig
    from vla_rl.up.loop import _round_config

    cfg = UpConfig(gate_alpha=0.1, report_episodes=0, workdir=tmp_path)
    rc = _round_config(
        cfg, 1, "hub://up/policy@prod", tmp_path / "store", tmp_path, "sqlite:///x.db", cfg.data
    )
    assert (rc.gate_alpha, rc.report_episodes, rc.margin) == (0.1, 0, 0.0)
    assert (UpConfig().gate_alpha, UpConfig().report_episodes) == (0.05, 20)
    with pytest.raises(ValueError, match=r"gate_alpha: expected a false-promotion rate in \(0, 1\]"):
        UpConfig(gate_alpha=0.0)
    with pytest.raises(ValueError, match="report_episodes: expected 0 \\(off\\) or more episodes"):
        UpConfig(report_episodes=-1)
