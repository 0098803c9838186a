"""The LeRobot dataset an import reads: finding it on disk, checking its files, its features as our
robot spec and cameras, which optional columns it has, and our export's sidecar if present.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vla_rl_client.spec import CameraSpec, RobotSpec, SpecError

from fleet.lerobot.schema import (
    CONTROLLER_KEY,
    DONE_KEY,
    HIL_INTERVENTION_KEY,
    IMAGES_PREFIX,
    INTERVENTION_KEY,
    OUTCOME_KNOWN_KEY,
    REWARD_KEY,
    SEGMENT_KEY,
    SIDECAR_FORMAT,
    SIDECAR_PATH,
    SIDECAR_VERSION,
    SINGLE_IMAGE_KEY,
    SUCCESS_KEY,
    TRUNCATED_KEY,
)

if TYPE_CHECKING:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

log = logging.getLogger("fleet.lerobot_io")  # one logger for the whole package, as before the split


_FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
_INT_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})


@dataclasses.dataclass(frozen=True)
class Camera:
    """One RGB camera feature of the dataset: its key, the camera it becomes, and whether it is video."""

    key: str  # LeRobot feature key
    spec: CameraSpec
    video: bool


def resolve_dataset(root_or_repo_id: str | os.PathLike[str]) -> tuple[Path, str]:
    """(dataset root, repo id) for a directory or a repo id in the local LeRobot cache."""
    path = Path(root_or_repo_id).expanduser()
    if (path / "meta" / "info.json").is_file():
        root = path.absolute()
        return root, f"local/{root.name}"
    tried = [str(path.absolute())]
    text = str(root_or_repo_id)
    if re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", text) and not path.exists():
        from lerobot.utils.constants import HF_LEROBOT_HOME

        cached = Path(HF_LEROBOT_HOME) / text
        if (cached / "meta" / "info.json").is_file():
            return cached.absolute(), text
        tried.append(str(cached))
    what = "does not exist" if not path.exists() else "has no meta/info.json"
    raise FileNotFoundError(
        f"no LeRobot dataset at {root_or_repo_id!s}: {tried[0]} {what}"
        + (f" and nothing is cached at {tried[1]}" if len(tried) > 1 else "")
        + " (import_lerobot reads local datasets only; download with LeRobotDataset(repo_id) first)"
    )


def load_info(root: Path) -> dict[str, Any]:
    """``meta/info.json`` of a v3.x dataset with a feature dict; anything else is an error naming it."""
    path = root / "meta" / "info.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from None
    version = str(info.get("codebase_version", ""))
    if not version.startswith("v3"):
        raise ValueError(
            f"{root} is a LeRobot {version or 'unknown-version'} dataset; import_lerobot reads v3.x "
            "(convert it with LeRobot's convert_dataset_v21_to_v30)"
        )
    if not isinstance(info.get("features"), dict):
        raise SpecError("features", "a feature dict in meta/info.json", type(info.get("features")).__name__)
    return info


def vector_feature(features: Mapping[str, Any], key: str, what: str) -> tuple[int, tuple[str, ...]]:
    """Dim and names of a 1-D float feature, or a SpecError naming the key."""
    ft = features.get(key)
    if not isinstance(ft, Mapping):
        raise SpecError(key, f"a {what} feature", f"no such feature (features: {sorted(features)})")
    dtype, shape = ft.get("dtype"), tuple(ft.get("shape") or ())
    if dtype not in _FLOAT_DTYPES:
        raise SpecError(key, f"a float dtype ({'/'.join(sorted(_FLOAT_DTYPES))}) for the {what}", f"{dtype}")
    if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 1:
        raise SpecError(key, f"a 1-D shape [N>=1] for the {what}", f"shape {list(shape)}")
    names = ft.get("names")
    if isinstance(names, Mapping) and len(names) == 1:  # older layout: {"motors": [...]}
        names = next(iter(names.values()))
    if isinstance(names, list | tuple) and len(names) == shape[0] and all(isinstance(n, str) for n in names):
        return shape[0], tuple(names)
    return shape[0], ()


def select_cameras(features: Mapping[str, Any], camera_keys: Sequence[str] | None) -> list[Camera]:
    """The RGB image and video features (depth maps skipped) as cameras, all or those ``camera_keys`` names
    (feature keys or camera names); camera names are the key's last part, made safe."""
    available: dict[str, str] = {}  # feature key -> camera name
    for key, ft in features.items():
        if not isinstance(ft, Mapping) or ft.get("dtype") not in ("image", "video"):
            continue
        info = ft.get("info") or {}
        if info.get("is_depth_map") or info.get("video.is_depth_map"):
            continue  # depth maps are not RGB cameras; our store has no depth modality
        if key.startswith(IMAGES_PREFIX):
            name = key[len(IMAGES_PREFIX) :]
        elif key == SINGLE_IMAGE_KEY:
            name = "image"
        else:
            name = key.removeprefix("observation.")
        available[key] = re.sub(r"[^A-Za-z0-9_]", "_", name) or "camera"
    if camera_keys is None:
        keys = list(available)
    else:
        if isinstance(camera_keys, str):
            raise TypeError("camera_keys must be a sequence of keys, not a single string")
        by_name = {name: key for key, name in available.items()}
        keys = []
        for k in camera_keys:
            key = k if k in available else by_name.get(k)
            if key is None:
                raise SpecError(
                    f"camera_keys.{k}",
                    f"one of the RGB camera features {sorted(available)}",
                    "no such camera",
                )
            keys.append(key)
    names = [available[k] for k in keys]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SpecError("cameras", "camera features with distinct names", f"{dup} more than once in {keys}")
    return [
        Camera(k, _camera_spec(k, available[k], features[k]), features[k]["dtype"] == "video") for k in keys
    ]


def _camera_spec(key: str, name: str, ft: Mapping[str, Any]) -> CameraSpec:
    shape = tuple(ft.get("shape") or ())
    names = ft.get("names")
    if len(shape) != 3:
        raise SpecError(key, "an image shape [H, W, C] or [C, H, W]", f"shape {list(shape)}")
    if isinstance(names, list | tuple) and len(names) == 3:
        low = [str(n).lower() for n in names]
        if "height" in low and "width" in low:
            return CameraSpec(name, int(shape[low.index("height")]), int(shape[low.index("width")]))
    if shape[-1] in (1, 3, 4):
        return CameraSpec(name, int(shape[0]), int(shape[1]))
    return CameraSpec(name, int(shape[1]), int(shape[2]))


@dataclasses.dataclass(frozen=True)
class OptionalColumns:
    """Which optional columns the dataset has (:func:`optional_columns`)."""

    reward: bool
    done: bool
    truncated: bool
    success: bool
    outcome_known: bool
    controller: str | None  # the column controllers come from, if any
    intervention: str | None  # the column intervention flags come from, if any
    segment: bool


def optional_columns(features: Mapping[str, Any]) -> OptionalColumns:
    """Which optional columns are present; a present one with an unusable dtype is an error."""

    def has(key: str, dtypes: frozenset[str], what: str) -> bool:
        ft = features.get(key)
        if ft is None:
            return False
        dtype, shape = ft.get("dtype"), tuple(ft.get("shape") or ())
        if dtype not in dtypes or shape not in ((), (1,)):
            raise SpecError(key, f"{what} of shape [1]", f"{dtype} of shape {list(shape)}")
        return True

    numeric = _FLOAT_DTYPES | _INT_DTYPES
    bools = frozenset({"bool"})
    intervention = None
    if has(INTERVENTION_KEY, bools | numeric, "a bool intervention flag"):
        intervention = INTERVENTION_KEY
    elif has(HIL_INTERVENTION_KEY, bools | numeric, "a bool intervention flag"):
        intervention = HIL_INTERVENTION_KEY
    controller = intervention
    if has(CONTROLLER_KEY, _INT_DTYPES, "integer controller codes (policy=0, human=1, scripted=2)"):
        controller = CONTROLLER_KEY
    return OptionalColumns(
        reward=has(REWARD_KEY, numeric, "a numeric reward"),
        done=has(DONE_KEY, bools, "a bool done flag"),
        truncated=has(TRUNCATED_KEY, bools, "a bool truncated flag"),
        success=has(SUCCESS_KEY, bools, "a bool success flag"),
        outcome_known=has(OUTCOME_KNOWN_KEY, bools, "a bool outcome-known flag"),
        controller=controller,
        intervention=intervention,
        segment=has(SEGMENT_KEY, _INT_DTYPES, "integer segment indices"),
    )


def check_local_files(root: Path, info: Mapping[str, Any]) -> None:
    """Make sure LeRobot finds everything locally: where a file is missing it would go to the Hub."""
    missing = []
    if int(info.get("total_tasks", 0)) > 0 and not (root / "meta" / "tasks.parquet").is_file():
        missing.append("meta/tasks.parquet")
    if not any((root / "meta" / "episodes").glob("*/*.parquet")):
        missing.append("meta/episodes/*/*.parquet")
    if not any((root / "data").glob("*/*.parquet")):
        missing.append("data/*/*.parquet")
    if missing:
        raise FileNotFoundError(
            f"LeRobot dataset {root} is incomplete, missing {missing} (was finalize() called when it was written?)"
        )


def check_video_files(root: Path, meta: Any, cameras: Sequence[Camera]) -> None:
    """Every video camera's file of every episode is on disk (LeRobot would download a missing one)."""
    for cam in cameras:
        if not cam.video:
            continue
        for ep in range(meta.total_episodes):
            path = root / meta.get_video_file_path(ep, cam.key)
            if not path.is_file():
                raise FileNotFoundError(f"LeRobot dataset {root}: video {path} of episode {ep} is missing")


def load_sidecar(root: Path, total_frames: int) -> dict[str, Any] | None:
    """Our export's sidecar, if present and still describing this dataset (same frame count)."""
    path = root / SIDECAR_PATH
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return None
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        return None
    if data.get("version") != SIDECAR_VERSION or data.get("total_frames") != total_frames:
        log.warning("ignoring %s: it does not describe this dataset (version or frame count differs)", path)
        return None
    try:
        data["by_index"] = {int(e["episode_index"]): e for e in data.get("episodes", [])}
    except (KeyError, TypeError, ValueError) as e:
        log.warning("ignoring %s: malformed episode entries (%s)", path, e)
        return None
    return data


def dataset_tasks(ds: LeRobotDataset) -> list[str]:
    """Task strings ordered by task_index."""
    tasks = ds.meta.tasks
    if tasks is None:
        return []
    by_index = {int(i): str(t) for t, i in tasks["task_index"].items()}
    return [by_index[i] for i in sorted(by_index)]


def restore_spec(built: RobotSpec, sidecar: Mapping[str, Any] | None, spec_name: str | None) -> RobotSpec:
    """The exported spec when it agrees with the features (it has names, instruction, extras)."""
    if sidecar is None:
        return built
    try:
        exported = RobotSpec.from_dict(sidecar["spec"])
    except (KeyError, TypeError, ValueError) as e:
        log.warning("ignoring the sidecar spec: %s", e)
        return built
    same = (
        exported.state_dim == built.state_dim
        and exported.action_dim == built.action_dim
        and exported.cameras == built.cameras
        and exported.control_hz == built.control_hz
    )
    if not same:
        return built
    return dataclasses.replace(exported, name=spec_name) if spec_name else exported
