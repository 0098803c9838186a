"""scripts/setup.sh with two checkouts on one machine (issue 45, item 11): each runs its own code.

The dependency environment is shared (keyed by the lock's hash, ~8 GB): here it is the one this test runs
in, reached through a temporary VLA_RL_VENV_ROOT, and it is never written to. Each checkout gets a .venv of
its own layered on it, with its own vla-rl installed editable. Before, vla-rl was installed editable into
the shared environment itself, so the checkout that ran setup last was the code every checkout ran.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info", "build", "dist", "tmp")


def _deps_env() -> Path:
    """The shared environment behind the running interpreter: a layered .venv names it in its marker;
    an older setup's .venv is a link to it."""
    prefix = Path(sys.prefix)
    marker = prefix / ".vla-rl-deps"
    deps = Path(marker.read_text().strip()) if marker.is_file() else prefix.resolve()
    if not (deps / ".complete").is_file():
        pytest.fail(f"{deps} is not a complete environment made by scripts/setup.sh")
    return deps


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return env | {
        "VLA_RL_VENV_ROOT": str(root),
        "VLA_RL_SKIP_APT": "1",
        "VLA_RL_PYTHON": sys._base_executable,  # type: ignore[attr-defined]
        "PIP_NO_INDEX": "1",  # nothing is downloaded
    }


def _checkout(tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(REPO, dst, ignore=SKIP, symlinks=True)
    version = dst / "vla_rl" / "core" / "version.py"
    version.write_text(version.read_text().replace('__version__ = "0.1.0"', f'__version__ = "0.1.0+{name}"'))
    return dst


def _setup(checkout: Path, env: dict[str, str]) -> str:
    out = subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stderr


def _run(checkout: Path, env: dict[str, str], *argv: str, cwd: Path) -> str:
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (argv, out.stdout, out.stderr)
    return out.stdout.strip()


WHERE = "import fleet, server, vla_rl, vla_rl_client; print(fleet.__file__, server.__file__, vla_rl.__file__, vla_rl_client.__file__)"
CHILD = (
    "import subprocess, sys; subprocess.run([sys.executable, '-m', 'vla_rl.cli', '--version'], check=True)"
)


def test_two_checkouts_each_run_their_own_code(tmp_path: Path) -> None:
    deps = _deps_env()
    before = sorted(p.name for p in (deps / "lib").rglob("site-packages/*"))
    root = tmp_path / "venvs"
    root.mkdir()
    env = _env(root)
    a, b = _checkout(tmp_path, "a"), _checkout(tmp_path, "b")
    key = _run(a, env, "bash", "-c", f'source scripts/setup.sh && env_key "{env["VLA_RL_PYTHON"]}"', cwd=a)
    (root / key).symlink_to(deps)  # the shared environment is there already: nothing to install

    _setup(a, env)
    _setup(b, env)  # b is set up last: before, every checkout then ran b's code
    elsewhere = tmp_path / "elsewhere"  # not inside a checkout: '' on sys.path must not decide
    elsewhere.mkdir()
    for checkout in (a, b):
        venv = checkout / ".venv"
        assert venv.is_dir() and not venv.is_symlink()
        version = _run(checkout, env, str(venv / "bin" / "vla-rl"), "--version", cwd=elsewhere)
        assert version == f"vla-rl 0.1.0+{checkout.name}"
        files = _run(checkout, env, str(venv / "bin" / "python"), "-c", WHERE, cwd=elsewhere).split()
        assert all(Path(f).is_relative_to(checkout) for f in files), files
        # A process the checkout's code starts (a store writer, a test's child) runs the same code.
        child = _run(checkout, env, str(venv / "bin" / "python"), "-c", CHILD, cwd=elsewhere)
        assert child == f"vla-rl 0.1.0+{checkout.name}"
        # The shared dependencies are there (torch, zarr, grpc...), from the shared environment.
        torch_file = _run(
            checkout,
            env,
            str(venv / "bin" / "python"),
            "-c",
            "import torch; print(torch.__file__)",
            cwd=elsewhere,
        )
        assert Path(torch_file).resolve().is_relative_to(deps.resolve())

    # Idempotent and fast when everything exists: the layer is kept, only the editable install reruns.
    marker = (a / ".venv" / ".vla-rl-deps").stat().st_mtime_ns
    t0 = time.monotonic()
    log = _setup(a, env)
    assert time.monotonic() - t0 < 120 and "is ready" in log and "layering" not in log, log
    assert (a / ".venv" / ".vla-rl-deps").stat().st_mtime_ns == marker
    assert _run(a, env, str(a / ".venv" / "bin" / "vla-rl"), "--version", cwd=elsewhere) == "vla-rl 0.1.0+a"
    # A .venv link an older setup left (to the shared environment) is replaced by a layered .venv.
    shutil.rmtree(b / ".venv")
    (b / ".venv").symlink_to(root / key)
    _setup(b, env)
    assert not (b / ".venv").is_symlink()
    assert _run(b, env, str(b / ".venv" / "bin" / "vla-rl"), "--version", cwd=elsewhere) == "vla-rl 0.1.0+b"
    assert sorted(p.name for p in (deps / "lib").rglob("site-packages/*")) == before  # never written to
