"""On-disk storage of the local Hub server: content-addressed blobs, commit manifests and refs per repo.

Layout under the data folder::

    objects/ab/cd/<sha256>            file contents, content-addressed and shared by all repos (immutable)
    repos/<org>/<name>/repo.json      creation time, private flag
    repos/<org>/<name>/refs.json      {"branches": {name: sha}, "tags": {name: sha}}
    repos/<org>/<name>/commits/<sha>.json   one commit: parent, message, author, date, full file manifest
    tmp/                              partial uploads (same filesystem, so os.replace is atomic)

A commit stores the whole manifest ``{path: {sha256, size, lfs, blob_id}}`` rather than a diff, so reading any
revision is one file read; checkpoint repos hold a handful of files, so this costs nothing. The commit id is the
sha1 of the commit's canonical JSON, which makes it a 40-hex string like a git commit id (the client checks
that shape). ``blob_id`` is the git blob sha1 (of the content for regular files, of the LFS pointer for LFS
files) because the client compares it to decide that an unchanged file needs no upload, and uses the ETag
(derived from it) as the blob's name in its cache.

Every file is written to a temporary name, fsynced and moved into place with os.replace, so a crash leaves
either the old or the new version. Ref updates (commits, tags, branches) run under a per-repo lock, a thread
lock plus ``flock`` on the repo's lock file, so concurrent commits from threads or from several server
processes on one data folder are serialised and a commit on a stale parent is refused rather than lost.
A write that fails half-way (a full disk: ENOSPC) is undone under that lock: a failed create removes the repo's
folder, a commit whose ref could not be written removes its commit file, so neither an empty repo nor an
unreachable commit is left behind. Blobs are content-addressed and may outlive a failed commit harmlessly.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from vla_rl.hub.naming import (
    COMMIT_SHA,
    SHA256_HEX,
    path_collision,
    validate_ref_name,
    validate_repo_id,
    validate_repo_path,
)

FORMAT_VERSION = 1
DEFAULT_BRANCH = "main"
# Files above this size always go through LFS, like on the Hub (which refuses larger regular files).
LFS_THRESHOLD = 10 * 1024 * 1024
# Patterns written to the initial .gitattributes and used to answer "lfs" in preupload, so binary checkpoint
# formats take the LFS path whatever their size.
LFS_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.onnx",
    "*.msgpack",
    "*.npy",
    "*.npz",
    "*.pkl",
    "*.zip",
    "*.tar",
    "*.gz",
    "*.zst",
    "*.parquet",
    "*.arrow",
    "*.png",
    "*.jpg",
    "*.jpeg",
    "*.mp4",
)
INITIAL_GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()
_CACHE_SIZE = 256


class HubError(Exception):
    """An error with the HTTP status and ``X-Error-Code`` the Hub would answer, so the server maps it 1:1."""

    status = 400
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class BadRequest(HubError):
    status = 400


class Forbidden(HubError):
    status = 403


class RepoNotFound(HubError):
    status = 404
    code = "RepoNotFound"

    @classmethod
    def of(cls, repo_id: str) -> RepoNotFound:
        """The one answer for a repo that does not exist, or that the caller may not see (a private repo read
        without its token gets exactly this, so the answer does not tell the two apart)."""
        return cls(f"Repository not found: {repo_id}")


class RevisionNotFound(HubError):
    status = 404
    code = "RevisionNotFound"


class EntryNotFound(HubError):
    status = 404
    code = "EntryNotFound"


class Conflict(HubError):
    status = 409


class PreconditionFailed(HubError):
    status = 412


class Unprocessable(HubError):
    status = 422


def now_iso() -> str:
    """UTC timestamp in the exact format the client's ``parse_datetime`` expects."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob with this content (what the Hub reports as a regular file's oid)."""
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file git would store for an LFS file; its sha1 and length are the Hub's oid and
    pointerSize for LFS entries."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def wants_lfs(path: str, size: int, sample: bytes, threshold: int = LFS_THRESHOLD) -> bool:
    """Upload mode for preupload: LFS for files over ``threshold`` (the most a commit may carry inline),
    binary-looking files and checkpoint/binary formats."""
    if size == 0:
        return False
    if size > threshold or b"\x00" in sample:
        return True
    base = path.rsplit("/", 1)[-1].lower()
    return any(fnmatch.fnmatchcase(base, pat) for pat in LFS_PATTERNS)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, data: bytes, tmp_dir: Path | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one."""
    tmp_dir = tmp_dir or path.parent
    tmp = tmp_dir / f".{path.name}.{secrets.token_hex(8)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class FileEntry:
    """One file of a commit's manifest. ``sha256`` names its blob; ``blob_id`` is its git-style oid."""

    sha256: str
    size: int
    lfs: bool
    blob_id: str

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size, "lfs": self.lfs, "blob_id": self.blob_id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileEntry:
        return cls(sha256=d["sha256"], size=int(d["size"]), lfs=bool(d["lfs"]), blob_id=d["blob_id"])

    @property
    def pointer_size(self) -> int:
        return len(lfs_pointer(self.sha256, self.size))

    @property
    def etag(self) -> str:
        """What the client keys its cache on: the sha256 for LFS files, the git blob sha1 otherwise (as the Hub)."""
        return self.sha256 if self.lfs else self.blob_id


@dataclass(frozen=True)
class Commit:
    id: str
    parent: str | None
    summary: str
    description: str
    author: str
    date: str
    files: dict[str, FileEntry] = field(repr=False)


@dataclass(frozen=True)
class Refs:
    branches: dict[str, str]
    tags: dict[str, str]


# Operations of a commit, applied in order to the parent's manifest.
@dataclass(frozen=True)
class AddFile:
    path: str
    entry: FileEntry


@dataclass(frozen=True)
class DeleteFile:
    path: str


@dataclass(frozen=True)
class DeleteFolder:
    path: str


Operation = AddFile | DeleteFile | DeleteFolder


class BlobWriter:
    """Streams an upload into a temporary file while hashing it; ``finish`` moves it into the blob store only
    if the content has the announced sha256 and size, so a truncated or corrupted upload never becomes a blob."""

    def __init__(
        self, store: HubStorage, expected_sha256: str | None = None, expected_size: int | None = None
    ):
        self._store = store
        self.expected_sha256 = expected_sha256
        self.expected_size = expected_size
        self._tmp = store.tmp_dir / f"upload-{secrets.token_hex(12)}.part"
        self._f: BinaryIO | None = open(self._tmp, "wb")  # noqa: SIM115 - closed in finish/abort
        self._hash = hashlib.sha256()
        self.size = 0
        self.digest: str | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert self._f is not None, "writer already finished"
        self.size += len(data)
        if self.expected_size is not None and self.size > self.expected_size:
            raise BadRequest(f"upload is larger than the announced {self.expected_size} bytes")
        self._hash.update(data)
        self._f.write(data)

    def seal(self) -> str:
        """Flush, fsync and close the temporary file and verify it; return the sha256. The content stays
        staged (not yet a blob) until :meth:`publish`, and is dropped by :meth:`abort`."""
        if self._f is None:
            assert self.digest is not None, "writer already aborted"
            return self.digest
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        digest = self._hash.hexdigest()
        if self.expected_size is not None and self.size != self.expected_size:
            raise BadRequest(f"upload has {self.size} bytes, {self.expected_size} were announced")
        if self.expected_sha256 is not None and digest != self.expected_sha256:
            raise BadRequest(f"upload content has sha256 {digest}, {self.expected_sha256} was announced")
        self.digest = digest
        return digest

    def publish(self) -> str:
        """Move the sealed content into the blob store (a no-op for content already stored)."""
        digest = self.seal()
        try:
            dest = self._store.blob_path(digest)
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(self._tmp, dest)
                _fsync_dir(dest.parent)
            return digest
        finally:
            self.abort()

    def finish(self) -> str:
        """Verify and store; return the sha256. Idempotent for content that is already stored."""
        try:
            return self.publish()
        finally:
            self.abort()

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._tmp.unlink(missing_ok=True)


class HubStorage:
    """All repos of one data folder. Thread-safe; safe across processes sharing the folder (flock)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.objects_dir = self.root / "objects"
        self.repos_dir = self.root / "repos"
        self.tmp_dir = self.root / "tmp"
        for d in (self.objects_dir, self.repos_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        meta = self.root / "hub.json"
        if meta.exists():
            version = json.loads(meta.read_text()).get("format")
            if version != FORMAT_VERSION:
                raise RuntimeError(
                    f"{self.root} holds hub data format {version}, this server reads {FORMAT_VERSION}"
                )
        else:
            atomic_write(meta, _canonical({"format": FORMAT_VERSION}), self.tmp_dir)
        self._sweep_tmp()
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._commit_cache: dict[tuple[str, str], Commit] = {}
        self._cache_guard = threading.Lock()

    def _sweep_tmp(self, max_age_s: float = 2 * 24 * 3600) -> None:
        """Drop partial uploads and temp files left by a crash. Only old ones: another server process sharing
        this folder may be writing fresh ones right now (upload URLs live 24 h)."""
        cutoff = time.time() - max_age_s
        for p in self.tmp_dir.iterdir():
            with contextlib.suppress(OSError):
                if p.lstat().st_mtime < cutoff:
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink()

    # ----- secrets -------------------------------------------------------------------------------------------
    def secret(self) -> bytes:
        """A random key kept in the data folder (mode 0600) to sign upload URLs, which the client calls without
        its token; keeping it on disk lets uploads signed before a restart still complete after it."""
        path = self.root / "secret"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            for _ in range(50):  # another process may be writing it right now
                data = path.read_bytes()
                if len(data) == 32:
                    return data
                time.sleep(0.01)
            raise RuntimeError(f"{path} is not a 32-byte key") from None
        key = secrets.token_bytes(32)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        return key

    # ----- blobs ---------------------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> Path:
        if not SHA256_HEX.fullmatch(sha256):
            raise BadRequest(f"invalid sha256 {sha256!r}: expected 64 lowercase hex characters")
        return self.objects_dir / sha256[:2] / sha256[2:4] / sha256

    def blob_size(self, sha256: str) -> int | None:
        """Size of a stored blob, or None when it is not stored."""
        try:
            return self.blob_path(sha256).stat().st_size
        except FileNotFoundError:
            return None

    def put_bytes(self, data: bytes) -> str:
        writer = BlobWriter(self)
        try:
            writer.write(data)
        except BaseException:
            writer.abort()
            raise
        return writer.finish()

    def stage_bytes(self, data: bytes) -> BlobWriter:
        """Write ``data`` to a sealed temporary file (see :meth:`BlobWriter.publish` / ``abort``)."""
        writer = BlobWriter(self)
        try:
            writer.write(data)
            writer.seal()
        except BaseException:
            writer.abort()
            raise
        return writer

    def blob_writer(self, sha256: str | None = None, size: int | None = None) -> BlobWriter:
        if sha256 is not None:
            self.blob_path(sha256)  # validates
        return BlobWriter(self, sha256, size)

    # ----- repos ---------------------------------------------------------------------------------------------
    def _repo_dir(self, repo_id: str) -> Path:
        try:
            namespace, name = validate_repo_id(repo_id)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return self.repos_dir / namespace / name

    def _existing_repo_dir(self, repo_id: str) -> Path:
        d = self._repo_dir(repo_id)
        if not (d / "refs.json").is_file():
            raise RepoNotFound.of(repo_id)
        return d

    def repo_exists(self, repo_id: str) -> bool:
        return (self._repo_dir(repo_id) / "refs.json").is_file()

    @contextlib.contextmanager
    def _lock(self, repo_id: str, create: bool = False) -> Iterator[Path]:
        """Hold the repo's write lock. Without ``create``, a missing repo is RepoNotFound (no directory is made)."""
        d = self._repo_dir(repo_id)
        with self._locks_guard:
            lock = self._locks.setdefault(repo_id, threading.Lock())
        with lock:
            fd = self._flock_repo_dir(repo_id, d, create)
            try:
                # Checked under the flock: another process may have deleted the repo while we waited.
                if not create and not (d / "refs.json").is_file():
                    raise RepoNotFound.of(repo_id)
                yield d
            finally:
                os.close(fd)  # releases the flock

    @staticmethod
    def _flock_repo_dir(repo_id: str, d: Path, create: bool) -> int:
        """An fd holding the flock of ``d/.lock``. Retried when the lock file was removed or replaced while we
        waited (a failed create or a delete removes the folder), so two holders never lock different files."""
        while True:
            try:
                if create:
                    d.mkdir(parents=True, exist_ok=True)
                fd = os.open(d / ".lock", os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
            except FileNotFoundError:  # with create: the folder was removed between mkdir and open
                if create:
                    continue
                raise RepoNotFound.of(repo_id) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    same = os.stat(d / ".lock").st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                return fd
            os.close(fd)
            if not create:
                raise RepoNotFound.of(repo_id)

    def create_repo(self, repo_id: str, *, private: bool = False, author: str = "local") -> bool:
        """Create a repo with an initial commit on ``main`` (as the Hub does); False if it already existed."""
        with self._lock(repo_id, create=True) as d:
            if (d / "refs.json").is_file():
                return False
            try:
                (d / "commits").mkdir(parents=True, exist_ok=True)
                created = now_iso()
                atomic_write(
                    d / "repo.json", _canonical({"created_at": created, "private": private}), self.tmp_dir
                )
                sha = self.put_bytes(INITIAL_GITATTRIBUTES)
                entry = FileEntry(
                    sha, len(INITIAL_GITATTRIBUTES), False, git_blob_sha1(INITIAL_GITATTRIBUTES)
                )
                commit = self._write_commit(d, None, "initial commit", "", author, {".gitattributes": entry})
                # refs.json last: its presence is what makes the repo exist.
                self._write_refs(d, Refs(branches={DEFAULT_BRANCH: commit.id}, tags={}))
            except BaseException:
                self._remove_unborn(d)
                raise
            return True

    def _remove_unborn(self, d: Path) -> None:
        """Undo a failed create (held under the repo's lock): no folder of a repo that never existed stays
        behind, nor its namespace folder if that is now empty."""
        if (d / "refs.json").exists():
            return
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            d.parent.rmdir()  # only if empty

    def delete_repo(self, repo_id: str) -> None:
        """Remove a repo (blobs stay: they may be shared with other repos)."""
        with self._lock(repo_id) as d:
            trash = self.tmp_dir / f"deleted-{secrets.token_hex(8)}"
            (d / "refs.json").unlink()  # the repo stops existing atomically here
            os.replace(d, trash)
        shutil.rmtree(trash, ignore_errors=True)
        with self._cache_guard:
            for key in [k for k in self._commit_cache if k[0] == repo_id]:
                del self._commit_cache[key]

    def repo_meta(self, repo_id: str) -> dict[str, Any]:
        d = self._existing_repo_dir(repo_id)
        return json.loads((d / "repo.json").read_text())

    def is_private(self, repo_id: str) -> bool | None:
        """The repo's private flag, or None when it does not exist."""
        try:
            return bool(self.repo_meta(repo_id).get("private"))
        except (RepoNotFound, FileNotFoundError):
            return None

    # ----- refs and commits ----------------------------------------------------------------------------------
    def refs(self, repo_id: str) -> Refs:
        d = self._existing_repo_dir(repo_id)
        return self._read_refs(d)

    @staticmethod
    def _read_refs(d: Path) -> Refs:
        data = json.loads((d / "refs.json").read_text())
        return Refs(branches=dict(data["branches"]), tags=dict(data["tags"]))

    def _write_refs(self, d: Path, refs: Refs) -> None:
        atomic_write(
            d / "refs.json", _canonical({"branches": refs.branches, "tags": refs.tags}), self.tmp_dir
        )

    def resolve(self, repo_id: str, revision: str) -> str:
        """Commit sha of a branch, tag or full commit sha (branches win over tags, as in git)."""
        d = self._existing_repo_dir(repo_id)
        refs = self._read_refs(d)
        if revision in refs.branches:
            return refs.branches[revision]
        if revision in refs.tags:
            return refs.tags[revision]
        if COMMIT_SHA.fullmatch(revision) and (d / "commits" / f"{revision}.json").is_file():
            return revision
        raise RevisionNotFound(f"Invalid rev id: {revision}")

    def commit(self, repo_id: str, sha: str) -> Commit:
        key = (repo_id, sha)
        with self._cache_guard:
            cached = self._commit_cache.get(key)
        if cached is not None:
            return cached
        d = self._existing_repo_dir(repo_id)
        if not COMMIT_SHA.fullmatch(sha):
            raise RevisionNotFound(f"Invalid rev id: {sha}")
        try:
            data = json.loads((d / "commits" / f"{sha}.json").read_text())
        except FileNotFoundError:
            raise RevisionNotFound(f"Invalid rev id: {sha}") from None
        commit = Commit(
            id=sha,
            parent=data["parent"],
            summary=data["summary"],
            description=data["description"],
            author=data["author"],
            date=data["date"],
            files={p: FileEntry.from_json(e) for p, e in data["files"].items()},
        )
        with self._cache_guard:
            if len(self._commit_cache) >= _CACHE_SIZE:
                self._commit_cache.pop(next(iter(self._commit_cache)))
            self._commit_cache[key] = commit
        return commit

    def history(self, repo_id: str, sha: str) -> Iterator[Commit]:
        """Commits from ``sha`` back to the initial one, newest first."""
        cur: str | None = sha
        while cur is not None:
            c = self.commit(repo_id, cur)
            yield c
            cur = c.parent

    def _write_commit(
        self,
        d: Path,
        parent: str | None,
        summary: str,
        description: str,
        author: str,
        files: dict[str, FileEntry],
    ) -> Commit:
        body = {
            "format": FORMAT_VERSION,
            "parent": parent,
            "summary": summary,
            "description": description,
            "author": author,
            "date": now_iso(),
            # Random salt: two commits with the same parent, message and files in the same millisecond
            # (e.g. the same commit re-sent after a lost reply) still get distinct ids.
            "salt": secrets.token_hex(8),
            "files": {p: files[p].to_json() for p in sorted(files)},
        }
        raw = _canonical(body)
        sha = hashlib.sha1(raw, usedforsecurity=False).hexdigest()
        atomic_write(d / "commits" / f"{sha}.json", raw, self.tmp_dir)
        return Commit(sha, parent, summary, description, author, body["date"], dict(files))

    def apply_commit(
        self,
        repo_id: str,
        branch: str,
        operations: Iterable[Operation],
        *,
        summary: str,
        description: str = "",
        parent_commit: str | None = None,
        author: str = "local",
    ) -> Commit:
        """Apply operations on top of ``branch`` and move it to the new commit, atomically.

        ``parent_commit`` (when given) must be the branch head, else PreconditionFailed (412), as on the Hub.
        LFS contents must already be stored. Raises EntryNotFound for deleting a missing file or folder and
        Conflict when a path would be both a file and a folder.
        """
        operations = list(operations)
        for op in operations:
            if isinstance(op, AddFile) and self.blob_size(op.entry.sha256) != op.entry.size:
                raise Unprocessable(
                    f"content of {op.path!r} (sha256 {op.entry.sha256}) has not been uploaded"
                )
        with self._lock(repo_id) as d:
            refs = self._read_refs(d)
            if branch not in refs.branches:
                if branch in refs.tags or COMMIT_SHA.fullmatch(branch):
                    raise BadRequest(f"cannot commit to {branch!r}: commits can only be made to a branch")
                raise RevisionNotFound(f"Invalid rev id: {branch}")
            head = refs.branches[branch]
            if parent_commit is not None and parent_commit != head:
                raise PreconditionFailed(
                    f"A commit has happened since {parent_commit} (branch {branch!r} is at {head}). "
                    "Please refresh and try again."
                )
            files = dict(self.commit(repo_id, head).files)
            for op in operations:
                if isinstance(op, AddFile):
                    files[op.path] = op.entry
                elif isinstance(op, DeleteFile):
                    if op.path not in files:
                        raise EntryNotFound(f"A file with this name doesn't exist: {op.path}")
                    del files[op.path]
                else:
                    prefix = op.path.rstrip("/") + "/"
                    doomed = [p for p in files if p.startswith(prefix)]
                    if not doomed:
                        raise EntryNotFound(f"A folder with this name doesn't exist: {op.path}")
                    for p in doomed:
                        del files[p]
            for p in files:
                parts = p.split("/")
                for i in range(1, len(parts)):
                    if "/".join(parts[:i]) in files:
                        raise Conflict(
                            f"{'/'.join(parts[:i])!r} is a file, so {p!r} cannot be created under it"
                        )
            clash = path_collision(files, (op.path for op in operations if isinstance(op, AddFile)))
            if clash is not None:
                raise Conflict(
                    f"invalid path in repo {clash[0]!r}: it is the same name as {clash[1]!r} where case and "
                    "Unicode normalisation do not count (macOS, Windows): a download would keep one of them"
                )
            commit = self._write_commit(d, head, summary, description, author, files)
            refs.branches[branch] = commit.id
            try:
                self._write_refs(d, refs)
            except BaseException:
                # refs.json is written atomically, so the branch still points at the old head: drop the
                # commit file no ref will ever reach.
                (d / "commits" / f"{commit.id}.json").unlink(missing_ok=True)
                raise
            return commit

    def create_tag(self, repo_id: str, tag: str, revision: str, move: bool = False) -> str:
        """Tag ``revision``. ``move``: an existing tag is moved there instead of refused (409), in one
        write under the repo's lock, so it is never missing for a reader (our extension of the Hub API)."""
        try:
            validate_ref_name(tag, "tag")
        except ValueError as e:
            raise BadRequest(str(e)) from None
        with self._lock(repo_id) as d:
            sha = self.resolve(repo_id, revision)
            refs = self._read_refs(d)
            if tag in refs.tags and not move:
                raise Conflict(f"Tag {tag!r} already exists (at {refs.tags[tag]})")
            if tag in refs.branches:
                raise Conflict(f"{tag!r} is already a branch name; tags and branches must not share a name")
            refs.tags[tag] = sha
            self._write_refs(d, refs)
            return sha

    def delete_tag(self, repo_id: str, tag: str) -> None:
        with self._lock(repo_id) as d:
            refs = self._read_refs(d)
            if tag not in refs.tags:
                raise RevisionNotFound(f"Tag not found: {tag}")
            del refs.tags[tag]
            self._write_refs(d, refs)

    def create_branch(self, repo_id: str, branch: str, starting_point: str | None = None) -> str:
        try:
            validate_ref_name(branch, "branch")
        except ValueError as e:
            raise BadRequest(str(e)) from None
        with self._lock(repo_id) as d:
            sha = self.resolve(repo_id, starting_point or DEFAULT_BRANCH)
            refs = self._read_refs(d)
            if branch in refs.branches:
                raise Conflict(f"Branch {branch!r} already exists (at {refs.branches[branch]})")
            if branch in refs.tags:
                raise Conflict(f"{branch!r} is already a tag name; tags and branches must not share a name")
            refs.branches[branch] = sha
            self._write_refs(d, refs)
            return sha

    def delete_branch(self, repo_id: str, branch: str) -> None:
        with self._lock(repo_id) as d:
            if branch == DEFAULT_BRANCH:
                raise Forbidden(f"Cannot delete the default branch {DEFAULT_BRANCH!r}")
            refs = self._read_refs(d)
            if branch not in refs.branches:
                raise RevisionNotFound(f"Branch not found: {branch}")
            del refs.branches[branch]
            self._write_refs(d, refs)

    def last_commits(self, repo_id: str, sha: str, paths: Iterable[str]) -> dict[str, Commit]:
        """For each path (file or folder), the newest commit reachable from ``sha`` that changed it."""
        pending = set(paths)
        found: dict[str, Commit] = {}

        def signature(files: dict[str, FileEntry], path: str) -> Any:
            if path in files:
                return files[path]
            prefix = path + "/"
            return tuple(sorted((p, e.sha256) for p, e in files.items() if p.startswith(prefix)))

        commits = self.history(repo_id, sha)
        cur = next(commits)
        for parent in commits:
            for path in list(pending):
                if signature(cur.files, path) != signature(parent.files, path):
                    found[path] = cur
                    pending.discard(path)
            if not pending:
                return found
            cur = parent
        for path in pending:  # unchanged since the initial commit
            found[path] = cur
        return found


def check_path(path: Any) -> str:
    """validate_repo_path for server input: a BadRequest (400) instead of a ValueError."""
    if not isinstance(path, str):
        raise BadRequest(f"invalid path in repo: expected a string, got {type(path).__name__}")
    try:
        return validate_repo_path(path)
    except ValueError as e:
        raise BadRequest(str(e)) from None
