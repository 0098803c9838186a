"""Local Hub server and checkpoint registry, exercised with the real ``huggingface_hub`` client.

The server runs on loopback (a thread of this process, plus a subprocess where two processes must share one
data folder); every check goes through the same client calls a training round or a policy server makes, so a
payload or header the client does not accept fails here. Raw HTTP (``http.client``, which does not normalise
``..`` away) is used only for what the client refuses to send: traversal attempts and forged requests.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from vla_rl.hub.registry import (
    HubRef,
    configure_hub,
    is_hub_ref,
    move_ref,
    parse_ref,
    pull,
    push_folder,
    resolve,
)
from vla_rl.hub.server import HubServer

TOKEN = "hub-test-token-0123456789"
MB = 1024 * 1024


@pytest.fixture(scope="module")
def hub_client_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the client off the user's HF cache and token, and restore its global settings afterwards."""
    keys = ("HF_ENDPOINT", "HF_HUB_DISABLE_XET", "HF_TOKEN", "HF_HOME", "HF_HUB_DISABLE_TELEMETRY")
    saved_env = {k: os.environ.get(k) for k in keys}
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home"))
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    os.environ.pop("HF_TOKEN", None)
    from huggingface_hub import constants

    saved = {
        k: getattr(constants, k) for k in ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_DISABLE_XET")
    }
    yield
    for k, v in saved.items():
        setattr(constants, k, v)
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, hub_client_env: None) -> Iterator[HubServer]:
    root = tmp_path_factory.mktemp("hub_root")
    with HubServer(root / "data", token=TOKEN) as server:
        settings = configure_hub(server.url)
        assert settings.xet_disabled and settings.endpoint == server.url
        assert os.environ["HF_ENDPOINT"] == server.url and os.environ["HF_HUB_DISABLE_XET"] == "1"
        yield server


@pytest.fixture
def api(hub: HubServer) -> Any:
    from huggingface_hub import HfApi

    return HfApi(endpoint=hub.url, token=TOKEN)


def _write_checkpoint(folder: Path, weights: bytes, config: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# test checkpoint\n")
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "stats").mkdir(exist_ok=True)
    (folder / "stats" / "norm.json").write_text('{"mean": [0.0]}')


def _raw(hub: HubServer, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
    """One request with the path sent byte for byte (no client-side '..' normalisation)."""
    parts = urlsplit(hub.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


# ----- the client round trip -------------------------------------------------------------------------------
def test_client_round_trip(hub: HubServer, api: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import hf_hub_download, snapshot_download

    from vla_rl.hub.routes import commits, tree

    # Tiny pages, so the client has to follow the Link headers for commits and trees.
    monkeypatch.setattr(commits, "COMMITS_PAGE", 2)
    monkeypatch.setattr(tree, "TREE_PAGE", 2)

    repo = "org/round-trip"
    api.create_repo(repo)
    api.create_repo(repo, exist_ok=True)  # 409 swallowed by the client

    weights1 = os.urandom(11 * MB)  # > 10 MB and binary: must take the LFS path
    ckpt = tmp_path / "ckpt"
    _write_checkpoint(ckpt, weights1, {"round": 1})
    c1 = api.upload_folder(repo_id=repo, folder_path=ckpt, commit_message="round 1").oid
    api.create_tag(repo, tag="v1", revision=c1)

    weights2 = os.urandom(11 * MB)
    (ckpt / "model.safetensors").write_bytes(weights2)
    (ckpt / "config.json").write_text(json.dumps({"round": 2}))
    c2 = api.upload_folder(repo_id=repo, folder_path=ckpt, commit_message="round 2").oid
    assert c1 != c2
    # Nothing changed: the client skips the commit (it compares our preupload oids with its own).
    assert api.upload_folder(repo_id=repo, folder_path=ckpt, commit_message="no-op").oid == c2

    v1 = Path(snapshot_download(repo, revision="v1", cache_dir=tmp_path / "cache", endpoint=hub.url))
    assert (v1 / "model.safetensors").read_bytes() == weights1
    assert json.loads((v1 / "config.json").read_text()) == {"round": 1}
    assert (v1 / "stats" / "norm.json").read_text() == '{"mean": [0.0]}'
    assert v1.name == c1
    main = Path(snapshot_download(repo, cache_dir=tmp_path / "cache", endpoint=hub.url))
    assert (main / "model.safetensors").read_bytes() == weights2
    assert main.name == c2

    refs = api.list_repo_refs(repo)
    assert {(r.name, r.ref, r.target_commit) for r in refs.branches} == {("main", "refs/heads/main", c2)}
    assert {(r.name, r.target_commit) for r in refs.tags} == {("v1", c1)}

    commits = api.list_repo_commits(repo)
    assert [c.commit_id for c in commits[:2]] == [c2, c1]
    assert [c.title for c in commits] == ["round 2", "round 1", "initial commit"]
    assert api.list_repo_commits(repo, revision="v1")[0].commit_id == c1

    one = hf_hub_download(repo, "config.json", revision="v1", cache_dir=tmp_path / "c2", endpoint=hub.url)
    assert json.loads(Path(one).read_text()) == {"round": 1}
    # configure_hub ran after huggingface_hub was imported: its patch alone must route calls here.
    from huggingface_hub import HfApi

    assert HfApi(token=TOKEN).model_info(repo).sha == c2
    two = hf_hub_download(repo, "config.json", cache_dir=tmp_path / "c3", token=False)
    assert json.loads(Path(two).read_text()) == {"round": 2}

    top = {e.path: e for e in api.list_repo_tree(repo)}
    assert set(top) == {".gitattributes", "README.md", "config.json", "model.safetensors", "stats"}
    assert type(top["stats"]).__name__ == "RepoFolder"
    weights_entry = top["model.safetensors"]
    assert weights_entry.lfs is not None and weights_entry.lfs.sha256 == hashlib.sha256(weights2).hexdigest()
    assert weights_entry.size == len(weights2)
    assert top["README.md"].lfs is None and top["config.json"].lfs is None
    deep = [e.path for e in api.list_repo_tree(repo, recursive=True)]
    assert "stats/norm.json" in deep and "stats" in deep
    assert [e.path for e in api.list_repo_tree(repo, path_in_repo="stats")] == ["stats/norm.json"]
    expanded = list(api.list_repo_tree(repo, revision="v1", expand=True))
    assert all(e.last_commit is not None for e in expanded)

    info = api.model_info(repo, files_metadata=True)
    assert info.sha == c2 and {s.rfilename for s in info.siblings} >= {"config.json", "model.safetensors"}
    paths = api.get_paths_info(repo, ["config.json", "stats", "missing.txt"], revision="v1")
    assert [p.path for p in paths] == ["config.json", "stats"]
    assert api.file_exists(repo, "config.json") and not api.file_exists(repo, "nope.json")
    assert api.revision_exists(repo, "v1") and not api.revision_exists(repo, "v9")

    # The headers the download path relies on, and ranges (used to resume downloads).
    url = f"{hub.url}/{repo}/resolve/v1/model.safetensors"
    head = httpx.head(url)
    assert head.status_code == 200
    assert head.headers["x-repo-commit"] == c1
    assert head.headers["x-linked-etag"].strip('"') == hashlib.sha256(weights1).hexdigest()
    assert int(head.headers["x-linked-size"]) == len(weights1) == int(head.headers["content-length"])
    part = httpx.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == weights1[100:200]
    tail = httpx.get(url, headers={"Range": f"bytes={len(weights1) - 10}-"})
    assert tail.content == weights1[-10:]


def test_client_errors_map_to_hub_exceptions(hub: HubServer, api: Any, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo = "org/errors"
    api.create_repo(repo)
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo(repo)
    assert exc.value.response.status_code == 409
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/does-not-exist")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(repo, revision="no-such-branch")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(repo, "missing.bin", cache_dir=tmp_path, endpoint=hub.url)
    api.create_tag(repo, tag="t1")
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_tag(repo, tag="t1")
    assert exc.value.response.status_code == 409
    api.create_tag(repo, tag="t1", exist_ok=True)
    with pytest.raises(HfHubHTTPError) as exc:
        api.delete_branch(repo, branch="main")
    assert exc.value.response.status_code == 403
    api.create_branch(repo, branch="dev")
    api.upload_file(
        path_or_fileobj=b"dev only", path_in_repo="dev.txt", repo_id=repo, revision="dev", commit_message="d"
    )
    assert not api.file_exists(repo, "dev.txt") and api.file_exists(repo, "dev.txt", revision="dev")
    with pytest.raises(HfHubHTTPError) as exc:  # commits go to branches only
        api.upload_file(
            path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo, revision="t1", commit_message="x"
        )
    assert exc.value.response.status_code == 400
    api.delete_branch(repo, branch="dev")
    api.delete_tag(repo, tag="t1")
    assert api.list_repo_refs(repo).tags == []
    api.upload_file(path_or_fileobj=b"a", path_in_repo="sub/deep/a.txt", repo_id=repo, commit_message="a")
    api.delete_folder("sub/", repo_id=repo, commit_message="rm folder")
    with pytest.raises(EntryNotFoundError):
        api.delete_file("sub/deep/a.txt", repo_id=repo, commit_message="rm again")
    api.delete_file(".gitattributes", repo_id=repo, commit_message="rm")
    assert api.list_repo_files(repo) == []
    status, headers, _ = _raw(hub, "POST", f"/api/models/{repo}/xet-write-token/main", headers=_auth())
    assert status == 501 and "HF_HUB_DISABLE_XET" in headers["x-error-message"]


# ----- the registry ----------------------------------------------------------------------------------------
def test_a_promoted_tag_is_never_missing_for_a_follower(hub: HubServer, tmp_path: Path, api: Any) -> None:
    """On our registry a tag moves in one write (``"move": true`` on the tag route, our extension): a follower
    polling the refs while ``prod`` flips between two commits always finds it (a delete + create left a
    moment without it); a plain tag request on an existing tag is still refused (409), as the Hub does."""
    repo, kw = "robots/flip", {"endpoint": hub.url, "token": TOKEN}
    commits = []
    for k in range(2):
        _write_checkpoint(tmp_path / f"f{k}", os.urandom(1024), {"round": k})
        commits.append(push_folder(tmp_path / f"f{k}", repo, message=f"f{k}", **kw))
    move_ref(repo, "prod", commits[0], **kw)
    seen, done = [], threading.Event()

    def follower() -> None:
        while not done.is_set():
            seen.append({t.name: t.target_commit for t in api.list_repo_refs(repo).tags}.get("prod"))

    t = threading.Thread(target=follower)
    t.start()
    try:
        for i in range(20):
            assert move_ref(repo, "prod", commits[(i + 1) % 2], **kw) == commits[(i + 1) % 2]
    finally:
        done.set()
        t.join(30)
    assert len(seen) > 5 and None not in seen and set(seen) <= set(commits)
    status, _, _ = _raw(
        hub, "POST", f"/api/models/{repo}/tag/{commits[0]}", body=b'{"tag": "prod"}', headers=_auth()
    )
    assert status == 409
    status, _, _ = _raw(
        hub,
        "POST",
        f"/api/models/{repo}/tag/{commits[0]}",
        body=b'{"tag": "prod", "move": "yes"}',
        headers=_auth(),
    )
    assert status == 400


def test_concurrent_promotions_of_one_ref_all_succeed(hub: HubServer, tmp_path: Path) -> None:
    """Two round workers promoting at once: a move is delete + create, so one's delete or create meets the
    other's (404 / 409). Each mover looks again and moves again: no promotion fails, the ref ends at one
    of the commits."""
    repo, kw = "robots/race", {"endpoint": hub.url, "token": TOKEN}
    commits = []
    for k in range(2):
        _write_checkpoint(tmp_path / f"c{k}", os.urandom(1024), {"round": k})
        commits.append(push_folder(tmp_path / f"c{k}", repo, message=f"c{k}", **kw))
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def promoter(k: int) -> None:
        barrier.wait()
        for i in range(8):
            try:
                move_ref(repo, "prod", commits[(k + i) % 2], **kw)
            except BaseException as e:
                errors.append(e)

    threads = [threading.Thread(target=promoter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert resolve(f"hub://{repo}@prod", **kw) in commits


def test_registry_push_pull_promote(hub: HubServer, tmp_path: Path) -> None:
    repo = "robots/pick-cube"
    kw = {"endpoint": hub.url, "token": TOKEN}
    ckpt = tmp_path / "round"
    w1 = os.urandom(2 * MB)
    _write_checkpoint(ckpt, w1, {"round": 1})
    (ckpt / "old_only.txt").write_text("gone next round")
    c1 = push_folder(ckpt, repo, message="round 1", tag="round-1", **kw)
    w2 = os.urandom(2 * MB)
    (ckpt / "model.safetensors").write_bytes(w2)
    (ckpt / "old_only.txt").unlink()
    c2 = push_folder(ckpt, repo, message="round 2", tag="round-2", **kw)

    assert resolve("hub://robots/pick-cube", **kw) == c2
    assert resolve("hub://robots/pick-cube@round-1", **kw) == c1
    assert resolve(f"hub://robots/pick-cube@{c1}", **kw) == c1

    got = pull("hub://robots/pick-cube@round-1", cache_dir=tmp_path / "cache", **kw)
    assert got.commit == c1 and got.repo_id == repo and got.revision == "round-1"
    assert (got.path / "model.safetensors").read_bytes() == w1 and (got.path / "old_only.txt").exists()
    latest = pull("hub://robots/pick-cube@main", cache_dir=tmp_path / "cache", **kw)
    assert (latest.path / "model.safetensors").read_bytes() == w2
    assert not (latest.path / "old_only.txt").exists()  # mirror: the branch holds exactly the folder

    # Promotion: 'prod' (a tag) follows round 1, then round 2; re-pointing to the same commit is a no-op.
    assert move_ref(repo, "prod", "round-1", **kw) == c1
    assert resolve("hub://robots/pick-cube@prod", **kw) == c1
    assert move_ref(repo, "prod", "round-2", **kw) == c2
    assert move_ref(repo, "prod", c2, **kw) == c2
    assert pull("hub://robots/pick-cube@prod", cache_dir=tmp_path / "cache", **kw).commit == c2
    # A branch can be the followed ref too; main cannot be moved.
    assert move_ref(repo, "canary", c1, kind="branch", **kw) == c1
    assert move_ref(repo, "canary", c2, **kw) == c2
    with pytest.raises(ValueError, match="main"):
        move_ref(repo, "main", c1, **kw)
    with pytest.raises(ValueError, match="already a branch"):
        move_ref(repo, "canary", c1, kind="tag", **kw)

    # Re-pushing with an existing tag moves the tag; pushing to another branch creates it.
    (ckpt / "config.json").write_text(json.dumps({"round": 3}))
    c3 = push_folder(ckpt, repo, message="round 3 fixup", tag="round-2", **kw)
    assert resolve("hub://robots/pick-cube@round-2", **kw) == c3
    c4 = push_folder(ckpt, repo, message="experiment", branch="exp", **kw)
    assert resolve("hub://robots/pick-cube@exp", **kw) == c4 == c3  # same files: no new commit

    # A fresh process configured before huggingface_hub is imported (how a policy server starts) follows 'prod'.
    script = (
        "import sys; from vla_rl.hub.registry import configure_hub; configure_hub(sys.argv[1]); "
        "from vla_rl.hub.registry import pull; ck = pull('hub://robots/pick-cube@prod', cache_dir=sys.argv[2]); "
        "print(ck.commit, ck.path)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(tmp_path / "child_hf_home")
    out = subprocess.run(
        [sys.executable, "-c", script, hub.url, str(tmp_path / "child_cache")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    assert out[0] == c2 and (Path(out[1]) / "model.safetensors").read_bytes() == w2

    # Local folders are references too; their "commit" changes when a file changes.
    local = pull(ckpt)
    assert local.path == ckpt.resolve() and local.commit.startswith("local:")
    assert resolve(str(ckpt)) == local.commit
    (ckpt / "config.json").write_text(json.dumps({"round": 4}))
    assert resolve(str(ckpt)) != local.commit
    with pytest.raises(ValueError, match="hub://org/name"):
        pull(tmp_path / "does-not-exist")


def test_parse_ref() -> None:
    assert parse_ref("hub://org/name") == HubRef("org/name", "main")
    assert parse_ref("hub://org/name@v1") == HubRef("org/name", "v1")
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert parse_ref(f"hub://my-org/model.v2@{sha}") == HubRef("my-org/model.v2", sha)
    assert parse_ref("hub://org/name@refs/pr/1").revision == "refs/pr/1"  # valid on the real Hub
    assert str(parse_ref("hub://org/name@prod")) == "hub://org/name@prod"
    assert parse_ref(HubRef("a/b")) == HubRef("a/b", "main")
    assert is_hub_ref("hub://a/b") and not is_hub_ref("./ckpt") and not is_hub_ref(Path("hub:/a"))
    bad = [
        "org/name",
        "./ckpt",
        "",
        "hf://org/name",
        "hub://name",
        "hub://org/name/extra",
        "hub://org/name@",
        "hub://org/name@a@b",
        "hub://../name",
        "hub://org/..",
        "hub://org/na me",
        "hub://org/-name",
        "hub://org/na--me",
        "hub://org/name@../main",
        "hub://org/name@/main",
        "hub://org/name@with space",
        "hub:///name",
    ]
    for ref in bad:
        with pytest.raises(ValueError, match=r"expected hub://org/name\[@rev\]"):
            parse_ref(ref)


# ----- auth ------------------------------------------------------------------------------------------------
def test_writes_need_the_token_reads_do_not(hub: HubServer, api: Any, tmp_path: Path) -> None:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    repo = "org/auth"
    api.create_repo(repo)
    api.upload_file(path_or_fileobj=b'{"a": 1}', path_in_repo="config.json", repo_id=repo, commit_message="c")
    head = api.model_info(repo).sha

    anonymous = HfApi(endpoint=hub.url, token=False)
    wrong = HfApi(endpoint=hub.url, token="not-the-token")
    for client in (anonymous, wrong):
        with pytest.raises(HfHubHTTPError) as exc:
            client.create_repo("org/auth-new")
        assert exc.value.response.status_code == 401
        with pytest.raises(HfHubHTTPError) as exc:
            client.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo, commit_message="x")
        assert exc.value.response.status_code == 401
        with pytest.raises(HfHubHTTPError) as exc:
            client.create_tag(repo, tag="sneaky")
        assert exc.value.response.status_code == 401
        with pytest.raises(HfHubHTTPError) as exc:
            client.delete_file("config.json", repo_id=repo, commit_message="rm")
        assert exc.value.response.status_code == 401
        # Reads stay public.
        assert client.model_info(repo).sha == head
        assert [f for f in client.list_repo_files(repo)] == [".gitattributes", "config.json"]
    path = hf_hub_download(repo, "config.json", cache_dir=tmp_path, endpoint=hub.url, token=False)
    assert json.loads(Path(path).read_text()) == {"a": 1}
    assert not anonymous.repo_exists("org/auth-new")
    assert api.model_info(repo).sha == head  # nothing landed

    assert api.whoami()["name"] == "local"
    with pytest.raises(HfHubHTTPError):
        wrong.whoami()

    # Every write route, raw: 401 with a JSON error, whatever the body.
    writes = [
        ("POST", "/api/repos/create"),
        ("DELETE", "/api/repos/delete"),
        ("POST", f"/api/models/{repo}/preupload/main"),
        ("POST", f"/{repo}.git/info/lfs/objects/batch"),
        ("POST", f"/{repo}.git/info/lfs/objects/verify"),
        ("POST", f"/api/models/{repo}/commit/main"),
        ("POST", f"/api/models/{repo}/tag/main"),
        ("DELETE", f"/api/models/{repo}/tag/v1"),
        ("POST", f"/api/models/{repo}/branch/dev"),
        ("DELETE", f"/api/models/{repo}/branch/dev"),
    ]
    for method, route in writes:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"}):
            status, _, body = _raw(hub, method, route, b"{}", headers)
            assert status == 401, (method, route, headers)
            assert "error" in json.loads(body)

    # LFS upload URLs are pre-signed (the client sends no token there): a forged signature is refused.
    oid = hashlib.sha256(b"forged").hexdigest()
    status, _, _ = _raw(
        hub, "PUT", f"/api/lfs/objects/{oid}?size=6&expires=9999999999&sig={'0' * 64}", b"forged"
    )
    assert status == 403
    assert not any(p.name == oid for p in Path(hub.data_dir).rglob("*"))


def test_private_server_needs_the_token_to_read(hub_client_env: None, tmp_path: Path) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    with HubServer(tmp_path / "data", token=TOKEN, private=True) as private:
        HfApi(endpoint=private.url, token=TOKEN).create_repo("org/secret")
        assert HfApi(endpoint=private.url, token=TOKEN).model_info("org/secret").sha
        with pytest.raises(HfHubHTTPError) as exc:
            HfApi(endpoint=private.url, token=False).model_info("org/secret")
        assert exc.value.response.status_code == 401


# The routes that read a repo (all of them go through routes.auth.readable_repo).
READ_ROUTES = frozenset(
    {
        "get_model",
        "get_model_revision",
        "list_refs",
        "list_commits",
        "tree_root",
        "tree",
        "paths_info",
        "resolve_file",
    }
)


def test_every_route_decides_access_in_routes_auth() -> None:
    """Each route reaches the token rules through vla_rl.hub.routes.auth (or is public on purpose), so a new
    rule (e.g. per-repo private reads) lands in one dependency and covers every route."""
    from fastapi.dependencies.models import Dependant
    from fastapi.routing import APIRoute

    from vla_rl.hub.routes import ROUTERS, auth

    def calls(d: Dependant) -> set[Any]:
        return {d.call} | {c for sub in d.dependencies for c in calls(sub)}

    # Public on purpose: whoami checks the token itself, LFS upload URLs are signed by the batch answer.
    public = {"health", "whoami", "validate_yaml", "xet_token", "lfs_upload"}
    access: dict[str, str] = {}
    for route in (r for router in ROUTERS for r in router.routes):
        assert isinstance(route, APIRoute)
        used = calls(route.dependant)
        kind = "write" if auth.require_write in used else "read" if auth.require_read in used else "public"
        assert access.setdefault(route.name, kind) == kind
        if "{org}" in route.path and kind != "public":
            assert used & {auth.readable_repo, auth.writable_repo, auth.writable_lfs_repo}, route.path
    assert {name for name, kind in access.items() if kind == "public"} == public
    assert {name for name, kind in access.items() if kind == "read"} == READ_ROUTES


# ----- hostile input ---------------------------------------------------------------------------------------
def _commit_body(*ops: dict[str, Any], summary: str = "s") -> bytes:
    lines = [{"key": "header", "value": {"summary": summary, "description": ""}}, *ops]
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def test_path_traversal_is_rejected(hub: HubServer, api: Any) -> None:
    data_dir = Path(hub.data_dir).resolve()
    outside_before = sorted(p.name for p in data_dir.parent.iterdir())
    repo = "org/traversal"
    api.create_repo(repo)
    head = api.model_info(repo).sha

    bad_names = [
        {"name": "..", "organization": "org"},
        {"name": "x", "organization": ".."},
        {"name": "x", "organization": "../../tmp"},
        {"name": "../../evil", "organization": None},
        {"name": "ok", "organization": "api"},
        {"name": "x.git", "organization": "org"},
        {"name": "a/b", "organization": "org"},
        {"name": "evil\u0000", "organization": "org"},
    ]
    for body in bad_names:
        status, _, raw = _raw(hub, "POST", "/api/repos/create", json.dumps(body).encode(), _auth())
        assert status == 400, body
        assert "error" in json.loads(raw)

    bad_routes = [
        "/api/models/%2E%2E/%2E%2E",
        "/api/models/../..",
        "/api/models/org/..%2F..%2Fetc",
        "/api/models/%2E%2E/etc/revision/main",
        f"/{repo}/resolve/main/..%2F..%2Frefs.json",
        f"/{repo}/resolve/main/../../refs.json",
        f"/{repo}/resolve/main/%2Fetc%2Fpasswd",
        "/%2E%2E/%2E%2E/resolve/main/hub.json",
        f"/api/models/{repo}/tree/main/..%2F..",
    ]
    for route in bad_routes:
        status, _, raw = _raw(hub, "GET", route)
        assert status in (400, 404), route
        assert "error" in json.loads(raw)
        assert b"branches" not in raw and b"format" not in raw

    bad_paths = [
        "../evil.txt",
        "a/../../evil.txt",
        "/abs.txt",
        "a\\..\\evil.txt",
        ".git/config",
        "a//b",
        "./a",
        "a/",
    ]
    for path in bad_paths:
        op = {
            "key": "file",
            "value": {"path": path, "content": base64.b64encode(b"x").decode(), "encoding": "base64"},
        }
        status, _, raw = _raw(hub, "POST", f"/api/models/{repo}/commit/main", _commit_body(op), _auth())
        assert status == 400, path
        assert "invalid path" in json.loads(raw)["error"]
        # "a/" is a valid deletedFolder path: the client marks folders with a trailing '/'.
        for key in ("lfsFile", "deletedFile", *(("deletedFolder",) if path != "a/" else ())):
            op2 = {"key": key, "value": {"path": path, "algo": "sha256", "oid": "0" * 64}}
            status, _, _ = _raw(hub, "POST", f"/api/models/{repo}/commit/main", _commit_body(op2), _auth())
            assert status == 400, (key, path)
        preupload = {"files": [{"path": path, "size": 1, "sample": "eA=="}]}
        status, _, _ = _raw(
            hub, "POST", f"/api/models/{repo}/preupload/main", json.dumps(preupload).encode(), _auth()
        )
        assert status == 400, path

    # An LFS object that was never uploaded, malformed NDJSON, bad ref names.
    op = {"key": "lfsFile", "value": {"path": "w.bin", "algo": "sha256", "oid": "a" * 64, "size": 3}}
    status, _, _ = _raw(hub, "POST", f"/api/models/{repo}/commit/main", _commit_body(op), _auth())
    assert status == 422
    status, _, _ = _raw(hub, "POST", f"/api/models/{repo}/commit/main", b"{not json\n", _auth())
    assert status == 400
    status, _, _ = _raw(
        hub, "POST", f"/api/models/{repo}/tag/main", json.dumps({"tag": "../x"}).encode(), _auth()
    )
    assert status == 400
    status, _, _ = _raw(hub, "POST", f"/api/models/{repo}/branch/..", b"{}", _auth())
    assert status in (400, 404)

    assert api.model_info(repo).sha == head  # no commit landed
    assert sorted(p.name for p in data_dir.parent.iterdir()) == outside_before
    assert not [p for p in data_dir.rglob("*evil*")]
    for ns in (data_dir / "repos").iterdir():
        assert ns.name not in ("..", "api", "tmp")


# ----- concurrency -----------------------------------------------------------------------------------------
def test_concurrent_commits_serialise_and_stale_parents_fail(
    hub: HubServer, api: Any, tmp_path: Path
) -> None:
    """Four writers (two through this server, two through a second server *process* on the same data folder)
    commit at once: every commit lands, history is linear, and commits on a stale parent get 412."""
    from huggingface_hub import CommitOperationAdd, HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    repo = "org/concurrent"
    api.create_repo(repo)
    with HubServer(hub.data_dir, token=TOKEN, subprocess=True) as other:
        clients = [HfApi(endpoint=url, token=TOKEN) for url in (hub.url, hub.url, other.url, other.url)]
        per_writer = 3
        barrier = threading.Barrier(len(clients))
        errors: list[BaseException] = []

        def writer(i: int) -> None:
            try:
                barrier.wait()
                for j in range(per_writer):
                    ops = [
                        CommitOperationAdd(f"w{i}/c{j}.txt", f"writer {i} commit {j}".encode()),
                        CommitOperationAdd("shared.txt", f"last writer {i} {j}".encode()),
                    ]
                    clients[i].create_commit(repo, ops, commit_message=f"w{i} c{j}")
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors

        commits = api.list_repo_commits(repo)
        assert len(commits) == 1 + len(clients) * per_writer
        assert len({c.commit_id for c in commits}) == len(commits)
        files = set(api.list_repo_files(repo))
        assert {f"w{i}/c{j}.txt" for i in range(len(clients)) for j in range(per_writer)} <= files
        snap = Path(snapshot_download(repo, cache_dir=tmp_path / "cache", endpoint=hub.url))
        for i in range(len(clients)):
            for j in range(per_writer):
                assert (snap / f"w{i}" / f"c{j}.txt").read_text() == f"writer {i} commit {j}"

        # Everyone commits on the same parent: exactly one wins, the others get 412 and change nothing.
        head = api.model_info(repo).sha
        barrier = threading.Barrier(len(clients))
        outcomes: list[Any] = [None] * len(clients)

        def racer(i: int) -> None:
            op = [CommitOperationAdd(f"race/{i}.txt", b"x")]
            barrier.wait()
            try:
                outcomes[i] = (
                    clients[i].create_commit(repo, op, commit_message=f"race {i}", parent_commit=head).oid
                )
            except HfHubHTTPError as e:
                outcomes[i] = e.response.status_code

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [o for o in outcomes if isinstance(o, str)]
        assert len(winners) == 1 and sorted(o for o in outcomes if not isinstance(o, str)) == [412] * 3
        assert api.model_info(repo).sha == winners[0]
        assert len([f for f in api.list_repo_files(repo) if f.startswith("race/")]) == 1

    # The repo on disk is intact: every commit file parses and chains back to the initial commit.
    repo_dir = Path(hub.data_dir) / "repos" / "org" / "concurrent"
    refs = json.loads((repo_dir / "refs.json").read_text())
    chain, cur = [], refs["branches"]["main"]
    while cur:
        chain.append(cur)
        cur = json.loads((repo_dir / "commits" / f"{cur}.json").read_text())["parent"]
    assert len(chain) == len(list((repo_dir / "commits").glob("*.json"))) == 2 + len(clients) * per_writer
    assert not list(Path(hub.data_dir, "tmp").iterdir())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
