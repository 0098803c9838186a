"""The dashboard's assets served from memory (vla_rl/dashboard/assets.py): versioned immutable URLs,
ETag revalidation, gzip for browsers that accept it, HEAD, and nothing outside the table read at
start-up (no path from a request reaches the file system)."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vla_rl.dashboard.assets import (
    BUNDLE,
    AssetServer,
    BundleError,
    bundle,
    index_page,
    load_assets,
    static_version,
)


def _app(root: Path) -> tuple[TestClient, str]:
    version = static_version(root)
    app = FastAPI()
    app.add_api_route("/static/{path:path}", AssetServer(version, root).serve, methods=["GET", "HEAD"])
    app.add_api_route("/episodes", index_page(version, root), methods=["GET"])
    return TestClient(app), version


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "static"
    (root / "pages").mkdir(parents=True)
    (root / "app.js").write_text(
        'import { x, y as why } from "./util.js";\n'
        'route("/episodes", () => import("./pages/episodes.js"));\n'
        "export function can(role) {\n  return role + x + why;\n}\n"
        + "// padding so that it is gzipped\n"
        * 60
    )
    (root / "util.js").write_text("export const x = 1;\nexport async function y() {}\nconst own = 2;\n")
    (root / "pages" / "episodes.js").write_text('import { x } from "../util.js";\nexport class Page {}\n')
    (root / "style.css").write_text("body { margin: 0 }\n")
    (root / "index.html").write_text(
        '<html><head><link rel="stylesheet" href="/static/style.css" />'
        '<script type="module" src="/static/app.bundle.js"></script></head></html>\n'
    )
    (tmp_path / "secret.txt").write_text("not an asset")
    return root


def test_assets_come_from_memory_with_cache_headers_etag_and_gzip(tmp_path: Path) -> None:
    root = _root(tmp_path)
    client, version = _app(root)
    body = (root / "app.js").read_bytes()

    r = client.get(f"/static/{version}/app.js", headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and r.content == body and "content-encoding" not in r.headers
    assert r.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert r.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    etag = r.headers["etag"]
    # the unversioned URL: the same bytes, revalidated after 5 minutes
    r = client.get("/static/app.js", headers={"Accept-Encoding": "identity"})
    assert (
        r.content == body
        and r.headers["cache-control"] == "public, max-age=300"
        and r.headers["etag"] == etag
    )

    # gzip for a browser that accepts it (httpx decodes it: compare the raw stream)
    r = client.get(f"/static/{version}/app.js", headers={"Accept-Encoding": "gzip, deflate"})
    assert r.headers["content-encoding"] == "gzip" and r.headers["vary"] == "Accept-Encoding"
    assert r.content == body and int(r.headers["content-length"]) < len(body) / 2
    small = client.get(f"/static/{version}/util.js", headers={"Accept-Encoding": "gzip"})
    small_body = (root / "util.js").read_bytes()
    assert small.content == small_body and "content-encoding" not in small.headers  # too small

    # revalidation: a matching ETag is a 304 without a body; a stale one gets the file
    r = client.get("/static/app.js", headers={"If-None-Match": etag})
    assert r.status_code == 304 and r.content == b"" and r.headers["etag"] == etag
    assert client.get("/static/app.js", headers={"If-None-Match": '"stale"'}).status_code == 200
    # HEAD: the headers, no body
    r = client.head("/static/style.css", headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) == 19
    assert r.headers["content-type"].startswith("text/css")

    # only the table read at start-up: other versions, unknown names, escapes and files added later 404
    (root / "later.js").write_text("export {};\n")
    for path in (
        "/static/0123456789ab/app.js",
        "/static/nope.js",
        "/static/../secret.txt",
        "/static/%2e%2e/secret.txt",
        "/static/pages/../../secret.txt",
        "/static/later.js",
        f"/static/{version}/",
    ):
        r = client.get(path)
        assert r.status_code == 404 and b"not an asset" not in r.content, path


def test_the_page_is_built_once_with_versioned_urls_and_runs_the_bundle(tmp_path: Path) -> None:
    root = _root(tmp_path)
    client, version = _app(root)
    r = client.get("/episodes")
    assert r.status_code == 200 and r.headers["cache-control"] == "no-cache"
    assert f'src="/static/{version}/{BUNDLE}"' in r.text and f'href="/static/{version}/style.css"' in r.text
    js = client.get(f"/static/{version}/{BUNDLE}")
    assert js.status_code == 200 and js.text == bundle(root)
    assert js.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert js.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    (root / "index.html").write_text("changed on disk")  # built once: a running app keeps its page
    assert client.get("/episodes").text == r.text


def test_bundle_runs_each_module_once_dependencies_first_with_its_own_scope(tmp_path: Path) -> None:
    text = bundle(_root(tmp_path))
    order = [line.split()[2] for line in text.splitlines() if line.startswith("// ---- ")]
    # depth-first in import order (util.js, then the page app.js routes to), the entry last
    assert order == ["util.js", "pages/episodes.js", "app.js"]
    lines = text.splitlines()
    assert 'const { x, y: why } = __vlaModules["util.js"];' in lines  # `as` renames
    assert 'const { x } = __vlaModules["util.js"];' in lines  # ../ resolved from pages/
    assert 'route("/episodes", () => Promise.resolve(__vlaModules["pages/episodes.js"]));' in lines
    # export dropped from declarations, which each module returns as its namespace (own names stay inside)
    assert "const x = 1;" in lines and "async function y() {}" in lines and "function can(role) {" in lines
    assert "return { x, y };" in lines and "return { Page };" in lines and "return { can };" in lines
    assert not any(line.startswith(("import ", "export ")) for line in lines)
    assert len(load_assets(_root(tmp_path / "again"))[BUNDLE].gzipped or b"") > 0  # served gzipped too


@pytest.mark.parametrize(
    ("source", "what"),
    [
        ("export let n = 1;\n", "util.js:1: expected export function"),  # a live binding would freeze
        ("export default 1;\n", "util.js:1: expected export function"),
        ("const a = 1;\nexport { a };\n", "util.js:2: expected export function"),
        ('import * as m from "./app.js";\n', "util.js:1: expected export function"),
        ("import {\n  a,\n} from './app.js';\n", "util.js:1: expected export function"),
        ('import { } from "./app.js";\n', "util.js:1: expected import { a, b as c }"),
        ("const m = import(name);\n", 'util.js:1: expected import("./x.js")'),
        ("const u = import.meta.url;\n", "util.js:1: import.meta"),
        ('import { a } from "./missing.js";\n', "missing.js: imported but not under"),
        ('import { can } from "./app.js";\n', "import cycle: app.js -> util.js -> app.js"),
    ],
)
def test_bundle_refuses_what_it_does_not_handle(tmp_path: Path, source: str, what: str) -> None:
    root = _root(tmp_path)
    (root / "util.js").write_text(source)
    with pytest.raises(BundleError, match="^" + re.escape(what)):
        bundle(root)


def test_load_assets_types_and_gzip_copies(tmp_path: Path) -> None:
    assets = load_assets(_root(tmp_path))
    assert sorted(assets) == [BUNDLE, "app.js", "index.html", "pages/episodes.js", "style.css", "util.js"]
    app = assets["app.js"]
    assert app.gzipped is not None and gzip.decompress(app.gzipped) == app.body
    assert assets["util.js"].gzipped is None and assets["style.css"].media_type.startswith("text/css")
    assert len({a.etag for a in assets.values()}) == len(assets)  # content hashes


def test_the_inline_early_fetch_and_api_js_read_the_same_token_key() -> None:
    """index.html's inline script starts the first requests with the token api.js keeps; if the key moved in
    one and not the other, every first page would wait for the bundle and ask again (or fail)."""
    static = Path(__file__).resolve().parents[1] / "vla_rl" / "dashboard" / "static"
    [key] = re.findall(r'const TOKEN_KEY = "([^"]+)";', (static / "api.js").read_text())
    inline = re.findall(r'localStorage\.getItem\("([^"]+)"\)', (static / "index.html").read_text())
    assert inline == [key], (inline, key)
