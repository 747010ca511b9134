"""The page's routes in-process (no browser): its files load without the API key and with a
strict content policy, nothing else does, `--disable-web-ui` removes them, and the wheel ships
them."""

from __future__ import annotations

import ast
import asyncio
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from inferengine.entrypoints.openai.middleware import GateMiddleware
from inferengine.entrypoints.web import STATIC_DIR, mount_web_ui

ROOT = Path(__file__).resolve().parents[3]
KEY = "sk-page"


class _State:
    api_key: str | None = KEY
    max_request_body_bytes = 1 << 20
    draining = False
    in_flight = 0

    def __init__(self) -> None:
        self.cut_off = asyncio.Event()


@pytest.fixture
def client():
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    @app.post("/")
    async def post_root() -> dict:  # a route the gate must not open by its path alone
        return {"ok": True}

    mount_web_ui(app)
    app.add_middleware(GateMiddleware, state=_State())
    with TestClient(app) as c:
        yield c


def test_the_page_and_its_files_load_without_the_key(client):
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    for src in ("/web/app.js", "/web/style.css"):
        assert src in page.text
    for name in ("app.js", "api.js", "chat.js", "engine_view.js", "markdown.js"):
        response = client.get(f"/web/{name}")
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/javascript; charset=utf-8"
    assert client.get("/web/style.css").headers["content-type"] == "text/css; charset=utf-8"
    assert client.head("/").status_code == 200


def test_nothing_else_is_open(client):
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.post("/", json={}).status_code == 401  # only GET and HEAD of the page are open
    for path in ("/web/nope.js", "/web/..%2f__init__.py", "/web/%2e%2e/__init__.py"):
        assert client.get(path).status_code == 404, path


def test_disable_web_ui(tiny_checkpoint):
    from inferengine.engine.arg_utils import EngineArgs
    from inferengine.entrypoints.cli.main import build_parser
    from inferengine.entrypoints.openai.api_server import build_app
    from inferengine.entrypoints.openai.config import ServerConfig

    config = EngineArgs(model=str(tiny_checkpoint("qwen3")), max_model_len=256)
    engine_config = config.create_engine_config()
    for disabled, status in ((False, 200), (True, 404)):
        app = build_app(engine_config, ServerConfig(disable_web_ui=disabled))
        http = TestClient(app)  # no lifespan: the engine never starts, the routes are there
        assert http.get("/").status_code == status
        assert http.get("/web/app.js").status_code == status
    args = build_parser().parse_args(["serve", "--disable-web-ui"])
    assert args.disable_web_ui is True


def test_the_wheel_ships_the_files():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["inferengine"]
    package = ROOT / "inferengine"
    files = sorted(p.relative_to(package).as_posix() for p in STATIC_DIR.iterdir())
    assert {"index.html", "style.css", "app.js"} <= {Path(f).name for f in files}
    for f in files:
        assert any(fnmatch(f, pattern) for pattern in patterns), f


def test_the_page_imports_nothing_of_the_engine():
    source = (STATIC_DIR.parent / "__init__.py").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("inferengine"), node.module
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("inferengine") for a in node.names)


def test_each_script_is_small():
    for script in STATIC_DIR.glob("*.js"):
        assert len(script.read_text().splitlines()) <= 400, script.name
