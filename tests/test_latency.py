"""The latency world (sim/latency.py): delay specs and per-episode draws, and the timeline on a scripted
vector env: which observation the policy saw, when its chunk arrived, which actions executed, starved
steps, merges at chunk boundaries, and the action jumps recorded there."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_rollout import Planner, ScriptedVectorEnv

from sim.latency import (
    Delay,
    LatencyOptions,
    LatencyRollout,
    LatencySpec,
    RequestContext,
    to_steps,
)
from sim.rollout import ChunkRollout, EpisodeRecord


def _options(spec: str = "0", **kw: Any) -> LatencyOptions:
    kw.setdefault("merge", "latest_only")
    return LatencyOptions(LatencySpec.parse(spec), gripper=None, **kw)


def _run(
    spec: str, steps: int, ends: list[tuple[int, str]] | None = None, **kw: Any
) -> tuple[ScriptedVectorEnv, Planner, list[EpisodeRecord]]:
    env = ScriptedVectorEnv(ends or [(100, "truncated")])
    planner = Planner()
    episodes: list[EpisodeRecord] = []
    LatencyRollout(env, planner, _options(spec, **kw), on_episode=episodes.append).run(steps)
    return env, planner, episodes


def _executed(env: ScriptedVectorEnv, robot: int = 0) -> list[float]:
    return [float(a[robot, 0]) for a in env.actions]


# ---------------------------------------------------------------- specs and draws
def test_specs_parse_and_print() -> None:
    assert LatencySpec.parse("const:100ms").network == Delay("const", 100.0)
    assert LatencySpec.parse("0").is_zero and LatencySpec.parse("none").is_zero
    assert LatencySpec.parse("uniform:50ms-0.2s").network == Delay("uniform", 50.0, 200.0)
    assert LatencySpec.parse("exp:100ms").network == Delay("exp", 100.0, 400.0)
    assert LatencySpec.parse("exp:100ms:300ms").network == Delay("exp", 100.0, 300.0)
    both = LatencySpec.parse("net=exp:100ms, obs=const:50ms")
    assert both.network == Delay("exp", 100.0, 400.0) and both.observation == Delay("const", 50.0)
    assert LatencySpec.parse(str(both)) == both


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("const:100", "expected a duration such as 100ms"),
        ("const:-5ms", "expected a duration"),
        ("uniform:50ms", "expected uniform:LOW-HIGH"),
        ("uniform:200ms-50ms", "expected low <= high"),
        ("exp:100ms:50ms", "expected the cap >= the mean"),
        ("gauss:10ms", "expected one of const:100ms"),
        ("net=const:1ms,net=const:2ms", "each once"),
        ("lag=const:1ms", "net=DELAY,obs=DELAY"),
    ],
)
def test_bad_specs_say_what_was_expected(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LatencySpec.parse(spec)


def test_bad_options_name_the_field() -> None:
    with pytest.raises(ValueError, match="merge: expected one of"):
        LatencyOptions(merge="median")
    with pytest.raises(ValueError, match="chunk_size_threshold: expected"):
        LatencyOptions(chunk_size_threshold=1.5)
    with pytest.raises(ValueError, match="when_starved: expected one of"):
        LatencyOptions(when_starved="coast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="control_hz"):
        LatencyOptions(control_hz=0)


def test_delays_become_whole_control_steps() -> None:
    assert [to_steps(ms, 20.0) for ms in (0, 1, 50, 51, 100, 200, 300)] == [0, 1, 1, 2, 2, 4, 6]


def test_draws_follow_the_episode_seed_and_stay_in_range() -> None:
    spec = LatencySpec.parse("net=uniform:50ms-200ms,obs=exp:100ms:300ms")
    draws = [spec.draw(seed, 20.0) for seed in range(400)]
    assert draws[:5] == [spec.draw(seed, 20.0) for seed in range(5)]  # same seed, same delays
    net = np.array([d.network_ms for d in draws])
    obs = np.array([d.observation_ms for d in draws])
    assert net.min() >= 50 and net.max() <= 200 and len(set(net.tolist())) == len(net)
    assert obs.min() >= 0 and obs.max() <= 300 and (obs == 300).any()  # the cap is hit
    assert np.mean(obs[obs < 300]) == pytest.approx(85, abs=20)  # a truncated exponential of mean 100
    assert all(d.network_steps == to_steps(d.network_ms, 20.0) for d in draws)


# ---------------------------------------------------------------- the timeline
def test_network_delay_the_robot_starves_then_executes_what_is_not_yet_stale() -> None:
    # chunks of 4 (robot 0's chunk at obs step t: 10 t + k), sent when 2 are left, arriving 2 steps later
    env, planner, _ = _run("const:100ms", 8)
    assert [state[0][1] for _, state in planner.calls] == [0, 2, 4, 6]  # sent at 0, 2, 4, 6 with fresh obs
    # steps 0 and 1 wait for the first chunk (standing still); its actions for steps 0 and 1 are stale
    assert _executed(env) == [0, 0, 2, 3, 22, 23, 42, 43]


def test_observation_delay_the_policy_sees_an_old_frame() -> None:
    env, planner, _ = _run("net=const:0ms,obs=const:100ms", 8)
    # requests at steps 0, 2, 4, 6 carry the frames of steps 0 (clamped to the episode's first), 0, 2, 4
    assert [state[0][1] for _, state in planner.calls] == [0, 0, 2, 4]
    # the robot stamps the chunk with the step it sent it: the plan of an old frame runs late
    assert _executed(env) == [0, 1, 0, 1, 20, 21, 40, 41]


def test_zero_latency_latest_only_is_the_receding_horizon_driver() -> None:
    ends = [(7, "terminated"), (11, "truncated")]
    env, _, episodes = _run("0", 30, ends)
    reference = ScriptedVectorEnv(ends)
    ChunkRollout(reference, Planner(), 2).run(30)
    np.testing.assert_array_equal(np.stack(env.actions), np.stack(reference.actions))
    assert episodes and all(ep.latency is not None and ep.latency.starved == 0 for ep in episodes)


def test_merges_blend_the_overlap() -> None:
    env, _, _ = _run("0", 4, merge="weighted_average")
    # step 2: the old chunk's 2 (for step 2) and the new chunk's 20 -> 0.3 * 2 + 0.7 * 20
    assert _executed(env) == pytest.approx([0, 1, 0.3 * 2 + 0.7 * 20, 0.3 * 3 + 0.7 * 21])


def test_starved_steps_stand_still_or_hold_the_last_action() -> None:
    # 150 ms = 3 steps > the 1 action left when a request goes out after the first chunk
    still, _, [ep] = _run("const:150ms", 12, [(12, "truncated")])
    held, _, _ = _run("const:150ms", 12, [(12, "truncated")], when_starved="hold")
    assert _executed(still) == [0, 0, 0, 3, 0, 0, 33, 0, 0, 63, 0, 0]
    assert _executed(held) == [0, 0, 0, 3, 3, 3, 33, 33, 33, 63, 63, 63]
    assert ep.latency is not None and ep.latency.network_steps == 3
    assert ep.latency.starved == 3 + 3 * 2 and ep.latency.stale_dropped == 3 * 3
    assert ep.latency.requests == 4 and ep.latency.chunks == 3  # the fourth was in flight at the end
    assert ep.latency.jumps == pytest.approx([33.0, 63.0])  # from standing still; none at the first chunk


def test_standing_still_keeps_the_gripper() -> None:
    env = ScriptedVectorEnv([(100, "truncated")])
    options = LatencyOptions(LatencySpec.parse("const:150ms"), merge="latest_only", gripper=0)
    LatencyRollout(env, Planner(), options).run(6)
    # before the first action the gripper is open (+1), after it keeps the last command (3)
    assert _executed(env) == [1, 1, 1, 3, 3, 3]


def test_jumps_are_measured_where_a_chunk_joined() -> None:
    _, _, [ep] = _run("const:100ms", 8, [(8, "truncated")])
    # executed [0, 0, 2, 3, 22, 23, 42, 43]: the first chunk joined at step 2, the next ones at 4 and 6
    assert ep.latency is not None
    assert ep.latency.jumps == pytest.approx([19.0, 19.0])
    assert ep.latency.mean_jump == pytest.approx(19.0) and ep.latency.max_jump == pytest.approx(19.0)


def test_each_episode_starts_a_new_queue_and_its_own_draws() -> None:
    _, planner, episodes = _run("uniform:0ms-300ms", 40, [(10, "truncated")])
    assert [ep.seed for ep in episodes] == [0, 1, 2, 3]
    lat = LatencySpec.parse("uniform:0ms-300ms")
    for ep in episodes:
        assert ep.latency is not None and ep.length == 10
        assert ep.latency.network_steps == lat.draw(ep.seed, 20.0).network_steps
    # every episode's first request carries its own first frame (step 0 of episode j)
    firsts = [state[0] for _, state in planner.calls if state[0][1] == 0]
    assert [f[2] for f in firsts][:4] == [0, 1, 2, 3]


def test_robots_sending_in_the_same_step_share_one_call() -> None:
    _, planner, _ = _run("const:100ms", 8, [(100, "truncated"), (100, "truncated")])
    assert [robots for robots, _ in planner.calls] == [[0, 1]] * 4


def test_a_context_proposer_gets_the_delay_and_the_queued_actions() -> None:
    seen: list[RequestContext] = []

    class WithContext(Planner):
        wants_context = True

        def __call__(
            self, robots: list[int], obs: dict[str, Any], context: list[RequestContext]
        ) -> np.ndarray:  # type: ignore[override]
            seen.extend(context)
            return super().__call__(robots, obs)

    env = ScriptedVectorEnv([(100, "truncated")])
    LatencyRollout(env, WithContext(), _options("const:100ms")).run(6)
    assert [(c.step, c.delay_steps) for c in seen] == [(0, 2), (2, 2), (4, 2)]
    assert seen[0].queued.size == 0
    np.testing.assert_array_equal(seen[1].queued[:, 0], [2, 3])  # what runs while the request is out


# ---------------------------------------------------------------- training rollouts with latency
class SlopePolicy:
    """Chunks whose action k is ``[0.1 (k + 1), 0, 0, -1]`` for every robot (a kinematic Reach spec)."""

    chunk_len = 4

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def predict_chunks(self, obs: dict[str, Any], seed: int) -> np.ndarray:
        chunk = np.zeros((self.chunk_len, self.spec.action_dim), np.float32)
        chunk[:, 0] = 0.1 * np.arange(1, self.chunk_len + 1)
        chunk[:, -1] = -1.0
        return np.repeat(chunk[None], len(obs["state"]), axis=0)


def test_recorded_rollouts_hold_what_the_robot_executed_under_latency(tmp_path: Any) -> None:
    import sim
    from fleet.store import EpisodeStore
    from sim.demos import record_rollouts

    with sim.make_env("kinematic/Reach-v0") as env:
        spec = env.spec
    store = EpisodeStore(tmp_path / "store", create=True)
    options = LatencyOptions(LatencySpec.parse("const:100ms"), merge="latest_only")
    rep = record_rollouts(
        store,
        SlopePolicy(spec),
        "kinematic/Reach-v0",
        episodes=1,
        max_episode_steps=8,
        progress=False,
        latency=options,
    )
    ep = store.read_episode(rep.episode_ids[0], cameras=False)
    # two steps standing still (gripper open) while the first chunk is out, then its actions for steps 2, 3
    np.testing.assert_allclose(ep.action[:, 0], [0, 0, 0.3, 0.4, 0.3, 0.4, 0.3, 0.4], atol=1e-6)
    np.testing.assert_allclose(ep.action[:, -1], [1, 1, -1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(ep.proposed_action, ep.action)


def test_awr_pi_names_a_bad_latency_knob() -> None:
    from vla_rl.train.awr_pi import AWRPIConfig

    base = {"task": "kinematic/Reach-v0", "base": "b", "store": "s", "out": "o"}
    assert AWRPIConfig(**base, latency="exp:100ms").latency_options() is not None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="latency / latency_merge: delay: expected one of"):
        AWRPIConfig(**base, latency="gauss:1ms")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="latency / latency_merge: merge: expected"):
        AWRPIConfig(**base, latency="0", latency_merge="median")  # type: ignore[arg-type]


def test_evaluation_asks_a_given_context_proposer() -> None:
    import sim
    from vla_rl.evaluation import evaluate

    with sim.make_env("kinematic/Reach-v0") as env:
        policy = SlopePolicy(env.spec)
    seen: list[RequestContext] = []

    class RTCLike:
        wants_context = True

        def __call__(
            self, robots: list[int], obs: dict[str, Any], context: list[RequestContext]
        ) -> np.ndarray:
            seen.extend(context)
            return policy.predict_chunks(obs, 0)

    options = LatencyOptions(LatencySpec.parse("const:100ms"), merge="latest_only")
    res = evaluate(
        policy,
        "kinematic/Reach-v0",
        episodes=1,
        num_envs=1,
        max_episode_steps=6,
        progress=False,
        latency=options,
        propose=RTCLike(),
    )
    assert res.episodes == 1 and [(c.step, c.delay_steps) for c in seen] == [(0, 2), (2, 2), (4, 2)]
