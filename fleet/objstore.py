"""The episode store on object storage: ``s3://bucket/prefix`` through fsspec (s3fs).

:class:`fleet.store.EpisodeStore` keeps its layout and commit protocol on S3; this module holds what
differs from a local directory:

* :class:`ObjectStore`: one bucket prefix, with the few object operations the store needs (get, put,
  list one level, delete) on a synchronous s3fs filesystem, and :meth:`ObjectStore.zarr_store` for
  zarr (an asynchronous s3fs filesystem in a ``zarr.storage.FsspecStore``).
* :class:`DiskCacheStore`: a zarr store wrapper that keeps every object it reads in a local directory,
  for episodes that are closed (immutable), so a trainer reading a dataset twice downloads it once.
* :class:`ReadCache`: that directory's size limit (``VLA_RL_STORE_CACHE_MAX_GB``, default 20 GB): whole
  closed episodes are evicted, least recently used first, by an atomic rename out of the cache then a
  delete, so a reader never sees a torn file: a file it has open stays readable, and one gone before it
  opened it is a cache miss, fetched again.

Credentials and endpoint come from the environment, never the command line: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (or any botocore credential source: ``AWS_PROFILE``, an instance role),
``AWS_ENDPOINT_URL`` for an S3-compatible server (MinIO, moto), ``AWS_REGION`` / ``AWS_DEFAULT_REGION``
(default ``us-east-1``), or an fsspec config file with an ``s3`` section. Opening a store checks the
bucket at once, so a wrong URL, missing credentials, a missing bucket or one that denies access fail
at start-up with :class:`StoreURLError` naming the setting, not mid-run.

Why PUTs need nothing like the local store's temp-file-and-rename: an S3 PUT replaces the object
atomically (readers see the old or the new object), so a chunk or ``commit.json`` is never torn. The
order still matters: the writer waits for every chunk PUT of a block before it PUTs ``commit.json``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

_URL_RE = re.compile(r"s3:/+(?P<bucket>[^/]+)(?:/(?P<prefix>.*))?")  # fullmatch only (`$` takes "\n")
# S3 bucket naming rules (the subset every S3-compatible server accepts).
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
CACHE_ENV = "VLA_RL_STORE_CACHE"
CACHE_MAX_ENV = "VLA_RL_STORE_CACHE_MAX_GB"
DEFAULT_CACHE_MAX_GB = 20.0
_USED = ".used"  # in a cached episode's folder: its mtime is when a reader last opened the episode
_EVICTING = ".evicting-"  # an episode folder renamed out of the cache, being deleted
_ABSENT = ".absent"  # cache marker beside a key: the object does not exist (zarr keys never end so)
_CREDENTIALS_HELP = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment (or AWS_PROFILE, or an fsspec "
    "config with an s3 section); AWS_ENDPOINT_URL for an S3-compatible server"
)


class StoreURLError(ValueError):
    """An object-store URL, its credentials or its bucket do not work (the message names the setting)."""


def is_remote(root: str | os.PathLike[str]) -> bool:
    """Whether ``root`` names an object store (``s3://...``; also ``s3:/...``, what ``Path`` makes of it)."""
    return str(root).startswith("s3:/")


def normalize_url(root: str | os.PathLike[str]) -> tuple[str, str, str]:
    """``(url, bucket, prefix)`` of an ``s3://bucket/prefix`` store URL, or StoreURLError naming what is wrong."""
    text = str(root)
    m = _URL_RE.fullmatch(text)
    if m is None:
        raise StoreURLError(f"store: expected s3://BUCKET/PREFIX, got {text!r}")
    bucket, prefix = m["bucket"], (m["prefix"] or "").strip("/")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise StoreURLError(
            f"store: {bucket!r} in {text!r} is not a valid bucket name (3-63 characters: a-z, 0-9, '.', '-')"
        )
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise StoreURLError(f"store: the prefix {prefix!r} of {text!r} has an empty, '.' or '..' part")
    url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return url, bucket, prefix


def s3_options() -> dict[str, Any]:
    """s3fs options from the environment: endpoint and region (credentials are botocore's to find)."""
    client: dict[str, Any] = {
        "region_name": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        client["endpoint_url"] = endpoint
    # Listings change under a reader (new episodes appear): never answer one from s3fs's memory.
    return {"client_kwargs": client, "use_listings_cache": False}


def _has_credentials() -> bool:
    """Whether botocore (or an fsspec config) can find credentials; checked before any request."""
    import botocore.session
    import fsspec.config

    conf = fsspec.config.conf.get("s3", {})
    if conf.get("key") or conf.get("anon") or conf.get("profile"):
        return True
    return botocore.session.get_session().get_credentials() is not None


def _explain(e: BaseException, url: str, bucket: str) -> StoreURLError:
    """A start-up failure of the bucket check as the setting to fix."""
    import botocore.exceptions as bex

    endpoint = s3_options()["client_kwargs"].get("endpoint_url", "AWS's default endpoint")
    if isinstance(e, bex.NoCredentialsError | bex.PartialCredentialsError):
        return StoreURLError(f"store {url}: no S3 credentials: {_CREDENTIALS_HELP}")
    if isinstance(e, bex.EndpointConnectionError | bex.ConnectTimeoutError | ConnectionError):
        return StoreURLError(
            f"store {url}: cannot reach the S3 endpoint {endpoint} ({e}); check AWS_ENDPOINT_URL"
        )
    if isinstance(e, FileNotFoundError):
        return StoreURLError(
            f"store {url}: the bucket {bucket!r} does not exist at {endpoint}; create it, or fix --store"
        )
    if isinstance(e, PermissionError):
        return StoreURLError(
            f"store {url}: access denied to the bucket {bucket!r} ({e}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY and the bucket's policy"
        )
    text = str(e)
    if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text or "Forbidden" in text:
        return StoreURLError(
            f"store {url}: the S3 server refused the credentials ({text}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY"
        )
    return StoreURLError(f"store {url}: the bucket check failed at {endpoint}: {type(e).__name__}: {e}")


class ObjectStore:
    """One ``s3://bucket/prefix``: keys are relative to the prefix (``episodes/<id>/commit.json``).

    ``writable=True`` also checks that the bucket takes writes (a probe object is put and deleted).
    """

    def __init__(self, root: str | os.PathLike[str], *, writable: bool = False) -> None:
        import s3fs

        self.url, self.bucket, self.prefix = normalize_url(root)
        quiet = logging.getLogger("botocore.credentials")  # "Found credentials in ..." on every open
        if quiet.level == logging.NOTSET:
            quiet.setLevel(logging.WARNING)
        if not _has_credentials():
            raise StoreURLError(f"store {self.url}: no S3 credentials: {_CREDENTIALS_HELP}")
        self.fs = s3fs.S3FileSystem(**s3_options())
        self._afs: Any = None
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
            if writable:
                probe = self.path(f".write-check-{uuid.uuid4().hex}")
                self.fs.pipe_file(probe, b"")
                self.fs.rm_file(probe)
        except StoreURLError:
            raise
        except Exception as e:  # any failure of the check names the setting behind it
            raise _explain(e, self.url, self.bucket) from None

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def path(self, key: str = "") -> str:
        """The s3fs path (``bucket/prefix/key``) of a key."""
        return "/".join(p for p in (self.bucket, self.prefix, key.strip("/")) if p)

    # ------------------------------------------------------------------ objects
    def get(self, key: str) -> bytes:
        """An object's bytes; FileNotFoundError if there is none."""
        return bytes(self.fs.cat_file(self.path(key)))

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """The objects that exist among ``keys`` (fetched concurrently), by key. A missing object is
        left out; any other failure (the server unreachable, access denied) raises: it must never
        pass for "no such object"."""
        keys = list(keys)
        if not keys:
            return {}
        by_path = {self.path(k): k for k in keys}
        got = self.fs.cat(list(by_path), on_error="return")
        out: dict[str, bytes] = {}
        for p, v in got.items():
            if isinstance(v, FileNotFoundError):
                continue
            if isinstance(v, BaseException):
                raise v
            out[by_path[p]] = bytes(v)
        return out

    def put(self, key: str, data: bytes) -> None:
        """Replace an object (atomic for readers: the old or the new bytes, never a mix)."""
        self.fs.pipe_file(self.path(key), data)

    def put_many(self, objects: Mapping[str, bytes]) -> None:
        """Put several objects concurrently."""
        if objects:
            self.fs.pipe({self.path(k): v for k, v in objects.items()})

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.path(key)))

    def list_dir(self, key: str) -> list[str]:
        """Names one level below ``key`` (objects and common prefixes), sorted; [] if there is nothing."""
        base = self.path(key)
        try:
            entries = self.fs.ls(base, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries if str(e).rstrip("/") != base)

    def list_keys(self, key: str) -> list[str]:
        """Every key below ``key`` (recursive), relative to the store's prefix."""
        base = self.path()
        try:
            found = self.fs.find(self.path(key))
        except FileNotFoundError:
            return []
        return sorted(str(p)[len(base) + 1 :] for p in found)

    def size(self) -> int:
        """Bytes of every object under the prefix."""
        try:
            return int(self.fs.du(self.path(), total=True))
        except FileNotFoundError:
            return 0

    def delete_tree(self, key: str) -> None:
        """Remove every object below ``key``."""
        keys = [self.path(k) for k in self.list_keys(key)]
        if keys:
            self.fs.rm(keys)

    # ------------------------------------------------------------------ zarr
    def zarr_store(self, key: str, *, read_only: bool, cache: ReadCache | None = None) -> Store:
        """A zarr store rooted at ``key``; with ``cache``, reads go through :class:`DiskCacheStore`
        (only for objects that never change: a closed episode's)."""
        import s3fs
        from zarr.storage import FsspecStore

        if self._afs is None:
            self._afs = s3fs.S3FileSystem(asynchronous=True, **s3_options())
            atexit.register(_close_async, self._afs)
        store: Store = FsspecStore(self._afs, path=self.path(key), read_only=read_only)
        if cache is not None:
            store = DiskCacheStore(store, self.cache_root(cache.root) / key, cache)
        return store

    def cache_root(self, cache_dir: Path) -> Path:
        """This store's folder in a cache directory (one per URL and endpoint)."""
        endpoint = s3_options()["client_kwargs"].get("endpoint_url", "")
        digest = hashlib.sha256(f"{endpoint}|{self.url}".encode()).hexdigest()[:16]
        return cache_dir / f"{self.bucket}-{digest}"


# ---------------------------------------------------------------------------- the collector's lease
LEASE_KEY = ".collector-lease"


class LeaseHeld(RuntimeError):
    """Another live collector holds the store's lease (the message names it)."""


def _precondition_failed(e: BaseException) -> bool:
    """Whether an s3fs error is S3's answer to a failed conditional write (412 / 409)."""
    cause = e.__cause__ or e.__context__
    response = getattr(cause, "response", None) or {}
    code = response.get("Error", {}).get("Code", "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


class StoreLease:
    """The one-writer lease of an object store prefix: ``<prefix>/.collector-lease``, a JSON object
    ``{owner, host, pid, wal_dir, renewed, expires}``.

    Taken with a conditional PUT (``If-None-Match: *``: only if there is none), renewed every
    ``ttl_s / 3`` by a heartbeat thread with ``If-Match: <our ETag>`` (so a renewal never overwrites
    someone else's lease), released on stop with a conditional DELETE. An expired lease (its holder
    stopped renewing: killed, or cut off for ``ttl_s``) is taken over with ``If-Match`` on the ETag that
    was read, so of two collectors racing for it one wins. A lease whose holder is this host and this
    WAL directory is taken over at once: the caller holds that directory's local lock, so its previous
    holder is dead (a collector restarted after a crash does not wait for the expiry).

    Needs an S3 server with conditional writes (AWS S3 since 2024, MinIO, moto). Expiry compares wall
    clocks: the machines' clocks must agree to well within ``ttl_s`` (NTP). A holder that cannot renew
    (its object store unreachable) keeps working from its log; if its lease expired meanwhile and
    another collector took it, its next renewal fails and ``lost`` names the new holder.
    """

    def __init__(self, remote: ObjectStore, wal_dir: str | os.PathLike[str], ttl_s: float = 30.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease_ttl_s: expected > 0 seconds, got {ttl_s}")
        import socket

        self.remote, self.ttl_s = remote, float(ttl_s)
        self.host, self.wal_dir = socket.gethostname(), str(Path(wal_dir).absolute())
        self.owner = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.key = remote.path(LEASE_KEY)
        self.etag: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._renewing = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ S3 calls
    def _body(self) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "owner": self.owner,
                "host": self.host,
                "pid": os.getpid(),
                "wal_dir": self.wal_dir,
                "renewed": now,
                "expires": now + self.ttl_s,
            }
        ).encode()

    def _put(self, **condition: str) -> str:
        bucket, _, key = self.key.partition("/")
        r = self.remote.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=self._body(), **condition)
        return str(r["ETag"])

    def _read(self) -> tuple[dict[str, Any], str] | None:
        """The current lease and its ETag (one GET: body and tag of the same version); None if none."""
        from fsspec.asyn import sync

        bucket, _, key = self.key.partition("/")
        fs = self.remote.fs

        async def get() -> tuple[bytes, str]:
            r = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            async with r["Body"] as body:
                return await body.read(), str(r["ETag"])

        try:
            data, etag = sync(fs.loop, get)
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(data)
        except ValueError:
            doc = {}
        return (doc if isinstance(doc, dict) else {}), etag

    # ------------------------------------------------------------------ lifecycle
    def acquire(self, heartbeat: bool = True) -> StoreLease:
        """Take the lease (or LeaseHeld naming its live holder) and start renewing it."""
        for _ in range(5):  # the lease can change between our reads: look again
            try:
                self.etag = self._put(IfNoneMatch="*")
                break
            except OSError as e:
                if not _precondition_failed(e):
                    raise
            current = self._read()
            if current is None:
                continue  # released meanwhile
            doc, etag = current
            mine = doc.get("host") == self.host and doc.get("wal_dir") == self.wal_dir
            left = float(doc.get("expires", 0.0)) - time.time()
            if left > 0 and not mine:
                raise LeaseHeld(
                    f"store {self.remote.url}: another collector holds its lease: {doc.get('owner', '?')} "
                    f"(WAL dir {doc.get('wal_dir', '?')}), renewed {time.time() - float(doc.get('renewed', 0)):.0f} s "
                    f"ago, expires in {left:.0f} s unless renewed; one collector writes a store: stop that "
                    f"one, or give this one another --store prefix"
                )
            try:
                self.etag = self._put(IfMatch=etag)  # expired (or our own dead predecessor's): take it
                logging.getLogger(__name__).warning(
                    "took over the store's lease",
                    extra={"store": self.remote.url, "previous": doc.get("owner"), "expired_s": -left},
                )
                break
            except OSError as e:
                if not _precondition_failed(e):
                    raise  # someone else took it first: look again
        else:
            raise LeaseHeld(f"store {self.remote.url}: its lease keeps changing hands; try again")
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, name="store-lease", daemon=True)
            self._thread.start()
        return self

    def renew(self) -> bool:
        """Extend the lease; False (and ``lost`` set) if it is not ours any more. Network errors raise."""
        with self._renewing:  # one renewal at a time: two with one ETag would look like a lost lease
            if self.etag is None or self.lost:
                return False
            try:
                self.etag = self._put(IfMatch=self.etag)
                return True
            except OSError as e:
                if not _precondition_failed(e) and not isinstance(e, FileNotFoundError):
                    raise
        current = self._read()
        self.lost = str(current[0].get("owner", "?")) if current else "nobody (it was deleted)"
        logging.getLogger(__name__).error(
            "lost the store's lease: another collector may be writing this store",
            extra={"store": self.remote.url, "holder": self.lost},
        )
        return False

    def _beat(self) -> None:
        log = logging.getLogger(__name__)
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    return
            except Exception as e:  # the object store unreachable: try again at the next beat
                log.warning(
                    "could not renew the store's lease", extra={"store": self.remote.url, "error": str(e)}
                )

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours (never someone else's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.etag is None or self.lost:
            return
        bucket, _, key = self.key.partition("/")
        try:
            self.remote.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=self.etag)
        except Exception as e:  # not ours any more, or unreachable: it expires by itself
            logging.getLogger(__name__).warning(
                "could not release the store's lease", extra={"store": self.remote.url, "error": str(e)}
            )
        self.etag = None


def _close_async(afs: Any) -> None:
    """Close an asynchronous s3fs client on zarr's event loop (else aiohttp warns at exit)."""
    client = getattr(afs, "_s3", None)
    if client is None:
        return
    try:
        from zarr.core.sync import sync

        sync(client.__aexit__(None, None, None))
    except Exception:  # the loop may be gone already; nothing is lost at exit
        pass


def cache_dir_from_env(cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The read cache to use: ``cache_dir`` if given, else ``$VLA_RL_STORE_CACHE``, else
    ``~/.cache/vla-rl/store``; ``off`` (either way) for none."""
    value = str(cache_dir) if cache_dir is not None else os.environ.get(CACHE_ENV)
    if value is None:
        return Path.home() / ".cache" / "vla-rl" / "store"
    if value.strip().lower() in ("", "off", "none", "0"):
        return None
    return Path(value).expanduser().absolute()


def cache_max_bytes(max_gb: float | None) -> int:
    """The read cache's size limit in bytes: ``max_gb`` if given, else ``$VLA_RL_STORE_CACHE_MAX_GB``,
    else 20 GB; a ValueError naming the setting unless it is a number of GB > 0."""
    name, value = "cache_max_gb", max_gb
    if value is None:
        text = os.environ.get(CACHE_MAX_ENV, "").strip()
        if not text:
            return int(DEFAULT_CACHE_MAX_GB * 1e9)
        name = CACHE_MAX_ENV
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name}: expected a size in GB > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a size in GB > 0, got {value!r}")
    return int(value * 1e9)


def _tree_bytes(path: Path) -> int:
    """Bytes of the files below ``path`` (0 for what vanished meanwhile)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(dirpath, f)).st_size
    return total


class ReadCache:
    """A local read cache folder (``root``: one subfolder per store, ``<store>/episodes/<id>/`` per
    episode) kept under ``max_bytes``: whole episodes evicted least recently used first.

    Recency: a reader opening a cached episode touches ``<id>/.used`` (at most every ``touch_s`` per
    episode and process). Size: each process counts the bytes it adds; every ``max_bytes / 20`` of them
    (and at its first addition) it sweeps the folder: if the cached episodes total more than
    ``max_bytes``, the least recently used go until they total at most 90% of it. Eviction is a rename
    of the episode's folder out of the cache (atomic), then its deletion: concurrent readers (threads or
    processes) either read a whole file (an open file outlives its deletion) or find it missing, which
    is a miss (:class:`DiskCacheStore` fetches the object again). The episode being read by the
    sweeping reader is never evicted by it.
    """

    def __init__(self, root: Path, max_bytes: int, touch_s: float = 10.0) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: expected > 0, got {max_bytes}")
        self.root, self.max_bytes, self.touch_s = Path(root), int(max_bytes), touch_s
        self.slack = max(self.max_bytes // 20, 1)
        self.evicted = 0
        self._added = self.slack  # the first addition sweeps
        self._touched: dict[Path, float] = {}
        self._lock = threading.Lock()

    def touch(self, episode_dir: Path) -> None:
        """Mark a cached episode as just used (throttled); nothing if it is not cached (yet)."""
        now = time.monotonic()
        with self._lock:
            if now - self._touched.get(episode_dir, -math.inf) < self.touch_s:
                return
            self._touched[episode_dir] = now
        if episode_dir.is_dir():
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                (episode_dir / _USED).touch()

    def added(self, nbytes: int, episode_dir: Path) -> None:
        """``nbytes`` were written into ``episode_dir``: sweep when enough accumulated."""
        with self._lock:
            self._added += nbytes
            if self._added < self.slack:
                return
            self._added = 0
        self.sweep(keep=episode_dir)

    def episodes(self) -> list[tuple[float, int, Path]]:
        """``(last used, bytes, folder)`` of every cached episode."""
        out = []
        for store_dir in _subdirs(self.root):
            for ep in _subdirs(store_dir / "episodes"):
                try:
                    used = (ep / _USED).stat().st_mtime
                except FileNotFoundError:
                    try:
                        used = ep.stat().st_mtime
                    except FileNotFoundError:
                        continue
                out.append((used, _tree_bytes(ep), ep))
        return out

    def sweep(self, keep: Path | None = None) -> int:
        """Evict least recently used episodes while the cache is over ``max_bytes`` (down to 90%), never
        ``keep``; returns how many went."""
        entries = sorted(self.episodes())
        total = sum(size for _, size, _ in entries)
        if total <= self.max_bytes:
            return 0
        target, n = int(self.max_bytes * 0.9), 0
        for _, size, ep in entries:
            if total <= target:
                break
            if keep is not None and ep == keep:
                continue
            trash = self.root / f"{_EVICTING}{uuid.uuid4().hex}"
            try:
                os.rename(ep, trash)  # atomic: readers see the whole folder or none of it
            except FileNotFoundError:
                continue  # another process evicted it first
            shutil.rmtree(trash, ignore_errors=True)
            total -= size
            n += 1
        with self._lock:
            self.evicted += n
        if n:
            logging.getLogger(__name__).info(
                "read cache: evicted least recently used episodes",
                extra={"episodes": n, "bytes_left": total, "max_bytes": self.max_bytes},
            )
        return n


def _subdirs(path: Path) -> list[Path]:
    """Sub-folders of ``path`` that hold cache entries (not the ones being evicted); [] if none."""
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except FileNotFoundError:
        return []


def read_cached(path: Path) -> bytes | None:
    """A cache file's bytes, or None if it is not there (never cached, or evicted: fetch it again)."""
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


def write_cached(path: Path, data: bytes) -> None:
    """Put a cache file in place atomically (concurrent readers of one cache never see a torn file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class DiskCacheStore(WrapperStore[Store]):
    """Reads through a local directory: an object read once is served from ``root/<key>`` afterwards,
    also by later processes. Only for objects that never change (a closed episode's arrays and
    metadata); ``hits`` and ``misses`` count whole-object reads. With ``cache``, ``root`` is one
    episode's folder in that bounded cache (its use is recorded; a file evicted under it is a miss)."""

    def __init__(self, store: Store, root: Path, cache: ReadCache | None = None) -> None:
        super().__init__(store)
        self.root = root
        self.cache = cache
        self.hits = 0
        self.misses = 0
        if cache is not None:
            cache.touch(root)

    def _with_store(self, store: Store) -> DiskCacheStore:
        return type(self)(store, self.root, self.cache)

    def __eq__(self, value: object) -> bool:
        return isinstance(value, DiskCacheStore) and self.root == value.root and self._store == value._store

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if byte_range is not None:
            return await self._store.get(key, prototype, byte_range)
        path = self.root / key
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            pass
        else:
            self.hits += 1
            return prototype.buffer.from_bytes(data)
        absent = path.with_name(path.name + _ABSENT)
        if absent.exists():  # a chunk zarr never wrote (all fill value): known not to exist
            self.hits += 1
            return None
        self.misses += 1
        buf = await self._store.get(key, prototype)
        data = b"" if buf is None else buf.to_bytes()
        with contextlib.suppress(FileNotFoundError):  # the episode was evicted while we wrote: not kept
            write_cached(absent if buf is None else path, data)
        if self.cache is not None:
            self.cache.added(len(data), self.root)
        return buf

    async def exists(self, key: str) -> bool:
        return (self.root / key).exists() or await self._store.exists(key)
