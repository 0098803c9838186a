"""scripts/lock.sh, named in requirements/lock.txt's header: freezing this (lock-keyed) venv reproduces the
lock, and a bad argument is a one-line error with exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins(path: Path) -> set[str]:
    return {ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")}


def test_lock_script_from_this_venv_reproduces_the_lock(tmp_path: Path) -> None:
    lock = ROOT / "requirements/lock.txt"
    assert "Regenerate: scripts/lock.sh" in lock.read_text().splitlines()[1]
    out = tmp_path / "lock.txt"
    r = subprocess.run(
        ["bash", str(ROOT / "scripts/lock.sh"), "--from-venv", sys.prefix, "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert out.read_text().splitlines()[:2] == lock.read_text().splitlines()[:2]
    pins = _pins(out)
    assert pins == _pins(lock)  # setup.sh keys the venv on the lock's hash: the same set
    assert not any(p.lower().startswith(("robosuite==", "vla-rl", "vla_rl")) for p in pins)

    bad = subprocess.run(
        ["bash", str(ROOT / "scripts/lock.sh"), "--from-venv"], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "--from-venv: expected" in bad.stderr and "Traceback" not in bad.stderr
