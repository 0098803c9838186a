"""File paths in Hub repos that are fine on Linux but not where a checkpoint is downloaded (issue 45, item 8):
'.GIT' (a '.git' on a case-insensitive file system), Windows device names, invisible and bidirectional
characters, and paths that are one file once case and Unicode normalisation stop counting. Each is refused
with a 4xx naming the path, and nothing lands."""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import pytest
from test_hub import _auth, _commit_body, _raw, hub_client_env  # noqa: F401 - fixture
from test_hub_hardening import _file_op, api, hub  # noqa: F401 - fixtures

from vla_rl.hub import naming
from vla_rl.hub.server import HubServer

REFUSED = [
    ".GIT/config",
    "a/.Git/hooks/post-checkout",
    ".git./config",  # Windows drops the trailing dot
    "NUL",
    "con.txt",
    "weights/COM1.json",
    "lpt9",
    "aux.tar.gz",
    "com\u00b9.bin",
    "a\u200bb.txt",  # zero-width space
    "evil\u202etxt.exe",  # right-to-left override: shows as 'evilexe.txt'
    "a\u2066b.txt",  # left-to-right isolate
    "soft\u00adhyphen.txt",
    "line\u2028sep.txt",
    "bom\ufeff.txt",
    "c1\x85.txt",
]
ACCEPTED = [
    "config.json",
    "CONFIG.JSON",
    "console.log",
    "com10.txt",
    "nullable.py",
    "a.git/x",
    "git/config",
    ".gitattributes",
    "caf\u00e9.txt",
    "caf\u0065\u0301.md",  # one NFD name alone is fine
    "\u65e5\u672c.bin",
    "trailing space ",
]


@pytest.mark.parametrize("path", REFUSED)
def test_unsafe_paths_are_refused_by_name(path: str) -> None:
    with pytest.raises(ValueError, match="invalid path in repo"):
        naming.validate_repo_path(path)


@pytest.mark.parametrize("path", ACCEPTED)
def test_ordinary_paths_are_accepted(path: str) -> None:
    assert naming.validate_repo_path(path) == path


def test_collisions_after_case_folding_and_normalisation() -> None:
    nfc, nfd = "caf\u00e9.txt", unicodedata.normalize("NFD", "caf\u00e9.txt")
    assert nfc != nfd and naming.path_key(nfc) == naming.path_key(nfd)
    assert naming.path_collision(["a.txt", "A.TXT"], ["A.TXT"]) == ("A.TXT", "a.txt")
    assert naming.path_collision([nfc, nfd], [nfd]) == (nfd, nfc)
    assert naming.path_collision(["Dir/x", "dir/y"], ["dir/y"]) == ("dir", "Dir")  # one folder there
    assert naming.path_collision(["Stra\u00dfe.txt", "STRASSE.txt"], ["STRASSE.txt"]) is not None
    assert naming.path_collision(["a.txt", "A.txt", "b.txt"], ["b.txt"]) is None  # an old clash stays
    assert naming.path_collision(["a/x", "a/y", "b"], ["a/y"]) is None


def _commit(hub: HubServer, repo: str, *paths: str) -> tuple[int, dict[str, Any]]:  # noqa: F811
    ops = [_file_op(p, p.encode("utf-8", "surrogatepass")) for p in paths]
    status, _, raw = _raw(hub, "POST", f"/api/models/{repo}/commit/main", _commit_body(*ops), _auth())
    return status, json.loads(raw)


def test_the_server_refuses_them_with_4xx_naming_the_path(hub: HubServer, api: Any) -> None:  # noqa: F811
    repo = "org/paths"
    api.create_repo(repo)
    assert _commit(hub, repo, "model.bin", "Dir/a.txt", "caf\u00e9.txt")[0] == 200
    head = api.model_info(repo).sha
    for path in REFUSED:
        status, body = _commit(hub, repo, path)
        assert status == 400 and "invalid path in repo" in body["error"], (path, status, body)
        assert repr(path)[1:-1] in body["error"] or path in body["error"], body
        pre = {"files": [{"path": path, "size": 1, "sample": "eA=="}]}
        status, _, _ = _raw(
            hub, "POST", f"/api/models/{repo}/preupload/main", json.dumps(pre).encode(), _auth()
        )
        assert status == 400, path
    clashes = [
        ("MODEL.bin",),  # the file already there
        (unicodedata.normalize("NFD", "caf\u00e9.txt"),),
        ("dir/b.txt",),  # the folder already there
        ("new.txt", "NEW.txt"),  # within one commit
    ]
    for paths in clashes:
        status, body = _commit(hub, repo, *paths)
        assert status == 409, (paths, status, body)
        assert "invalid path in repo" in body["error"] and "case and Unicode normalisation" in body["error"]
    assert api.model_info(repo).sha == head  # nothing landed
    files = set(api.list_repo_files(repo))
    assert files == {".gitattributes", "model.bin", "Dir/a.txt", "caf\u00e9.txt"}
    assert _commit(hub, repo, "Dir/b.txt", "model.safetensors")[0] == 200  # the same spelling is fine
