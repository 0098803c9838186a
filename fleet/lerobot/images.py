"""Import: one LeRobot episode's camera frames (PNG images or video) as uint8 [T, H, W, 3]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from vla_rl_client.spec import SpecError

from fleet.lerobot.plan import EpisodePlan
from fleet.lerobot.source import Camera

if TYPE_CHECKING:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset


def read_images(
    ds: LeRobotDataset, plan: EpisodePlan, cameras: Sequence[Camera], fps: float
) -> dict[str, np.ndarray]:
    """uint8 [T, H, W, 3] per camera name, checked against the spec's H x W."""
    out: dict[str, np.ndarray] = {}
    stills = [c.key for c in cameras if not c.video]
    raw: dict[str, list[Any]] = {}
    if stills:  # format None: HF's PIL images as stored, not LeRobot's float CHW tensors
        raw = ds.hf_dataset.with_format(None).select_columns(stills)[plan.rows.tolist()]
    for cam in cameras:
        if cam.video:
            frames = _decode_video(ds, plan, cam)
        else:
            frames = np.stack([_to_rgb(img) for img in raw[cam.key]])
        want = (len(plan.rows), *cam.spec.shape)
        if frames.shape != want:
            raise SpecError(
                cam.key,
                f"{cam.spec.height}x{cam.spec.width}x3 images as declared in meta/info.json",
                f"frames of shape {list(frames.shape[1:])} in episode {plan.episode_index}",
            )
        out[cam.spec.name] = frames
    return out


def _to_rgb(img: Any) -> np.ndarray:
    """A decoded HF image (PIL, or array HWC/CHW) as uint8 H x W x 3."""
    if hasattr(img, "convert"):
        return np.asarray(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
    arr = np.asarray(img)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)
    return _rgb_channels(arr if arr.dtype == np.uint8 else _float_to_uint8(arr))


def _float_to_uint8(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind == "f":
        return np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8)
    return arr.astype(np.uint8)


def _rgb_channels(arr: np.ndarray) -> np.ndarray:
    if arr.shape[-1] == 1:
        return np.repeat(arr, 3, axis=-1)
    return arr[..., :3]


def _decode_video(ds: LeRobotDataset, plan: EpisodePlan, cam: Camera) -> np.ndarray:
    from lerobot.datasets.video_utils import decode_video_frames, get_safe_default_video_backend

    ep = ds.meta.episodes[plan.episode_index]
    offset = float(ep[f"videos/{cam.key}/from_timestamp"])
    path = ds.root / ds.meta.get_video_file_path(plan.episode_index, cam.key)
    frames = decode_video_frames(
        path,
        [offset + float(t) for t in plan.video_time],
        ds.tolerance_s,
        get_safe_default_video_backend(),
        return_uint8=True,
    )
    return _rgb_channels(_float_to_uint8(frames.numpy()).transpose(0, 2, 3, 1))
