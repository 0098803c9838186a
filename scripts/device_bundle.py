"""Pack what a borrowed GPU machine lacks to run ``bench.rl``'s training stage in simulation.

The machine (docs/benchmarks.md, "On a GPU") has Python 3.12 with PyTorch, numpy, transformers and the
usual scientific stack, no package registry, and a 64 MiB limit on what travels with the working tree.
This packs, into ``<out>/site.tar.xz`` (unpack it on ``PYTHONPATH``):

* SAPIEN and ManiSkill3 stripped to what state-only tabletop tasks load with no renderer (``sim/maniskill.py``
  builds such envs with ``render_backend="none"``): every Python file, the Panda's URDF/SRDF and collision
  meshes, the PartNet-Mobility metadata ManiSkill reads at import; no textures, environment maps, visual
  meshes, headers or other robots (113 MB of wheels -> ~31 MB packed; the whole bundle ~40 MB);
* the pure-Python and small compiled packages the training path imports that the machine lacks (``PACKAGES``);
* ``xlibs/``: the X11 client libraries ``pysapien`` links against (never used without a display);
* ``IPython/``: a stand-in for the one name ManiSkill imports from it at import time (a Jupyter helper
  that state-only training never calls), instead of IPython and its ~40 MB of dependencies;
* ``instruction_embeddings.json``: the frozen MiniLM embedding of each task's instruction, computed here
  (the 88 MB encoder does not fit); ``scripts/device_train.py`` seeds the embedder's cache with it, so the
  policy sees exactly the vector it sees here.

SAPIEN still needs a Vulkan device to build render materials: carry the Vulkan loader's Debian packages too
(``.gl/``, see scripts/device_ppo.sh). To check a bundle here first, put a ``sitecustomize.py`` in the unpack
folder that replaces this venv's site-packages on ``sys.path`` with a folder of symlinks to only the packages
the machine has (its list: the device tool's KINDS.md), then run scripts/device_ppo.sh with ``PYTHON`` and
``SITE`` pointing there: a module the bundle lacks then fails here as it would there.

It also copies each seed's demonstration store and its ``demos.json`` (``bench.rl``'s first stage) to
``<out>/work/seedN`` so the machine starts at the SFT stage. Run from the repository root::

    python scripts/device_bundle.py --work runs/pc --seeds 0 1 2 --out .carry

With ``--bases`` it copies each seed's SFT base instead (``sft.json`` and ``sft/checkpoints/last``, ~6 MB
each), so the machine post-trains the very bases already evaluated here; it then records the demos (and
``--rollouts``) itself in seconds: stores with fleet rollouts are too large for the carry limit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# Imported by the training path (the PPO trainer, the sim workers, bench.rl) and missing there.
PACKAGES = (
    "zarr",
    "numcodecs",
    "donfig",
    "google_crc32c",
    "msgspec",
    "sqlalchemy",
    "alembic",
    "mako",
    "gymnasium",
    "farama_notifications",
    "dacite",
    "pytorch_kinematics",
    "arm_pytorch_utilities",
    "pytorch_seed",
    "mujoco",
    "glfw",
    "trimesh",
    "transforms3d",
    "defusedxml",
)
X_LIBS = ("libX11.so.6", "libxcb.so.1", "libXau.so.6", "libXdmcp.so.6", "libbsd.so.0", "libmd.so.0")
IPYTHON_STANDIN = '''"""Stand-in for IPython on a headless training machine: ManiSkill imports these names at import time
for a Jupyter video helper that state-only training never calls (scripts/device_bundle.py)."""


class HTML:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("IPython is not installed here (a stand-in from scripts/device_bundle.py)")


def display(*args, **kwargs):
    raise RuntimeError("IPython is not installed here (a stand-in from scripts/device_bundle.py)")
'''


def _keep_mani_skill(rel: str, size: int) -> bool:
    if rel.endswith(".py"):
        return True
    if rel.startswith("mani_skill/assets/"):
        panda = "mani_skill/assets/robots/panda/"
        return (
            rel.startswith("mani_skill/assets/partnet_mobility/meta/")
            or (rel.startswith(panda) and rel.count("/") == 4 and rel.endswith((".urdf", ".srdf")))
            or rel.startswith(panda + "franka_description/meshes/collision/")
        )
    return "/examples/" not in rel and size < 300_000


def _keep_sapien(rel: str, size: int) -> bool:
    return not (
        rel.startswith(("sapien/include/", "sapien/sensor/assets/patterns/"))
        or rel.endswith((".dylib", ".dll"))
    )


def _copy_tree(site: Path, top: str, dst: Path, keep: object = None) -> None:
    for path in sorted((site / top).rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        rel = path.relative_to(site).as_posix()
        if keep is not None and not keep(rel, path.stat().st_size):  # type: ignore[operator]
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def _dist_info(site: Path, module: str) -> list[Path]:
    """The ``*.dist-info`` folders whose RECORD lists ``module`` (importlib.metadata lookups need them)."""
    found = []
    for info in site.glob("*.dist-info"):
        record = info / "RECORD"
        if record.exists() and any(
            line.split(",")[0].split("/")[0] in (module, f"{module}.py")
            for line in record.read_text().splitlines()
        ):
            found.append(info)
    return found


def _instruction_embeddings() -> dict[str, list[float]]:
    from policies.flow_vla import embed_instructions
    from sim.registry import list_tasks

    texts = sorted({t.instruction for t in list_tasks()})
    vecs = embed_instructions(texts)
    return {t: [float(x) for x in v] for t, v in zip(texts, vecs.tolist(), strict=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(".carry"), help="folder to write (git-ignored)")
    p.add_argument("--work", type=Path, default=Path("runs/pc"), help="bench.rl --work with the seeds' demos")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--bases",
        action="store_true",
        help="carry each seed's trained SFT base instead of its demo store (the machine records the demos)",
    )
    args = p.parse_args()
    site = Path(next(s for s in sys.path if s.endswith("site-packages") and Path(s, "sapien").is_dir()))
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        _copy_tree(site, "mani_skill", stage, _keep_mani_skill)
        _copy_tree(site, "sapien", stage, _keep_sapien)
        _copy_tree(site, "sapien.libs", stage)
        for module in ("mani_skill", "sapien", *PACKAGES):
            if module == "sqlalchemy":  # its Cython speed-ups are optional (pure-Python fallback): 9 MB less
                _copy_tree(site, module, stage, lambda rel, size: not rel.endswith(".so"))
            elif module not in ("mani_skill", "sapien"):
                _copy_tree(site, module, stage)
            for info in _dist_info(site, module):
                _copy_tree(site, info.name, stage)
        (stage / "IPython").mkdir()
        (stage / "IPython" / "__init__.py").write_text(IPYTHON_STANDIN)
        (stage / "IPython" / "display.py").write_text("from IPython import HTML, display  # noqa: F401\n")
        (stage / "xlibs").mkdir()
        for lib in X_LIBS:
            shutil.copy2(Path("/lib/x86_64-linux-gnu") / lib, stage / "xlibs" / lib)
        (stage / "instruction_embeddings.json").write_text(json.dumps(_instruction_embeddings()))
        with tarfile.open(args.out / "site.tar.xz", "w:xz") as tar:
            for path in sorted(stage.iterdir()):
                tar.add(path, arcname=path.name)
    for seed in args.seeds:
        src, dst = args.work / f"seed{seed}", args.out / "work" / f"seed{seed}"
        shutil.rmtree(dst, ignore_errors=True)
        if args.bases:
            shutil.copytree(src / "sft" / "checkpoints" / "last", dst / "sft" / "checkpoints" / "last")
            shutil.copy2(src / "sft.json", dst / "sft.json")
        else:
            shutil.copytree(src / "store", dst / "store")
            shutil.copy2(src / "demos.json", dst / "demos.json")
    size = subprocess.run(["du", "-sh", str(args.out)], capture_output=True, text=True).stdout.split()[0]
    print(f"wrote {args.out} ({size})")


if __name__ == "__main__":
    main()
