"""Post-training rounds end to end against the Hub-compatible registry: gate, promotion, DB records, CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleet.db import MetadataDB
from fleet.store import EpisodeStore
from sim.demos import record_demos
from vla_rl.cli import main as cli_main
from vla_rl.hub.checkpoint import read_info
from vla_rl.hub.registry import configure_hub, pull, push_folder, resolve
from vla_rl.hub.server import HubServer
from vla_rl.rounds import RoundConfig, RoundOptions, start_round
from vla_rl.train.algorithms import make_config
from vla_rl.train.sft import SFTConfig, train_sft

TASK = "maniskill/PushCube-v1"
TOKEN = "round-token"
REPO = "fleet/pushcube"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[HubServer, Path, str]:
    """Hub + store with 10 demos + a small SFT base (~50% on PushCube) pushed and tagged prod."""
    hub = HubServer(tmp_path_factory.mktemp("hub"), token=TOKEN).start()
    configure_hub(hub.url, TOKEN)
    root = tmp_path_factory.mktemp("rounds") / "store"
    record_demos(EpisodeStore(root, create=True), TASK, episodes=10, noise=0.3, seed=0, progress=False)
    sft = train_sft(
        SFTConfig(
            task=TASK,
            store=root,
            out=tmp_path_factory.mktemp("sft"),
            steps=300,
            batch_size=64,
            d_model=64,
            n_layers=1,
            expert_n_layers=2,
            instruction_encoder="none",
            checkpoint_every=300,
            progress=False,
        )
    )
    push_folder(sft.checkpoint, REPO, message="base", tag="prod")
    yield hub, root, f"hub://{REPO}@prod"
    hub.stop()


def _cfg(
    root: Path, base: str, out: Path, algo: str = "awr", overrides: dict | None = None, **kw: object
) -> RoundConfig:
    """A round of ``algo`` on ``root`` from ``base``: round options from ``kw``, the rest to the trainer."""
    names = {f.name for f in dataclasses.fields(RoundOptions)}
    options = {"eval_episodes": 4, "eval_envs": 1, "report_episodes": 4}
    options |= {k: v for k, v in kw.items() if k in names}
    knobs = overrides if overrides is not None else {"value_steps": 40, "steps": 40, "batch_size": 32}
    train = make_config(
        algo,
        base=base,
        store=root,
        out=out,
        progress=False,
        **knobs,
        **{k: v for k, v in kw.items() if k not in names},
    )
    return RoundConfig(train=train, **options)  # type: ignore[arg-type]


def test_gate_refuses_a_worse_checkpoint_then_promotes(setup, tmp_path: Path) -> None:
    _hub, root, base = setup
    db = MetadataDB.for_store(root)
    prod_before = resolve(base)
    # A deliberately broken candidate: a huge learning rate wrecks the policy.
    wrecked = start_round(
        _cfg(
            root,
            base,
            tmp_path,
            overrides={"value_steps": 20, "steps": 30, "lr": 0.5, "warmup_steps": 1, "ema_decay": 0.0},
        ),
        db=db,
    )
    m = wrecked.metrics
    assert wrecked.status == "succeeded" and m["base_success"] > 0
    assert m["success"] < m["base_success"] and not m["gate"]["passed"]
    assert not wrecked.promoted and resolve(base) == prod_before  # prod did not move
    assert wrecked.checkpoint_ref == f"hub://{REPO}@round-{wrecked.id}"
    assert resolve(wrecked.checkpoint_ref) == wrecked.checkpoint_revision  # pushed and tagged anyway
    assert wrecked.base_revision == prod_before

    # A permissive gate promotes: prod moves to the new commit, whose card records the evaluation.
    ok = start_round(_cfg(root, base, tmp_path, algo="recap", margin=-0.99, gate_alpha=1.0), db=db)
    assert ok.promoted and resolve(base) == ok.checkpoint_revision != prod_before
    assert ok.metrics["base_eval_source"] == f"round {wrecked.id}"  # same commit + seeds: not re-run
    pulled = pull(base)
    info = read_info(pulled.path)
    assert info.lineage.algorithm == "recap" and info.lineage.parent_revision == prod_before
    assert info.lineage.round == ok.id and info.metrics["success_rate"] == ok.metrics["success"]
    assert "success" in (Path(pulled.path) / "README.md").read_text().lower()
    assert db.round_revisions()[ok.id] == [ok.checkpoint_revision]
    assert sum(ok.data["episode_lengths"].values()) == ok.data["frames"] > 0  # the exact data snapshot
    assert info.lineage.data["digest"] == ok.data["digest"]
    assert [r.id for r in db.rounds(task=TASK)][-2:] == [wrecked.id, ok.id]


def test_a_distill_round_is_gated_against_its_parent(setup, tmp_path: Path) -> None:
    """A few-step student is a round's output like any other: served with its own K by the gate, scored
    against its K = 10 parent on the same seeds, and held back when worse (a wrecking learning rate)."""
    _hub, root, base = setup
    prod_before = resolve(base)
    wrecked = start_round(
        _cfg(
            root, base, tmp_path, algo="distill",
            overrides={"student_steps": 1, "steps": 20, "warmup_steps": 1, "lr": 0.5, "batch_size": 32},
        ),
        db=MetadataDB.for_store(root),
    )  # fmt: skip
    m = wrecked.metrics
    assert wrecked.status == "succeeded" and m["base_success"] > 0
    assert m["success"] < m["base_success"] and not m["gate"]["passed"]
    assert not wrecked.promoted and resolve(base) == prod_before
    info = read_info(pull(wrecked.checkpoint_ref).path)
    assert info.lineage.algorithm == "distill" and info.lineage.parent_revision == prod_before
    assert info.model_config["num_inference_steps"] == 1 and info.lineage.round == wrecked.id


def test_failed_round_is_recorded(setup, tmp_path: Path, db_url: str) -> None:
    _hub, root, base = setup
    db = MetadataDB.for_store(root) if db_url.startswith("sqlite") else MetadataDB(db_url)
    n = len(db.rounds())
    with pytest.raises(ValueError, match="colour: not a AWRConfig field"):
        _cfg(root, base, tmp_path, overrides={"colour": "red"})  # refused before a round exists
    assert len(db.rounds()) == n
    with pytest.raises(ValueError, match="no closed episodes"):
        start_round(_cfg(root, base, tmp_path, data="robot=nobody"), db=db)
    last = db.rounds()[-1]
    assert last.status == "failed" and "no closed episodes" in (last.error or "") and last.finished_at


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="algo: expected one of"):
        make_config("dqn", base="hub://a/b@prod", store=tmp_path, out=tmp_path)
    with pytest.raises(ValueError, match="repo: the base is a local folder"):
        RoundConfig(train=make_config("awr", base=str(tmp_path), store=tmp_path, out=tmp_path))
    with pytest.raises(ValueError, match="base: a round"):
        RoundConfig(train=make_config("sft", store=tmp_path, out=tmp_path), push=False)
    with pytest.raises(ValueError, match="variant: the recap algorithm fixes it"):
        make_config("recap", base="b", store=tmp_path, out=tmp_path, variant="awr")
    assert RoundConfig(
        train=make_config("flow-sde", base="hub://a/b@prod", store=tmp_path, out=tmp_path)
    ).algo == ("flow-sde")


def test_cli_round_list_show_and_errors(setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hub, root, base = setup
    common = ["--hub", hub.url, "--hub-token", TOKEN]
    rc = cli_main(
        [
            *common,
            "round",
            "start",
            "--algo",
            "awr",
            "--base",
            base,
            "--store",
            str(root),
            "--out",
            str(tmp_path),
            "--no-push",
            "--eval-episodes",
            "2",
            "--eval-envs",
            "1",
            "--value-steps",
            "10",
            "--steps",
            "10",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "awr" in out and "gate:" in out
    assert cli_main([*common, "round", "list", "--store", str(root)]) == 0
    listing = capsys.readouterr().out
    assert "succeeded" in listing and "awr" in listing  # (no dependence on other tests' rounds)
    rid = MetadataDB.for_store(root).rounds()[-1].id
    assert cli_main([*common, "round", "show", str(rid), "--store", str(root)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == rid and shown["config"]["algo"] == "awr" and shown["promoted"] is False
    assert cli_main([*common, "round", "show", "9999", "--store", str(root)]) == 2
    assert "no round 9999" in capsys.readouterr().err
    rc = cli_main(
        [*common, "round", "start", "--algo", "awr", "--base", base, "--store", str(root), "--data", "bogus"]
    )
    assert rc == 2 and "expected key=value" in capsys.readouterr().err
    rc = cli_main(
        [*common, "round", "start", "--preset", "kinematic-qam-pi", "--algo", "awr", "--base", base]
    )
    assert rc == 2 and "is a recipe for qam, not awr" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("algo", "overrides"),
    [
        (
            "qam",
            {
                "offline_steps": 4,
                "critic_mc_steps": 1,
                "critic_warmup": 2,
                "batch_size": 16,
                "flow_steps": 3,
                "members": 2,
                "critic_hidden": [32],
            },
        ),
        (
            "flow-sde",
            {"env_steps": 40, "num_envs": 1, "rollout_steps": 20, "minibatch_size": 8, "update_epochs": 1},
        ),
    ],
)
def test_rounds_run_qam_and_ppo(setup, tmp_path: Path, algo: str, overrides: dict) -> None:
    _hub, root, base = setup
    rec = start_round(
        _cfg(root, base, tmp_path, algo=algo, push=False, eval_episodes=1, overrides=overrides),
        db=MetadataDB.for_store(root),
    )
    assert rec.status == "succeeded" and not rec.promoted and rec.checkpoint_revision is None
    info = read_info(rec.checkpoint_ref)
    assert info.lineage.algorithm == algo and info.lineage.round == rec.id
    assert info.metrics["round"] == rec.id and "success_rate" in info.metrics


def test_round_with_a_camera_policy(tmp_path: Path) -> None:
    """A camera (rgb) policy through a whole round: demos with images -> SFT with the image encoder ->
    RECAP round (value on the trunk features, advantage-conditioned flow) -> rgb evaluation against the
    base on the same seeds -> pushed, tagged checkpoint whose spec still has the camera. Uses the
    physics-free kinematic task so the cameras cost nothing."""
    task, repo = "kinematic/Reach-v0", "fleet/reach-rgb"
    hub = HubServer(tmp_path / "hub", token=TOKEN).start()
    try:
        configure_hub(hub.url, TOKEN)
        root = tmp_path / "store"
        record_demos(
            EpisodeStore(root, create=True),
            task,
            episodes=6,
            noise=0.3,
            obs="rgb",
            image_size=32,
            progress=False,
        )
        sft = train_sft(
            SFTConfig(
                task=task,
                store=root,
                out=tmp_path / "sft",
                steps=30,
                batch_size=16,
                chunk_len=4,
                n_exec=2,
                d_model=32,
                n_layers=1,
                expert_n_layers=1,
                instruction_encoder="none",
                checkpoint_every=30,
                progress=False,
            )
        )
        assert [c.name for c in read_info(sft.checkpoint).robot_spec.cameras] == ["top_camera"]
        push_folder(sft.checkpoint, repo, message="base", tag="prod")
        db = MetadataDB.for_store(root)
        rec = start_round(
            _cfg(
                root,
                f"hub://{repo}@prod",
                tmp_path / "round",
                algo="recap",
                task=task,
                margin=-0.99,
                gate_alpha=1.0,
                overrides={"value_steps": 10, "steps": 10, "batch_size": 8},
            ),
            db=db,
        )
        assert rec.status == "succeeded" and rec.promoted
        assert rec.metrics["base_success"] is not None and rec.metrics["success"] is not None
        assert resolve(f"hub://{repo}@prod") == rec.checkpoint_revision
        pulled = read_info(pull(rec.checkpoint_ref).path)
        assert [c.name for c in pulled.robot_spec.cameras] == ["top_camera"] and pulled.robot_spec.cameras[
            0
        ].height == 32
        assert pulled.lineage.algorithm == "recap" and pulled.lineage.round == rec.id
    finally:
        hub.stop()
