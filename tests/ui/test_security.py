"""Nothing outside a run directory is ever served: traversal, encoded slashes, absolute paths,
symlinks. Requests are sent as raw ASGI scopes so that no HTTP client normalises them first."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
from urllib.parse import unquote

import pytest

from trainguard.ui._registry import PathRefused, safe_file

SECRET = "SECRET-OUTSIDE-THE-RUN"


def raw_get(app, raw_path: str, host: str = "127.0.0.1:6007") -> tuple[int, dict, bytes]:
    """Send ``raw_path`` exactly as written, decoded the way uvicorn decodes it."""
    path, _, query = raw_path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": unquote(path),
        "raw_path": path.encode("latin-1"),
        "root_path": "",
        "query_string": query.encode("latin-1"),
        "headers": [(b"host", host.encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 6007),
    }
    out: dict = {"status": None, "headers": {}, "body": b""}

    async def run():
        done = asyncio.Event()
        sent = []

        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": b"", "more_body": False}
            await done.wait()  # file responses listen for the client leaving
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
                out["headers"] = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body":
                out["body"] += message.get("body", b"")
                if not message.get("more_body"):
                    done.set()

        await asyncio.wait_for(app(scope, receive, send), timeout=20)

    # In a thread of its own: Playwright's sync API keeps an event loop on the main thread.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run()).result()
    return out["status"], out["headers"], out["body"]


@pytest.mark.parametrize(
    "raw, status",
    [
        ("/api/runs/train/artifacts/../../secret.txt", 400),
        ("/api/runs/train/artifacts/doctor/../../../secret.txt", 400),
        ("/api/runs/train/artifacts/%2e%2e/%2e%2e/secret.txt", 400),
        ("/api/runs/train/artifacts/..%2f..%2fsecret.txt", 400),
        ("/api/runs/train/artifacts/..%2F..%2Fsecret.txt", 400),
        ("/api/runs/train/artifacts/%2Ftmp%2Fsecret.txt", 400),
        ("/api/runs/train/artifacts/..%5c..%5csecret.txt", 400),
        ("/api/runs/train/artifacts/doctor%00/secret.txt", 400),
        ("/api/runs/train/artifacts/%252e%252e%252fsecret.txt", 403),  # decoded once: still refused
        ("/api/runs/train/artifacts//etc/passwd", 403),
        ("/api/runs/train/artifacts/doctor/leak.txt", 403),  # symlink to a file outside the run
        ("/api/runs/train/artifacts/doctor/srcdir/digits_mlp.py", 403),  # symlinked directory
        ("/api/runs/..%2F..%2Fsecret/alerts", 400),
        ("/api/runs/%2Ftmp/alerts", 400),
        ("/api/runs/../../secret.txt", 400),
        ("/static/../_app.py", 400),
        ("/static/%2e%2e/_app.py", 400),
        ("/static/..%2f_app.py", 400),
        ("/static//etc/passwd", 404),
        ("/api/runs/ref/sources/..%2f..%2fsecret.txt", 400),
    ],
)
def test_traversal_is_refused(app, logdir, raw, status):
    got, headers, body = raw_get(app, raw)
    assert got == status, (raw, got, body[:200])
    assert SECRET.encode() not in body and b"import" not in body
    if raw.startswith("/api/"):
        err = json.loads(body)["error"]
        assert err["status"] == status and err["message"]


def test_a_run_id_is_only_a_key_never_a_path(app, logdir):
    for rid in (str(logdir.root), str(logdir.outside.parent), "~", "group", "nested", "group/nested"):
        status, _, body = raw_get(app, f"/api/runs/{rid.replace('/', '%2F')}")
        assert status in (400, 404) and SECRET.encode() not in body


def test_safe_file_refuses_every_way_out(logdir):
    base = logdir.train
    assert safe_file(base, "doctor/notes.txt").read_text() == "doctor notes inside the run\n"
    for name in ["", "/etc/passwd", "../secret.txt", "doctor/../../secret.txt", "doctor/./notes.txt", "a\\b",
                 "C:/x", "doctor%2fnotes.txt", "x\x00", "doctor/leak.txt", "doctor/srcdir/digits_mlp.py", "doctor//notes.txt"]:
        with pytest.raises(PathRefused):
            safe_file(base, name)
    with pytest.raises(KeyError):
        safe_file(base, "doctor/missing.txt")
    with pytest.raises(KeyError):
        safe_file(base, "doctor")  # a directory is not a file


def test_source_is_the_recorded_copy_not_the_file_on_disk(tmp_path, builders):
    from starlette.testclient import TestClient

    from trainguard.ui import create_app

    ref = builders.reference_like(tmp_path / "logs" / "r", tmp_path / "src", steps=1)
    ref.script.write_text("# edited after the run\n")
    with TestClient(create_app(tmp_path / "logs")) as c:
        files = c.get("/api/runs/r/sources").json()["files"]
        fid = next(f["file_id"] for f in files if f["path"] == str(ref.script))
        assert c.get(f"/api/runs/r/sources/{fid}").json()["text"] == builders.script
        ref.script.unlink()
        assert c.get(f"/api/runs/r/sources/{fid}").json()["text"] == builders.script


def test_host_header_is_checked_when_serving_loopback(logdir):
    from trainguard.ui import create_app

    app = create_app(logdir.root, allowed_hosts=["127.0.0.1", "localhost"])
    assert raw_get(app, "/api/health", host="127.0.0.1:6007")[0] == 200
    assert raw_get(app, "/api/health", host="localhost")[0] == 200
    status, _, body = raw_get(app, "/api/runs", host="attacker.example:6007")
    assert status == 400 and json.loads(body)["error"]["type"] == "HostRefused"


def test_security_headers_on_pages_and_api(app):
    for path in ("/", "/api/runs", "/static/js/app.js", "/api/runs/nope"):
        _, headers, _ = raw_get(app, path)
        csp = headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp
        assert headers["x-content-type-options"] == "nosniff"


def test_static_app_references_nothing_off_the_server():
    from pathlib import Path

    import trainguard.ui

    static = Path(trainguard.ui.__file__).parent / "static"
    files = [p for p in static.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"index.html", "app.css", "app.js", "debugger.js", "training.js"}
    for p in files:
        text = p.read_text(encoding="utf-8")
        assert "http://" not in text.replace('"http://www.w3.org/2000/svg"', "").replace("http://www.w3.org/2000/svg", ""), p
        assert "https://" not in text and "//cdn" not in text.lower(), p


def test_default_bind_is_loopback():
    import argparse

    from trainguard.cli import _ui
    from trainguard.ui import bind

    parser = argparse.ArgumentParser()
    _ui.add_parser(parser.add_subparsers())
    args = parser.parse_args(["ui", "somewhere"])
    assert (args.host, args.port) == ("127.0.0.1", 6007)
    sock = bind(port=0)
    try:
        assert sock.getsockname()[0] == "127.0.0.1"
        # Nagle off, and a TCP proto so that asyncio keeps it off on every accepted connection:
        # otherwise each answer waits ~40 ms for a delayed ACK (measured: 44 ms -> 0.8 ms).
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


def test_port_in_use_is_one_clear_error():
    from trainguard import TrainguardError
    from trainguard.ui import bind

    first = bind(port=0)
    try:
        with pytest.raises(TrainguardError, match=r"cannot listen on 127\.0\.0\.1:\d+: .*pick another --port"):
            bind(port=first.getsockname()[1])
    finally:
        first.close()


@pytest.fixture(scope="module")
def hostile_artifacts(tmp_path_factory):
    """A run whose artifacts claim media types a browser would run or render."""
    from trainguard.store import RunWriter
    from trainguard.ui import create_app

    root = tmp_path_factory.mktemp("artifacts")
    w = RunWriter(root / "evil", mode="no_tensor")
    w.put_artifact("page", "text/html", b"<script>alert(1)</script>")
    w.put_artifact("page2", "text/html; charset=utf-8", b"<script>alert(1)</script>")
    w.put_artifact("code", "application/javascript", b"alert(1)")
    w.put_artifact("image.svg", "image/svg+xml", b"<svg onload='alert(1)'/>")
    w.put_artifact("doctor/report.json", "application/json", b'{"ok": true}')
    w.put_artifact("doctor/lr.csv", "text/csv", b"lr,loss\n0.1,1.0\n")
    w.put_artifact("doctor/plot.png", "image/png", b"\x89PNG\r\n\x1a\nrest")
    w.close()
    (root / "evil" / "doctor").mkdir()
    (root / "evil" / "doctor" / "file.html").write_text("<script>alert(1)</script>")
    from starlette.testclient import TestClient

    with TestClient(create_app(root)) as c:
        yield c


@pytest.mark.parametrize("name, media, inline", [
    ("page", "application/octet-stream", False),
    ("page2", "application/octet-stream", False),
    ("code", "application/octet-stream", False),
    ("image.svg", "application/octet-stream", False),
    ("doctor/file.html", "application/octet-stream", False),
    ("doctor/report.json", "application/json", False),
    ("doctor/lr.csv", "text/csv", False),
    ("doctor/plot.png", "image/png", True),
])
def test_artifacts_are_served_only_as_types_the_ui_writes(hostile_artifacts, name, media, inline):
    r = hostile_artifacts.get(f"/api/runs/evil/artifacts/{name}")
    assert r.status_code == 200
    assert r.headers["content-type"].split(";")[0] == media
    assert r.headers["x-content-type-options"] == "nosniff"
    disposition = r.headers["content-disposition"]
    assert disposition.startswith("inline" if inline else "attachment"), disposition
