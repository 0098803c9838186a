"""Expected mistakes get one line that says how to fix them, and exit code 2 (in-process, real servers).

No registry, offline mode, a missing repo or tag, a push without a token (refused before any training),
a port already taken (refused before anything loads), an import source that is not a LeRobot dataset,
an export target that exists.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.store import EpisodeStore
from sim.demos import record_demos
from vla_rl.cli import main
from vla_rl.hub.server import HubServer

TOKEN = "cli-errors-token"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Hub settings the CLI writes into os.environ are restored after each test."""
    for k in ("HF_ENDPOINT", "HF_TOKEN", "VLA_RL_HUB_TOKEN", "HF_HUB_OFFLINE", "VLA_RL_HUB"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    return monkeypatch


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = HubServer(tmp_path_factory.mktemp("hub"), token=TOKEN).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("s") / "store"
    record_demos(EpisodeStore(root, create=True), "kinematic/Reach-v0", episodes=1, seed=0, progress=False)
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    return err


def test_no_registry_and_offline_mode(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    nobody = f"http://127.0.0.1:{_free_port()}"
    _one_line_error(
        ["--hub", nobody, "hub", "pull", "hub://fleet/push@prod"],
        capsys,
        f"no Hub registry at {nobody}",
        "vla-rl hub serve",
        "VLA_RL_HUB",
    )
    _one_line_error(
        ["--hub", nobody, "eval", "--checkpoint", "hub://fleet/push@prod"], capsys, "no Hub registry"
    )
    # the policy server too: one line naming the registry and how to start one (was a 20-line traceback)
    _one_line_error(
        ["--hub", nobody, "serve", "--checkpoint", "hub://fleet/push@v1", "--port", "0"],
        capsys,
        f"no Hub registry at {nobody}",
        "vla-rl hub serve",
    )
    env.setenv("HF_HUB_OFFLINE", "1")
    _one_line_error(
        ["--hub", nobody, "hub", "pull", "hub://fleet/push@prod"], capsys, "HF_HUB_OFFLINE=1 blocks"
    )


def test_missing_repo_or_tag(
    env: pytest.MonkeyPatch, hub: HubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _one_line_error(["--hub", hub.url, "hub", "pull", "hub://nobody/nothing@main"], capsys, "no such repo")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    env.setenv("VLA_RL_HUB_TOKEN", TOKEN)
    assert main(["--hub", hub.url, "hub", "push", str(folder), "--repo", "fleet/errs"]) == 0
    capsys.readouterr()
    _one_line_error(["--hub", hub.url, "hub", "pull", "hub://fleet/errs@no-such-tag"], capsys, "no such tag")


def test_a_push_without_a_token_is_refused_before_training(
    env: pytest.MonkeyPatch, hub: HubServer, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sft"
    argv = [
        "--hub",
        hub.url,
        "train",
        "sft",
        "--store",
        str(store),
        "--out",
        str(out),
        "--push",
        "hub://fleet/x",
    ]
    _one_line_error(argv, capsys, "needs a token", "VLA_RL_HUB_TOKEN")
    assert not out.exists(), "nothing trained"
    _one_line_error(["--hub", hub.url, "--hub-token", "wrong", *argv[2:]], capsys, "refused the token")
    assert not out.exists()


def test_a_taken_port_is_refused_before_anything_loads(
    env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        _one_line_error(["collect", "--store", str(tmp_path / "s"), "--port", port], capsys, "already in use")
        assert not (tmp_path / "s").exists(), "no store was created"
        _one_line_error(
            ["hub", "serve", "--data", str(tmp_path / "h"), "--port", port], capsys, "already in use"
        )


def test_lerobot_import_and_export_mistakes(
    env: pytest.MonkeyPatch, store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_dataset = tmp_path / "photos"
    not_a_dataset.mkdir()
    (not_a_dataset / "a.jpg").write_bytes(b"x")
    _one_line_error(
        ["store", "import-lerobot", str(not_a_dataset), str(tmp_path / "new-store")],
        capsys,
        "not a LeRobot v3 dataset",
    )
    assert not (tmp_path / "new-store").exists(), "a failed import leaves nothing"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    _one_line_error(
        ["store", "export-lerobot", str(store), str(taken), "--repo-id", "fleet/x"], capsys, "already exists"
    )
    assert (taken / "keep.txt").read_text() == "mine"


def test_serve_with_nothing_to_serve_is_one_line(
    env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first checkpoint cannot be loaded: there is nothing to serve, so the command stops with one line
    naming --checkpoint and why (it printed a traceback after "still serving the previous one")."""
    missing = tmp_path / "no-such-checkpoint"
    _one_line_error(
        ["serve", "--checkpoint", str(missing), "--port", "0"],
        capsys,
        f"--checkpoint {missing}: no such folder",
    )


def test_eval_latency_mistakes_are_one_line_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["eval", "--checkpoint", "no/such/checkpoint"]
    _one_line_error(
        [*base, "--latency", "gauss:10ms"], capsys, "--latency: delay: expected one of const:100ms"
    )
    _one_line_error([*base, "--latency", "const:100"], capsys, "expected a duration such as 100ms")
    _one_line_error(
        [*base, "--latency", "0", "--merge", "median"], capsys, "--latency: merge: expected one of"
    )
    _one_line_error(
        [*base, "--latency", "0", "--when-starved", "coast"], capsys, "when_starved: expected one of"
    )
