"""The episode store: :class:`EpisodeStore` opens or creates one (a folder or an object-store prefix),
creates and resumes episodes, reads them and summarises the store."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from vla_rl_client.meta import STORE_VERSION, EpisodeDB, EpisodeMeta, SegmentKind, new_episode_id
from vla_rl_client.spec import RobotSpec

from fleet.codecs import CameraCodecs
from fleet.objstore import (
    ObjectStore,
    ReadCache,
    cache_dir_from_env,
    cache_max_bytes,
    is_remote,
    read_cached,
    write_cached,
)
from fleet.store.layout import (
    _ID_RE,
    _TEMPLATE_LOCK,
    COMMIT_FILE,
    DEFAULT_CHUNK_LEN,
    OPTIONAL_ARRAYS,
    STORE_FORMAT,
    Episode,
    _array,
    _check_id,
    _create_group_doc,
    _episode_template,
    _group_doc,
    _layout,
    _write_json_atomic,
    outcome_known,
)
from fleet.store.verify import _Verify
from fleet.store.writer import EpisodeWriter

log = logging.getLogger("fleet.store")  # one logger for the whole store, as before the split


class EpisodeStore(_Verify):
    """A directory of episodes (see the module docstring for layout and commit protocol), or the same
    layout under an object-store prefix (``s3://bucket/prefix``, see :mod:`fleet.objstore`).

    ``EpisodeStore(root)`` opens an existing store; ``create=True`` creates it if missing.
    ``fsync=True`` makes every commit durable against power loss (data files, then the commit file,
    are fsynced); without it commits are still atomic against a killed process. ``db``, if given, is
    the default metadata DB that writers record episodes in.

    On an object store, ``root`` is the URL (a str), ``remote`` its :class:`~fleet.objstore.ObjectStore`
    (None for a directory), and closed episodes are read through a local cache, ``cache_dir`` (default
    ``$VLA_RL_STORE_CACHE``, else ``~/.cache/vla-rl/store``; ``"off"`` for none): closed episodes never
    change, so a second read of one downloads nothing. The cache stays under ``cache_max_gb`` (default
    ``$VLA_RL_STORE_CACHE_MAX_GB``, else 20), evicting whole episodes least recently used first
    (:class:`~fleet.objstore.ReadCache`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        create: bool = False,
        *,
        fsync: bool = False,
        db: EpisodeDB | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_gb: float | None = None,
    ) -> None:
        self.fsync = fsync
        self._db = db
        self.remote: ObjectStore | None = None
        self.cache_dir: Path | None = None
        self.read_cache: ReadCache | None = None
        if is_remote(root):
            self._open_remote(root, create, cache_dir)
            if self.cache_dir is not None:
                self.read_cache = ReadCache(self.cache_dir, cache_max_bytes(cache_max_gb))
            return
        self.root: Any = Path(root).absolute()
        self.episodes_dir = self.root / "episodes"
        marker = self.root / "zarr.json"
        if not marker.exists():
            if not create:
                what = "does not exist" if not self.root.exists() else "is not an episode store"
                raise FileNotFoundError(
                    f"no episode store at {self.root}: the directory {what} (pass create=True to make one)"
                )
            self.root.mkdir(parents=True, exist_ok=True)
            doc = _group_doc({"format": STORE_FORMAT, "version": STORE_VERSION})
            _create_group_doc(self.root, doc)
        attrs = json.loads(marker.read_text()).get("attributes", {})
        if attrs.get("format") != STORE_FORMAT:
            raise ValueError(f"{self.root} is a zarr group but not an episode store (attributes: {attrs})")
        if attrs.get("version") != STORE_VERSION:
            raise ValueError(
                f"{self.root}: store version {attrs.get('version')} is not supported (want {STORE_VERSION})"
            )
        self.episodes_dir.mkdir(exist_ok=True)
        if not (self.episodes_dir / "zarr.json").exists():  # stores made before it was written
            try:
                _create_group_doc(self.episodes_dir, _group_doc({}))
            except OSError as e:  # e.g. a read-only store: readers through EpisodeStore do not need it
                log.warning(
                    "cannot write %s (%s): generic zarr tools will not see the episodes",
                    self.episodes_dir / "zarr.json",
                    e,
                )

    def _open_remote(
        self, root: str | os.PathLike[str], create: bool, cache_dir: str | os.PathLike[str] | None
    ) -> None:
        remote = self.remote = ObjectStore(root, writable=create)
        self.root = remote.url
        self.episodes_dir = Path(remote.url.removeprefix("s3://")) / "episodes"  # names only; never opened
        self.cache_dir = cache_dir_from_env(cache_dir)
        self._closed_metas: dict[str, EpisodeMeta] = {}
        try:
            doc = json.loads(remote.get("zarr.json"))
        except FileNotFoundError:
            if not create:
                raise FileNotFoundError(
                    f"no episode store at {remote.url}: nothing there (pass create=True to make one)"
                ) from None
            doc = _group_doc({"format": STORE_FORMAT, "version": STORE_VERSION})
            remote.put_many({"zarr.json": json.dumps(doc, indent=2).encode()})
        attrs = doc.get("attributes", {})
        if attrs.get("format") != STORE_FORMAT:
            raise ValueError(f"{remote.url} is a zarr group but not an episode store (attributes: {attrs})")
        if attrs.get("version") != STORE_VERSION:
            raise ValueError(
                f"{remote.url}: store version {attrs.get('version')} is not supported (want {STORE_VERSION})"
            )
        if create and not remote.exists("episodes/zarr.json"):
            remote.put("episodes/zarr.json", json.dumps(_group_doc({}), indent=2).encode())

    def __repr__(self) -> str:
        return f"EpisodeStore({str(self.root)!r})"

    def _group(self, episode_id: str, mode: str, cached: bool = False) -> zarr.Group:
        """An episode's zarr group; ``cached``: through the local read cache (closed episodes only)."""
        if self.remote is None:
            return zarr.open_group(self.episodes_dir / episode_id, mode=mode)  # type: ignore[arg-type]
        store = self.remote.zarr_store(
            f"episodes/{episode_id}",
            read_only=mode == "r",
            cache=self.read_cache if cached else None,
        )
        # zarr_format=3: without it zarr also looks for v2 documents (three more GETs per episode).
        return zarr.open_group(store, mode=mode, zarr_format=3)  # type: ignore[arg-type]

    def _put_commit(self, meta: EpisodeMeta, ep_dir: Path) -> None:
        """Replace an episode's commit record (after its data: see the module docstring)."""
        if self.remote is None:
            _write_json_atomic(ep_dir / COMMIT_FILE, meta.to_dict(), self.fsync)
        else:
            body = json.dumps(meta.to_dict(), sort_keys=True).encode()
            self.remote.put(f"episodes/{meta.episode_id}/{COMMIT_FILE}", body)

    @property
    def db(self) -> EpisodeDB | None:
        """The metadata DB that writers record episodes in unless told otherwise (set at construction)."""
        return self._db

    # ------------------------------------------------------------------ writing
    def create_episode(
        self,
        spec: RobotSpec,
        *,
        robot_id: str,
        task: str,
        instruction: str | None = None,
        chunk_len: int = DEFAULT_CHUNK_LEN,
        episode_id: str | None = None,
        db: EpisodeDB | None = None,
        camera_zstd_level: int | None = None,
        camera_codec: str | CameraCodecs | None = None,
    ) -> EpisodeWriter:
        """Create an empty episode (see :meth:`new_episode`) and return its writer."""
        meta = self.new_episode(
            spec,
            robot_id=robot_id,
            task=task,
            instruction=instruction,
            chunk_len=chunk_len,
            episode_id=episode_id,
            db=db,
            camera_zstd_level=camera_zstd_level,
            camera_codec=camera_codec,
        )
        group = self._group(meta.episode_id, "r+")
        return EpisodeWriter(self, meta, group, db if db is not None else self.db)

    def new_episode(
        self,
        spec: RobotSpec,
        *,
        robot_id: str,
        task: str,
        instruction: str | None = None,
        chunk_len: int = DEFAULT_CHUNK_LEN,
        episode_id: str | None = None,
        db: EpisodeDB | None = None,
        camera_zstd_level: int | None = None,
        camera_codec: str | CameraCodecs | None = None,
    ) -> EpisodeMeta:
        """Create an empty, open episode (its arrays, commit record and DB row) without opening a writer:
        what a caller that hands the episode to another process (the fleet collector) needs.

        ``instruction`` defaults to the spec's; ``episode_id`` defaults to ``<UTC time>-<robot>-<random>``
        (sortable by creation time). ``db`` overrides the store's DB for this episode.
        ``camera_zstd_level`` sets the zstd level of the camera arrays (None: zarr's default, level 3).
        Rendered frames at level 1 or lower compress several times faster for a slightly larger file,
        which is what a collector taking many cameras at once needs (each level measured:
        docs/benchmarks.md, Fleet collector). ``camera_codec`` picks each
        camera's codec (``"jpeg:85"``, ``"lossless,wrist=jpeg:80"``: see :mod:`fleet.codecs`; None:
        lossless); it is recorded in the camera arrays' metadata, so readers need nothing.
        """
        codecs = CameraCodecs.parse(camera_codec).check(spec.camera_names)
        if not isinstance(robot_id, str) or not robot_id:
            raise ValueError(f"robot_id must be a non-empty string, got {robot_id!r}")
        if not isinstance(task, str) or not task:
            raise ValueError(f"task must be a non-empty string, got {task!r}")
        if not isinstance(chunk_len, int) or chunk_len < 1:
            raise ValueError(f"chunk_len must be a positive int, got {chunk_len!r}")
        if episode_id is None:
            episode_id = new_episode_id(robot_id)
        _check_id("episode_id", episode_id)
        ep_dir = self.episodes_dir / episode_id
        if self.remote is not None:
            # No exclusive mkdir on S3: an episode exists once it has a commit record. (One collector
            # writes a store; left-overs of an interrupted creation have none and are overwritten.)
            if self.remote.exists(f"episodes/{episode_id}/{COMMIT_FILE}"):
                raise ValueError(f"episode {episode_id!r} already exists in {self.root}")
        else:
            try:
                ep_dir.mkdir()  # exclusive: two writers can never share an episode
            except FileExistsError:
                raise ValueError(f"episode {episode_id!r} already exists in {self.root}") from None
        meta = EpisodeMeta(
            episode_id=episode_id,
            robot_id=robot_id,
            task=task,
            instruction=spec.instruction if instruction is None else instruction,
            spec=spec,
            chunk_len=chunk_len,
            created=time.time(),
        )
        # The arrays' metadata documents are the same for every episode of one spec and layout: write
        # the ones zarr produced once (cached) instead of creating ~12 arrays through zarr each time
        # (slow enough to stall a collector whose fleet starts episodes together: docs/store.md,
        # Write-path costs behind the design).
        with _TEMPLATE_LOCK:  # a fleet starting together must not build the same template 16 times
            root_doc, files = _episode_template(spec.to_json(), chunk_len, camera_zstd_level, codecs)
        attributes = {"vla_rl": meta.to_dict() | {"see": COMMIT_FILE}}
        group_doc = json.dumps({**root_doc, "attributes": attributes}, indent=2)
        if self.remote is not None:
            objects = {f"episodes/{episode_id}/{rel}": data for rel, data in files.items()}
            objects[f"episodes/{episode_id}/zarr.json"] = group_doc.encode()
            self.remote.put_many(objects)  # concurrently; the commit record only once all are in
        else:
            for rel, data in files.items():
                (ep_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                (ep_dir / rel).write_bytes(data)
            (ep_dir / "zarr.json").write_text(group_doc)
        self._put_commit(meta, ep_dir)
        db = db if db is not None else self.db
        if db is not None:
            db.record_episode_open(meta, str(self.root))
        return meta

    def resume_episode(self, episode_id: str, db: EpisodeDB | None = None) -> EpisodeWriter:
        """A writer that continues an open episode after its previous writer went away (e.g. was killed).

        It starts from the committed length: rows a killed writer wrote but never committed are
        overwritten, its last segment stays open, and later timestamps must not go back before the last
        committed one. The caller must make sure the old writer is really gone (two writers of one
        episode corrupt it); the fleet collector holds a lock on the store for that.
        """
        meta = self.read_metadata(episode_id)
        if meta.is_closed:
            raise ValueError(f"episode {episode_id!r} is closed ({meta.outcome}); it cannot be resumed")
        group = self._group(episode_id, "r+")
        writer = EpisodeWriter(self, meta, group, db if db is not None else self.db)
        writer._restore()
        return writer

    # ------------------------------------------------------------------ reading
    def episode_ids(self) -> list[str]:
        """Ids of all episodes with a commit record (open and closed), sorted."""
        if self.remote is not None:
            return sorted(self._remote_metas())
        return sorted(p.parent.name for p in self.episodes_dir.glob(f"*/{COMMIT_FILE}"))

    def read_metadata(self, episode_id: str) -> EpisodeMeta:
        """The episode's committed metadata (cheap: reads only ``commit.json``)."""
        _check_id("episode_id", episode_id)
        if self.remote is not None:
            meta = self._remote_metas([episode_id]).get(episode_id)
            if meta is None:
                raise KeyError(f"no episode {episode_id!r} in {self.root}")
            return meta
        path = self.episodes_dir / episode_id / COMMIT_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise KeyError(f"no episode {episode_id!r} in {self.root}") from None
        return EpisodeMeta.from_dict(json.loads(text))

    def _remote_metas(self, episode_ids: Sequence[str] | None = None) -> dict[str, EpisodeMeta]:
        """Commit records on the object store (all episodes: one listing), fetched concurrently.

        A closed episode's record never changes: it is kept in memory and in the read cache, so
        listing a store of closed episodes again costs one LIST and no GETs.
        """
        assert self.remote is not None
        ids = self.remote.list_dir("episodes") if episode_ids is None else list(episode_ids)
        out: dict[str, EpisodeMeta] = {}
        fetch: list[str] = []
        cache = self.remote.cache_root(self.cache_dir) / "episodes" if self.cache_dir else None
        for eid in ids:
            if eid in self._closed_metas:
                out[eid] = self._closed_metas[eid]
            elif eid == "zarr.json" or _ID_RE.fullmatch(eid) is None:
                continue  # zarr.json and other objects beside the episode folders
            elif cache is not None and (body := read_cached(cache / eid / COMMIT_FILE)) is not None:
                meta = EpisodeMeta.from_dict(json.loads(body))
                out[eid] = self._closed_metas[eid] = meta
            else:
                fetch.append(eid)
        got = self.remote.get_many(f"episodes/{eid}/{COMMIT_FILE}" for eid in fetch)
        for eid in fetch:
            body = got.get(f"episodes/{eid}/{COMMIT_FILE}")
            if body is None:
                continue  # no commit record: creation was interrupted (or not an episode)
            meta = EpisodeMeta.from_dict(json.loads(body))
            out[eid] = meta
            if meta.is_closed:
                self._closed_metas[eid] = meta
                if cache is not None:
                    with contextlib.suppress(FileNotFoundError):  # evicted while written: not kept
                        write_cached(cache / eid / COMMIT_FILE, body)
        return out

    def read_array(self, episode_id: str, key: str, cached: bool = False) -> zarr.Array:
        """One array of an episode opened read-only (``cameras/<name>``, ``action``, ...), on a local or an
        object store, for readers that fetch chunk by chunk (the dashboard). Rows past the commit record's
        ``length`` may be in flight: read :meth:`read_metadata` first and only up to its length.
        ``cached``: through the local read cache (closed episodes only)."""
        return _array(self._group(episode_id, "r", cached=cached), key)

    def read_arrays(self, episode_id: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """Some of an episode's committed arrays (``uncertainty``, ``segment``, ...), opening it once; an
        optional array the episode lacks is left out of the result (auto-flags' calibration reads)."""
        meta = self.read_metadata(episode_id)
        group = self._group(episode_id, "r", cached=meta.is_closed)
        out: dict[str, np.ndarray] = {}
        for key in keys:
            arr = group.get(key)
            if isinstance(arr, zarr.Array):
                out[key] = arr[: meta.length]
            elif key not in OPTIONAL_ARRAYS:
                raise KeyError(f"array {key!r} is missing from episode {episode_id!r}")
        return out

    def read_episode(self, episode_id: str, cameras: bool = True) -> Episode:
        """Committed frames of one episode (``cameras=False`` skips the images, leaving ``cameras`` empty).

        The commit record is read before the arrays, so every row it counts is already written even
        while a writer is appending.
        """
        meta = self.read_metadata(episode_id)
        group = self._group(episode_id, "r", cached=meta.is_closed)
        n = meta.length
        data: dict[str, np.ndarray] = {}
        for key in _layout(meta.spec):
            if key.startswith("cameras/") and not cameras:
                continue
            if key in OPTIONAL_ARRAYS:
                arr = group.get(key)
                if isinstance(arr, zarr.Array):
                    data[key] = arr[:n]
                continue
            data[key] = _array(group, key)[:n]
        return Episode(
            meta=meta,
            cameras={c: data[f"cameras/{c}"] for c in meta.spec.camera_names if cameras},
            state=data["state"],
            action=data["action"],
            proposed_action=data["proposed_action"],
            reward=data["reward"],
            terminated=data["terminated"],
            truncated=data["truncated"],
            controller=data["controller"],
            segment=data["segment"],
            revision=data["revision"],
            timestamp=data["timestamp"],
            uncertainty=data.get("uncertainty"),
            failure=data["failure"] if "failure" in data else np.full(n, np.nan, np.float32),
        )

    def iter_episodes(
        self, task: str | None = None, closed_only: bool = True, cameras: bool = True
    ) -> Iterator[Episode]:
        """Episodes in id order, optionally only one task's, by default only closed ones."""
        metas = self._remote_metas() if self.remote is not None else None
        for eid in self.episode_ids() if metas is None else sorted(metas):
            meta = self.read_metadata(eid) if metas is None else metas[eid]
            if (task is None or meta.task == task) and (meta.is_closed or not closed_only):
                yield self.read_episode(eid, cameras=cameras)

    def info(self) -> dict[str, Any]:
        """Summary: episode/frame counts, bytes on disk, and per-task counts and success rates.

        Per task and per robot, ``closed`` splits into ``known`` outcomes and ``unknown`` ones (outcome
        ``"unknown"``, see :func:`outcome_known`); ``successes`` and ``success_rate`` (successes / known,
        None without any known outcome) count only the known ones."""
        tasks: dict[str, dict[str, Any]] = {}
        n_open = frames = 0
        if self.remote is not None:
            metas = [m for _, m in sorted(self._remote_metas().items())]
        else:
            metas = [self.read_metadata(eid) for eid in self.episode_ids()]
        for m in metas:
            t = tasks.setdefault(
                m.task, {"episodes": 0, "closed": 0, "known": 0, "unknown": 0, "successes": 0, "frames": 0}
            )
            t["episodes"] += 1
            t["frames"] += m.length
            frames += m.length
            if m.is_closed:
                t["closed"] += 1
                _count_outcome(t, m)
            else:
                n_open += 1
        for t in tasks.values():
            t["success_rate"] = t["successes"] / t["known"] if t["known"] else None
        if self.remote is not None:
            size = self.remote.size()
        else:
            size = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
        return {
            "root": str(self.root),
            "episodes": len(metas),
            "open_episodes": n_open,
            "frames": frames,
            "bytes": size,
            "tasks": dict(sorted(tasks.items())),
            "robots": _robot_summary(metas),
        }

    # ------------------------------------------------------------------ checking


def _count_outcome(counts: dict[str, Any], m: EpisodeMeta) -> None:
    if outcome_known(m):
        counts["known"] += 1
        counts["successes"] += int(bool(m.success))
    else:
        counts["unknown"] += 1


def _robot_summary(metas: Sequence[EpisodeMeta]) -> dict[str, dict[str, Any]]:
    """Per robot: episodes, success, and how its frames split into segment kinds (who was in control).

    ``intervention_rate`` is the fraction of frames in intervention segments (the frames a LeRobot
    export marks ``intervention``); ``takeovers`` counts
    intervention segments; ``episodes_with_intervention`` the episodes that had at least one.
    """
    robots: dict[str, dict[str, Any]] = {}
    for m in metas:
        r = robots.setdefault(
            m.robot_id,
            {
                "episodes": 0,
                "closed": 0,
                "known": 0,
                "unknown": 0,
                "successes": 0,
                "frames": 0,
                "segments": {k.value: 0 for k in SegmentKind},
                "frames_by_kind": {k.value: 0 for k in SegmentKind},
                "episodes_with_intervention": 0,
            },
        )
        r["episodes"] += 1
        r["frames"] += m.length
        if m.is_closed:
            r["closed"] += 1
            _count_outcome(r, m)
        for seg in m.segments:
            r["segments"][seg.kind.value] += 1
            r["frames_by_kind"][seg.kind.value] += (m.length if seg.end is None else seg.end) - seg.start
        r["episodes_with_intervention"] += int(any(g.kind == SegmentKind.INTERVENTION for g in m.segments))
    for r in robots.values():
        r["success_rate"] = r["successes"] / r["known"] if r["known"] else None
        r["intervention_rate"] = r["frames_by_kind"]["intervention"] / r["frames"] if r["frames"] else None
        r["takeovers"] = r["segments"]["intervention"]
    return dict(sorted(robots.items()))
