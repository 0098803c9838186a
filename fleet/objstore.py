"""The episode store on object storage: ``s3://bucket/prefix`` through fsspec (s3fs).

:class:`fleet.store.EpisodeStore` keeps its layout and commit protocol on S3; this module holds what
differs from a local directory:

* :class:`ObjectStore`: one bucket prefix, with the few object operations the store needs (get, put,
  list one level, delete) on a synchronous s3fs filesystem, and :meth:`ObjectStore.zarr_store` for
  zarr (an asynchronous s3fs filesystem in a ``zarr.storage.FsspecStore``).
* :class:`DiskCacheStore`: a zarr store wrapper that keeps every object it reads in a local directory,
  for episodes that are closed (immutable), so a trainer reading a dataset twice downloads it once.

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
import hashlib
import logging
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore

_URL_RE = re.compile(r"^s3:/+(?P<bucket>[^/]+)(?:/(?P<prefix>.*))?$")
# S3 bucket naming rules (the subset every S3-compatible server accepts).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
CACHE_ENV = "VLA_RL_STORE_CACHE"
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
    m = _URL_RE.match(text)
    if m is None:
        raise StoreURLError(f"store: expected s3://BUCKET/PREFIX, got {text!r}")
    bucket, prefix = m["bucket"], (m["prefix"] or "").strip("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
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
    def zarr_store(self, key: str, *, read_only: bool, cache_dir: Path | None = None) -> Store:
        """A zarr store rooted at ``key``; with ``cache_dir``, reads go through :class:`DiskCacheStore`
        (only for objects that never change: a closed episode's)."""
        import s3fs
        from zarr.storage import FsspecStore

        if self._afs is None:
            self._afs = s3fs.S3FileSystem(asynchronous=True, **s3_options())
            atexit.register(_close_async, self._afs)
        store: Store = FsspecStore(self._afs, path=self.path(key), read_only=read_only)
        if cache_dir is not None:
            store = DiskCacheStore(store, self.cache_root(cache_dir) / key)
        return store

    def cache_root(self, cache_dir: Path) -> Path:
        """This store's folder in a cache directory (one per URL and endpoint)."""
        endpoint = s3_options()["client_kwargs"].get("endpoint_url", "")
        digest = hashlib.sha256(f"{endpoint}|{self.url}".encode()).hexdigest()[:16]
        return cache_dir / f"{self.bucket}-{digest}"


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
    metadata); ``hits`` and ``misses`` count whole-object reads."""

    def __init__(self, store: Store, root: Path) -> None:
        super().__init__(store)
        self.root = root
        self.hits = 0
        self.misses = 0

    def _with_store(self, store: Store) -> DiskCacheStore:
        return type(self)(store, self.root)

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
        write_cached(absent if buf is None else path, b"" if buf is None else buf.to_bytes())
        return buf

    async def exists(self, key: str) -> bool:
        return (self.root / key).exists() or await self._store.exists(key)
