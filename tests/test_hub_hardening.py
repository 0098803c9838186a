"""Hardening of the local Hub server (issue 16): each test covers a class of attack, not one input.

Private repos on every read route; request bodies bounded, streamed and parsed off the event loop; bad input
answering 4xx (never a bare 500), a full disk 507, failed writes leaving nothing behind; pagination costing a
page; ids matched in full. Servers run on loopback; every test is bounded in time and memory.
"""

from __future__ import annotations

import base64
import errno
import http.client
import json
import re
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
from test_hub import READ_ROUTES, TOKEN, _auth, _commit_body, _raw, hub_client_env  # noqa: F401 - fixture

from vla_rl.hub import naming
from vla_rl.hub.limits import Limits
from vla_rl.hub.registry import configure_hub
from vla_rl.hub.server import HubServer
from vla_rl.hub.storage import HubStorage

MB = 1024 * 1024
HUB_SRC = Path(naming.__file__).parent


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, hub_client_env: None) -> Iterator[HubServer]:  # noqa: F811
    with HubServer(tmp_path_factory.mktemp("hardening") / "data", token=TOKEN) as server:
        configure_hub(server.url)  # Xet off: this server speaks classic LFS
        yield server


@pytest.fixture(scope="module")
def api(hub: HubServer) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=TOKEN)


def _file_op(path: str, data: bytes) -> dict[str, Any]:
    return {
        "key": "file",
        "value": {"path": path, "content": base64.b64encode(data).decode(), "encoding": "base64"},
    }


def _app_routes() -> list[Any]:
    from fastapi.routing import APIRoute

    from vla_rl.hub.routes import ROUTERS

    routes = [r for router in ROUTERS for r in router.routes]
    assert all(isinstance(r, APIRoute) for r in routes)
    return routes


def _deps(route: Any) -> set[Any]:
    def calls(d: Any) -> set[Any]:
        return {d.call} | {c for sub in d.dependencies for c in calls(sub)}

    return calls(route.dependant)


def _read_routes() -> list[Any]:
    from vla_rl.hub.routes import auth

    return [r for r in _app_routes() if auth.readable_repo in _deps(r)]


def _url(route: Any, repo: str, **values: str) -> str:
    org, name = repo.split("/")
    fill = {"org": org, "name": name, "repo_git": f"{name}.git", "rev": "main", "path": "config.json"}
    fill.update(values)
    return re.sub(r"\{(\w+)(?::path)?\}", lambda m: fill.get(m.group(1), "x"), route.path)


# ----- 1. private repos --------------------------------------------------------------------------------------
def test_every_read_route_goes_through_readable_repo() -> None:
    """A route that answers GET/HEAD and names a repo must get it from readable_repo (the private-repo rule
    lives there); a route naming a repo gets it from exactly one of the auth dependencies."""
    from vla_rl.hub.routes import auth

    repo_deps = {auth.readable_repo, auth.writable_repo, auth.writable_lfs_repo}
    for route in _app_routes():
        used = _deps(route) & repo_deps
        if "{org}" not in route.path or route.name == "xet_token":
            continue
        assert len(used) == 1, (route.path, used)
        if route.methods & {"GET", "HEAD"}:
            assert used == {auth.readable_repo}, route.path
    names = {r.name for r in _read_routes()}
    assert names == READ_ROUTES


def _read_all(hub: HubServer, repo: str, headers: dict[str, str]) -> dict[str, tuple[int, str | None, Any]]:
    """(status, X-Error-Code, body with the repo id blanked) of every read route for ``repo``."""
    out = {}
    for route in _read_routes():
        method = "POST" if "POST" in route.methods else "GET"
        body = b"paths=config.json" if method == "POST" else b""
        url = _url(route, repo, **({"path": "sub"} if route.name == "tree" else {}))
        status, h, raw = _raw(hub, method, url, body, headers)
        text = raw.decode("utf-8", "replace").replace(repo, "<repo>")
        out[route.name] = (status, h.get("x-error-code"), text)
    return out


def test_private_repo_reads_need_the_token_on_every_route(hub: HubServer, api: Any) -> None:
    repo = "org/hidden"
    api.create_repo(repo, private=True)
    api.upload_file(path_or_fileobj=b'{"a": 1}', path_in_repo="config.json", repo_id=repo, commit_message="c")
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="sub/x.json", repo_id=repo, commit_message="d")
    api.create_tag(repo, tag="v1")

    with_token = _read_all(hub, repo, _auth())
    assert all(s == 200 for s, _, _ in with_token.values()), [
        (k, v[:2]) for k, v in with_token.items() if v[0] != 200
    ]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        hidden = _read_all(hub, repo, headers)
        missing = _read_all(hub, "org/never-created", headers)
        # The same answer as for a repo that does not exist: nothing tells them apart.
        assert hidden == missing, headers
        assert all(status == 404 and code == "RepoNotFound" for status, code, _ in hidden.values()), hidden
        assert not any('"a": 1' in text or "config.json" in text for _, _, text in hidden.values())
    # Public repos stay public.
    api.create_repo("org/open")
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id="org/open", commit_message="c")
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="sub/x.json", repo_id="org/open", commit_message="d")
    assert all(s == 200 for s, _, _ in _read_all(hub, "org/open", {}).values())


def test_private_repo_with_the_real_client(hub: HubServer, api: Any, tmp_path: Path) -> None:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError

    repo = "org/private-client"
    api.create_repo(repo, private=True)
    weights = b"\x00" * 1000 + b"weights"  # binary: goes through LFS
    api.upload_file(
        path_or_fileobj=weights, path_in_repo="model.safetensors", repo_id=repo, commit_message="w"
    )
    info = api.model_info(repo)
    assert info.private and info.sha
    got = hf_hub_download(repo, "model.safetensors", cache_dir=tmp_path / "ok", endpoint=hub.url, token=TOKEN)
    assert Path(got).read_bytes() == weights

    for token in (False, "not-the-token"):
        client = HfApi(endpoint=hub.url, token=token)
        with pytest.raises(RepositoryNotFoundError):
            client.model_info(repo)
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download(
                repo, "model.safetensors", cache_dir=tmp_path / "no", endpoint=hub.url, token=token
            )
        assert not client.repo_exists(repo)
        with pytest.raises(RepositoryNotFoundError):
            client.list_repo_commits(repo)
    assert httpx.get(f"{hub.url}/{repo}/resolve/main/model.safetensors").status_code == 404


def test_private_repo_on_a_server_without_a_token(hub_client_env: None, tmp_path: Path) -> None:  # noqa: F811
    """No server token: no authentication at all, but a private repo is still not served to anonymous
    readers; any bearer token reads it (as any token passes whoami there)."""
    with HubServer(tmp_path / "data") as open_hub:
        status, _, _ = _raw(
            open_hub, "POST", "/api/repos/create", json.dumps({"name": "org/p", "private": True}).encode()
        )
        assert status == 200
        assert _raw(open_hub, "GET", "/api/models/org/p")[0] == 404
        assert _raw(open_hub, "GET", "/api/models/org/p", headers={"Authorization": "Bearer any"})[0] == 200


# ----- 2. request bodies -------------------------------------------------------------------------------------
SMALL = Limits(
    max_commit_bytes=1 * MB,
    max_inline_file_bytes=256 * 1024,
    max_json_bytes=64 * 1024,
    max_commit_operations=100,
)


@pytest.fixture(scope="module")
def small_hub(tmp_path_factory: pytest.TempPathFactory, hub: HubServer) -> Iterator[HubServer]:
    with HubServer(tmp_path_factory.mktemp("small") / "data", token=TOKEN, limits=SMALL) as server:
        status, _, _ = _raw(server, "POST", "/api/repos/create", b'{"name": "org/small"}', _auth())
        assert status == 200
        yield server


def _send_headers_only(hub: HubServer, path: str, length: int) -> tuple[int, dict[str, str]]:
    """Announce a ``length``-byte body and read the answer without sending it."""
    parts = urlsplit(hub.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.putrequest("POST", path)
        for k, v in {**_auth(), "Content-Length": str(length)}.items():
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def test_over_limit_bodies_get_413_naming_the_limit(small_hub: HubServer) -> None:
    repo = "org/small"
    commit_url = f"/api/models/{repo}/commit/main"
    # Announced too large: refused before a byte of the body is read.
    status, headers = _send_headers_only(small_hub, commit_url, 140 * MB)
    assert status == 413 and "max_commit_bytes" in headers["x-error-message"]
    assert "--max-commit-bytes" in headers["x-error-message"]
    status, headers = _send_headers_only(small_hub, f"/api/models/{repo}/preupload/main", 5 * MB)
    assert status == 413 and "max_json_bytes" in headers["x-error-message"]

    # Sent without a length (chunked): cut off at the limit.
    def chunks(n: int, size: int = 64 * 1024) -> Iterator[bytes]:
        yield json.dumps({"key": "header", "value": {"summary": "s"}}).encode() + b"\n"
        for i in range(n):
            yield (
                json.dumps({"key": "deletedFile", "value": {"path": f"f{i}.txt"}}).encode().ljust(size)
                + b"\n"
            )

    r = httpx.post(small_hub.url + commit_url, content=chunks(20), headers=_auth(), timeout=30)
    assert r.status_code == 413 and "max_commit_bytes" in r.headers["x-error-message"]
    # One line longer than an inline file can be, and a decoded inline file over its limit.
    big_line = _commit_body(_file_op("big.txt", b"a" * (SMALL.max_inline_file_bytes * 2)))
    r = httpx.post(small_hub.url + commit_url, content=big_line, headers=_auth(), timeout=30)
    assert r.status_code == 413 and "max_inline_file_bytes" in r.headers["x-error-message"]
    over = _commit_body(_file_op("over.txt", b"a" * (SMALL.max_inline_file_bytes + 3)))
    r = httpx.post(small_hub.url + commit_url, content=over, headers=_auth(), timeout=30)
    assert r.status_code == 413 and "max_inline_file_bytes" in r.headers["x-error-message"]
    r = httpx.post(
        f"{small_hub.url}/api/models/{repo}/paths-info/main",
        content=b"paths=" + b"a" * SMALL.max_json_bytes,
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        timeout=30,
    )
    assert r.status_code == 413 and "max_json_bytes" in r.headers["x-error-message"]
    many = _commit_body(*({"key": "deletedFile", "value": {"path": f"f{i}"}} for i in range(101)))
    r = httpx.post(small_hub.url + commit_url, content=many, headers=_auth(), timeout=30)
    assert r.status_code == 413 and "max_commit_operations" in r.headers["x-error-message"]
    # Within the limits all is well, and nothing was left staged by the refused ones.
    ok = _commit_body(_file_op("ok.txt", b"a" * SMALL.max_inline_file_bytes))
    r = httpx.post(small_hub.url + commit_url, content=ok, headers=_auth(), timeout=30)
    assert r.status_code == 200, r.text
    assert not list((Path(small_hub.data_dir) / "tmp").iterdir())


def test_the_client_round_trip_fits_lowered_limits(small_hub: HubServer, tmp_path: Path) -> None:
    """Preupload sends files over max_inline_file_bytes to LFS, so the real client's commits stay in bounds."""
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=small_hub.url, token=TOKEN)
    text = b"x" * (SMALL.max_inline_file_bytes + 1000)  # a text file that would be inline by default
    api.upload_file(path_or_fileobj=text, path_in_repo="notes.txt", repo_id="org/small", commit_message="t")
    entry = next(iter(api.get_paths_info("org/small", ["notes.txt"])))
    assert entry.lfs is not None and entry.size == len(text)
    got = hf_hub_download("org/small", "notes.txt", cache_dir=tmp_path, endpoint=small_hub.url, token=TOKEN)
    assert Path(got).read_bytes() == text


def _commit_while_polling(server: HubServer, body: Iterator[bytes]) -> tuple[int, list[float]]:
    """Send a commit and, while it is in flight, time health and model-info requests."""
    result: dict[str, Any] = {}
    done = threading.Event()

    def upload() -> None:
        try:
            url = f"{server.url}/api/models/org/big/commit/main"
            result["status"] = httpx.post(url, content=body, headers=_auth(), timeout=120).status_code
        finally:
            done.set()

    latencies: list[float] = []
    t = threading.Thread(target=upload)
    t.start()
    with httpx.Client(timeout=30) as client:
        while not done.is_set():
            for path in ("/api/health", "/api/models/org/other"):
                t0 = time.monotonic()
                assert client.get(server.url + path).status_code == 200
                latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    t.join(120)
    return result.get("status", 0), latencies


def _peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


@pytest.mark.timeout(180)
def test_large_commit_streams_in_bounded_memory_while_small_requests_stay_fast(
    hub_client_env: None,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A ~160 MB commit (allowed by the defaults: 40 inline files of 3 MiB) goes through in the server's
    own process while health and model-info requests keep being answered promptly, and the server's peak
    memory grows by a fraction of the body (it used to hold the body several times over: 140 MB -> 2.6 GB)."""
    # Defaults, except more operations per commit for the second phase (many small lines).
    limits = Limits(max_commit_operations=1_000_000)
    with HubServer(tmp_path / "data", token=TOKEN, subprocess=True, limits=limits) as server:
        for repo in ("org/big", "org/other"):
            assert (
                _raw(server, "POST", "/api/repos/create", json.dumps({"name": repo}).encode(), _auth())[0]
                == 200
            )
        assert _raw(server, "GET", "/api/models/org/other")[0] == 200
        assert server._proc is not None
        before = _peak_rss(server._proc.pid)

        n_files, content = 40, b"\x01\x02" * (3 * MB // 2)
        b64 = base64.b64encode(content)
        body_size = 0

        def body() -> Iterator[bytes]:
            nonlocal body_size
            head = json.dumps({"key": "header", "value": {"summary": "big"}}).encode() + b"\n"
            body_size += len(head)
            yield head
            for i in range(n_files):
                line = b'{"key":"file","value":{"path":"f%d.txt","encoding":"base64","content":"' % i
                for part in (line, b64, b'"}}\n'):
                    body_size += len(part)
                    yield part

        status, latencies = _commit_while_polling(server, body())
        assert status == 200
        peak_growth = _peak_rss(server._proc.pid) - before
        files = {s["rfilename"] for s in httpx.get(f"{server.url}/api/models/org/big").json()["siblings"]}
        assert {f"f{i}.txt" for i in range(n_files)} <= files

        # 300k small operations (they used to be parsed on the event loop: a 1.6 s stall for 21 MB). The
        # files do not exist, so the commit is refused, but only once every line was parsed.
        def small_lines() -> Iterator[bytes]:
            yield json.dumps({"key": "header", "value": {"summary": "many"}}).encode() + b"\n"
            for k in range(300):
                yield b"".join(
                    b'{"key":"deletedFile","value":{"path":"folder/file-%07d.txt"}}\n' % (k * 1000 + i)
                    for i in range(1000)
                )

        status, small_latencies = _commit_while_polling(server, small_lines())
        assert status == 404

    print(
        f"body {body_size / MB:.0f} MB, peak RSS +{peak_growth / MB:.0f} MB, {len(latencies)} small requests: "
        f"max {max(latencies) * 1000:.0f} ms, median {statistics.median(latencies) * 1000:.0f} ms; "
        f"small lines: max {max(small_latencies) * 1000:.0f} ms"
    )
    assert body_size > 150 * MB
    assert len(latencies) >= 10 and len(small_latencies) >= 10, "the upload ended before it was measured"
    assert max(small_latencies) < 1.0, max(small_latencies)
    assert max(latencies) < 1.5 and statistics.median(latencies) < 0.25, (
        max(latencies),
        statistics.median(latencies),
    )
    assert peak_growth < body_size / 3, (
        f"peak RSS grew {peak_growth / MB:.0f} MB for a {body_size / MB:.0f} MB body"
    )


# ----- 3. bad input answers 4xx --------------------------------------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_BODIES = [
    b"{not json",
    b"\xff\xfe garbage",
    DEEP,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'"just a string"',
    b"[]",
    b"null",
    b"12345678901234567890123456789",
    json.dumps(
        {"unknown": 1, "files": "nope", "objects": {}, "paths": 3, "tag": ["x"], "name": {"a": 1}}
    ).encode(),
    json.dumps({"files": [{"path": "a.txt", "size": 1, "sample": 5}], "oid": "z", "size": "big"}).encode(),
    json.dumps(
        {"files": [{"path": 1, "size": True}], "objects": [1, None, {"oid": 5}], "operation": "upload"}
    ).encode(),
    json.dumps({"key": "header", "value": {"summary": "s"}}).encode() + b"\n" + DEEP + b"\n",
    json.dumps({"key": "header", "value": {"summary": "s"}}).encode()
    + b"\n"
    + json.dumps({"key": "file", "value": {"path": "a.txt", "content": 5}}).encode(),
    json.dumps({"key": "header", "value": {"summary": "s", "parentCommit": 7}}).encode(),
    json.dumps({"key": "header", "value": {"summary": "s"}}).encode()
    + b"\n"
    + json.dumps({"key": "lfsFile", "value": {"path": "a.bin", "oid": "nothex", "size": -1}}).encode(),
]


def test_bad_bodies_on_every_route_answer_4xx_with_a_json_error(hub: HubServer, api: Any) -> None:
    repo = "org/fuzz"
    api.create_repo(repo)
    head = api.model_info(repo).sha
    checked = 0
    for route in _app_routes():
        for method in sorted(route.methods - {"HEAD"}):
            for body in BAD_BODIES:
                for ctype in (
                    "application/json",
                    "application/x-ndjson",
                    "application/x-www-form-urlencoded",
                ):
                    url = _url(route, repo, tag="v1", branch="dev", oid="0" * 64)
                    status, headers, raw = _raw(hub, method, url, body, {**_auth(), "Content-Type": ctype})
                    assert status < 500 or status == 501, (method, url, body[:60], status, raw[:200])
                    if status >= 400:
                        assert "error" in json.loads(raw) and headers.get("x-error-message"), (method, url)
                    checked += 1
    assert checked > 500
    assert api.model_info(repo).sha == head


def test_bad_query_values_answer_4xx(hub: HubServer, api: Any) -> None:
    repo = "org/queries"
    api.create_repo(repo)
    bad_pages = ["-1", "²", "1e9", "9" * 5000, "99999999999999999999", " 1", "0x10", "1\n"]
    for p in bad_pages:
        for path in (f"/api/models/{repo}/commits/main", f"/api/models/{repo}/tree/main"):
            status, _, raw = _raw(hub, "GET", f"{path}?p={quote(p)}")
            assert status == 400 and "error" in json.loads(raw), (path, p)
    # A page far past the end is empty, not an error; so is a huge but valid one.
    for p in ("1000", "1000000000"):
        status, _, raw = _raw(hub, "GET", f"/api/models/{repo}/commits/main?p={p}")
        assert status == 200 and json.loads(raw) == []
    for cursor in ("nothex", "0" * 40, "A" * 40):
        status, _, _ = _raw(hub, "GET", f"/api/models/{repo}/commits/main?cursor={cursor}")
        assert status in (400, 404), cursor
    oid = "0" * 64
    for q in (
        "size=²&expires=1&sig=x",
        f"size=1&expires={'9' * 5000}&sig=x",
        "size=1&expires=9999999999&sig=é",
    ):
        status, _, _ = _raw(hub, "PUT", f"/api/lfs/objects/{oid}?{quote(q, safe='=&')}", b"x")
        assert status in (400, 403), q
    status, _, _ = _raw(
        hub, "POST", f"/api/models/{repo}/commit/main", b"", {**_auth(), "Content-Length": "²"}
    )
    assert 400 <= status < 500


def test_missing_or_mistyped_fields_are_400_and_change_nothing(hub: HubServer, api: Any) -> None:
    repo = "org/fields"
    api.create_repo(repo)
    head = api.model_info(repo).sha
    bodies = [
        ("POST", "/api/repos/create", {"organization": "org"}),  # no name: used to create 'org/None'
        ("POST", "/api/repos/create", {"name": 5, "organization": "org"}),
        ("POST", "/api/repos/create", {"name": "x", "organization": ["org"]}),
        ("DELETE", "/api/repos/delete", {"name": "fields"}),
        ("POST", f"/api/models/{repo}/tag/main", {"tag": None}),
        ("POST", f"/api/models/{repo}/branch/dev", {"startingPoint": 3}),
        (
            "POST",
            f"/api/models/{repo}/preupload/main",
            {"files": [{"path": "a.txt", "size": True, "sample": ""}]},
        ),
        ("POST", f"/{repo}.git/info/lfs/objects/verify", {"oid": "0" * 64}),
    ]
    for method, url, body in bodies:
        status, _, raw = _raw(hub, method, url, json.dumps(body).encode(), _auth())
        assert status == 400 and "error" in json.loads(raw), (method, url, body, status)
    huge = _commit_body(summary="s" * (128 * 1024))
    assert _raw(hub, "POST", f"/api/models/{repo}/commit/main", huge, _auth())[0] == 400
    assert api.model_info(repo).sha == head
    assert not (Path(hub.data_dir) / "repos" / "org" / "None").exists()
    assert [b.name for b in api.list_repo_refs(repo).branches] == ["main"]


def _enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_answers_507_and_leaves_nothing_half_created(
    hub: HubServer, api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    from vla_rl.hub import storage

    data = Path(hub.data_dir)
    before = sorted(p.relative_to(data) for p in (data / "repos").rglob("*"))

    # Create: the disk fills up when refs.json (the last write) is written.
    real_write = storage.atomic_write

    def fail_on_refs(path: Path, *a: Any, **k: Any) -> None:
        if path.name == "refs.json":
            _enospc()
        real_write(path, *a, **k)

    monkeypatch.setattr(storage, "atomic_write", fail_on_refs)
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo("full-disk-ns/repo")
    assert exc.value.response.status_code == 507
    assert "disk is full" in exc.value.response.headers["x-error-message"]
    assert not (data / "repos" / "full-disk-ns").exists()  # no empty repo nor namespace folder
    assert sorted(p.relative_to(data) for p in (data / "repos").rglob("*")) == before
    monkeypatch.setattr(storage, "atomic_write", real_write)
    api.create_repo("full-disk-ns/repo")  # and the name is free once there is space again

    # Commit: fails while writing the ref; the branch keeps its head and no commit file is left over.
    repo = "full-disk-ns/repo"
    head = api.model_info(repo).sha
    commits_dir = data / "repos" / "full-disk-ns" / "repo" / "commits"
    n_commits = len(list(commits_dir.iterdir()))
    monkeypatch.setattr(storage, "atomic_write", fail_on_refs)
    with pytest.raises(HfHubHTTPError) as exc:
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo, commit_message="x")
    assert exc.value.response.status_code == 507
    monkeypatch.setattr(storage, "atomic_write", real_write)
    assert api.model_info(repo).sha == head and len(list(commits_dir.iterdir())) == n_commits

    # Staging an inline file, and streaming an LFS upload, both fail cleanly too.
    monkeypatch.setattr(storage.BlobWriter, "write", _enospc)
    status, headers, _ = _raw(
        hub, "POST", f"/api/models/{repo}/commit/main", _commit_body(_file_op("y.txt", b"y")), _auth()
    )
    assert status == 507 and "disk is full" in headers["x-error-message"]
    with pytest.raises(RuntimeError, match="uploading") as lfs_exc:  # the client wraps LFS upload errors
        api.upload_file(
            path_or_fileobj=b"\x00" * 2048, path_in_repo="w.safetensors", repo_id=repo, commit_message="w"
        )
    cause = lfs_exc.value.__cause__
    assert isinstance(cause, HfHubHTTPError) and cause.response.status_code == 507
    monkeypatch.undo()
    assert api.model_info(repo).sha == head
    assert not list((data / "tmp").iterdir())


def test_deep_history_pages_are_correct_and_cost_one_page(
    hub: HubServer, api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vla_rl.hub.routes import commits as commits_routes
    from vla_rl.hub.routes import tree as tree_routes

    repo = "org/deep"
    api.create_repo(repo)
    side = HubStorage(hub.data_dir)  # a second handle on the same folder (flock-safe), to commit fast
    from vla_rl.hub.storage import AddFile, FileEntry, git_blob_sha1

    made = []
    for i in range(80):
        data = f"commit {i}".encode()
        entry = FileEntry(side.put_bytes(data), len(data), False, git_blob_sha1(data))
        made.append(side.apply_commit(repo, "main", [AddFile(f"d/f{i % 9}.txt", entry)], summary=f"c{i}").id)
    expected = [*reversed(made), api.list_repo_commits(repo)[-1].commit_id]

    page = 7
    monkeypatch.setattr(commits_routes, "COMMITS_PAGE", page)
    monkeypatch.setattr(tree_routes, "TREE_PAGE_EXPANDED", 2)
    reads: list[str] = []
    real_commit = HubStorage.commit

    def counting(self: HubStorage, repo_id: str, sha: str) -> Any:
        reads.append(sha)
        return real_commit(self, repo_id, sha)

    monkeypatch.setattr(HubStorage, "commit", counting)
    assert [c.commit_id for c in api.list_repo_commits(repo)] == expected  # follows the Link cursors
    pages = -(-len(expected) // page)
    assert len(reads) <= pages * (page + 1), len(reads)  # each page read once, not the history per page

    # The Link of a deep page carries its cursor; a bare p (no cursor) still gives the right slice.
    url, want = f"/api/models/{repo}/commits/main", expected[5 * page : 6 * page]
    status, headers, raw = _raw(hub, "GET", f"{url}?p=5")
    assert status == 200 and [c["id"] for c in json.loads(raw)] == want
    assert f"cursor={expected[6 * page]}" in headers["link"] and "p=6" in headers["link"]
    reads.clear()
    status, _, raw = _raw(hub, "GET", f"{url}?p=6&cursor={expected[6 * page]}")
    assert [c["id"] for c in json.loads(raw)] == expected[6 * page : 7 * page] and len(reads) <= page + 1

    # Expanded tree pages describe only their own entries (each one is a history walk).
    entries = [e.path for e in api.list_repo_tree(repo, path_in_repo="d", expand=True)]
    assert entries == sorted(f"d/f{i}.txt" for i in range(9))


# ----- 4. ids match in full ----------------------------------------------------------------------------------
def test_ids_are_matched_in_full() -> None:
    sha = "0123456789abcdef0123456789abcdef01234567"
    for tail in ("\n", "\r\n", " ", "\x00"):
        with pytest.raises(ValueError):
            naming.validate_repo_id("org/name" + tail)
        with pytest.raises(ValueError):
            naming.validate_repo_id("org" + tail + "/name")
        with pytest.raises(ValueError):
            naming.validate_ref_name("main" + tail)
        with pytest.raises(ValueError):
            naming.validate_client_revision("main" + tail)
        if tail != " ":  # file names may end in a space, as on the Hub
            with pytest.raises(ValueError):
                naming.validate_repo_path("a.txt" + tail)
        assert naming.COMMIT_SHA.fullmatch(sha + tail) is None
        assert naming.SHA256_HEX.fullmatch(sha + sha[:24] + tail) is None


def test_hub_code_matches_patterns_with_fullmatch_only() -> None:
    """``re.match`` with a ``$`` anchor accepts a trailing newline; ids are checked with ``fullmatch``
    everywhere in the hub code, and no pattern carries a ``$`` anchor."""
    offenders = []
    for path in sorted(HUB_SRC.rglob("*.py")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(?<!full)match\(|\$\"|\$'", line):
                offenders.append(f"{path.relative_to(HUB_SRC)}:{no}: {line.strip()}")
    assert not offenders, offenders


def test_trailing_newlines_in_urls_and_bodies_are_refused(hub: HubServer, api: Any) -> None:
    repo = "org/newline"
    api.create_repo(repo)
    api.upload_file(path_or_fileobj=b"1", path_in_repo="a.txt", repo_id=repo, commit_message="a")
    api.create_tag(repo, tag="v1")
    head = api.model_info(repo).sha
    for nl in ("%0a", "%0A", "%0d%0a"):
        reads = [
            f"/api/models/org/newline{nl}",
            f"/api/models/org{nl}/newline",
            f"/api/models/{repo}/revision/main{nl}",
            f"/api/models/{repo}/revision/{head}{nl}",
            f"/api/models/{repo}/tree/v1{nl}",
            f"/api/models/{repo}/commits/main{nl}",
            f"/{repo}/resolve/main{nl}/a.txt",
            f"/{repo}/resolve/main/a.txt{nl}",
            f"/{repo}/resolve/{head}{nl}/a.txt",
        ]
        for url in reads:
            status, _, _ = _raw(hub, "GET", url)
            assert status in (400, 404), url
        writes = [
            ("POST", f"/api/models/{repo}/branch/dev{nl}", b"{}"),
            ("POST", f"/api/models/{repo}/branch/dev2", json.dumps({"startingPoint": "main\n"}).encode()),
            ("POST", f"/api/models/{repo}/tag/main", json.dumps({"tag": "v2\n"}).encode()),
            ("DELETE", f"/api/models/{repo}/tag/v1{nl}", b""),
            ("POST", f"/api/models/{repo}/commit/main{nl}", _commit_body(_file_op("b.txt", b"b"))),
            ("POST", f"/api/models/{repo}/commit/main", _commit_body(_file_op("b.txt\n", b"b"))),
            ("POST", "/api/repos/create", json.dumps({"name": "org/fresh\n"}).encode()),
            ("POST", "/api/repos/create", json.dumps({"name": "fresh", "organization": "org\n"}).encode()),
        ]
        for method, url, body in writes:
            status, _, _ = _raw(hub, method, url, body, _auth())
            assert status in (400, 404), (method, url, body)
    assert api.model_info(repo).sha == head
    refs = api.list_repo_refs(repo)
    assert [b.name for b in refs.branches] == ["main"] and [t.name for t in refs.tags] == ["v1"]
    assert not [p for p in Path(hub.data_dir).rglob("*") if "\n" in p.name or "\r" in p.name]


# ----- 5. hub serve: token file and limits -------------------------------------------------------------------
def test_hub_serve_token_file_and_limit_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`vla-rl hub serve` is HubConfig: the limits are Limits' own fields (flags of the same names, defaults
    not restated), the token comes from --token-file, and the config reaches serve() whole."""
    import tyro

    from vla_rl.cli import main, services
    from vla_rl.cli.common import CliError
    from vla_rl.hub import server
    from vla_rl.hub.config import HubConfig

    assert HubConfig(token=None).limits == Limits()
    calls: list[HubConfig] = []
    monkeypatch.setattr(server, "serve", lambda config, **kw: calls.append(config))
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    flags = ["--token-file", str(token_file), "--max-commit-bytes", "12345", "--max-json-bytes", "999"]
    args = tyro.cli(
        HubConfig, args=[*flags, "--port", "0"]
    )  # never the default port (a registry may be there)
    assert services.hub_serve(args) == 0
    assert calls[-1].resolved_token() == "from-the-file" and calls[-1].port == 0
    assert calls[-1].limits == Limits(max_commit_bytes=12345, max_json_bytes=999)
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        if bad.name == "empty":
            bad.write_text("  \n")
        with pytest.raises(CliError, match="--token-file"):
            services.hub_serve(HubConfig(token=None, token_file=bad, port=0))
    assert main(["hub", "serve", "--max-inline-file-bytes", str(11 * MB), "--port", "0"]) == 2
    assert "max_inline_file_bytes must be <= 10485760" in capsys.readouterr().err.replace("\n", " ").replace(
        "│", ""
    )
    assert "ps" in (HubConfig.__doc__ or "")
