"""The dashboard's assets served from memory (vla_rl/dashboard/assets.py): versioned immutable URLs,
ETag revalidation, gzip for browsers that accept it, HEAD, and nothing outside the table read at
start-up (no path from a request reaches the file system)."""

from __future__ import annotations

import gzip
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from vla_rl.dashboard.assets import AssetServer, index_page, load_assets, static_version


def _app(root: Path) -> tuple[TestClient, str]:
    version = static_version(root)
    app = FastAPI()
    app.add_api_route("/static/{path:path}", AssetServer(version, root).serve, methods=["GET", "HEAD"])
    app.add_api_route("/episodes", index_page(version, "/episodes", root), methods=["GET"])
    return TestClient(app), version


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "static"
    (root / "pages").mkdir(parents=True)
    (root / "app.js").write_text(
        'import { x } from "./util.js";\nroute("/episodes", () => import("./pages/episodes.js"));\n'
        + "// padding so that it is gzipped\n" * 60
    )
    (root / "util.js").write_text("export const x = 1;\n")
    (root / "pages" / "episodes.js").write_text('import { x } from "../util.js";\nexport const y = x;\n')
    (root / "style.css").write_text("body { margin: 0 }\n")
    (root / "index.html").write_text(
        '<html><head>\n    <!-- modulepreload -->\n<script type="module" src="/static/app.js"></script>'
        '<link rel="stylesheet" href="/static/style.css" /></head></html>\n'
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
    assert small.content == b"export const x = 1;\n" and "content-encoding" not in small.headers  # too small

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


def test_the_page_is_built_once_with_versioned_urls_and_its_modules_preloaded(tmp_path: Path) -> None:
    root = _root(tmp_path)
    client, version = _app(root)
    r = client.get("/episodes")
    assert r.status_code == 200 and r.headers["cache-control"] == "no-cache"
    assert f'src="/static/{version}/app.js"' in r.text and f'href="/static/{version}/style.css"' in r.text
    preloads = sorted(line.split('"')[3] for line in r.text.splitlines() if "modulepreload" in line)
    assert preloads == [f"/static/{version}/{m}" for m in ("app.js", "pages/episodes.js", "util.js")]
    (root / "index.html").write_text("changed on disk")  # built once: a running app keeps its page
    assert client.get("/episodes").text == r.text


def test_load_assets_types_and_gzip_copies(tmp_path: Path) -> None:
    assets = load_assets(_root(tmp_path))
    assert sorted(assets) == ["app.js", "index.html", "pages/episodes.js", "style.css", "util.js"]
    app = assets["app.js"]
    assert app.gzipped is not None and gzip.decompress(app.gzipped) == app.body
    assert assets["util.js"].gzipped is None and assets["style.css"].media_type.startswith("text/css")
    assert len({a.etag for a in assets.values()}) == len(assets)  # content hashes
