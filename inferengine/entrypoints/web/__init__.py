"""The built-in web page: a chat playground and a live engine view, static files served at `/`.

The page (`static/`: HTML, CSS and plain ES modules, no build step, nothing fetched from
elsewhere) speaks only the public HTTP API: `/v1/models`, `/v1/chat/completions` (streamed) and
`/stats`. This module imports nothing of the engine; `api_server.build_app` mounts it unless
`--disable-web-ui`. The files themselves need no API key (the gate lets `is_page_path` through);
with `--api-key` the page asks for the key and sends it on every API call.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

STATIC_DIR = Path(__file__).parent / "static"
ASSET_PREFIX = "/web/"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}
# The page runs only its own files and talks only to this server: even a reply rendered wrongly
# could not run a script or send anything elsewhere.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def is_page_path(path: str) -> bool:
    """The page's own paths (`/` and `/web/<file>`), which load without the API key."""
    return path == "/" or path.startswith(ASSET_PREFIX)


def _assets() -> dict[str, Path]:
    """The files the page may fetch, by name: a fixed list, so no path ever leaves `static/`."""
    return {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in _MEDIA_TYPES and p.is_file()}


def mount_web_ui(app: FastAPI) -> None:
    """Serve the page at `/` and its files at `/web/<name>`."""
    assets = _assets()

    def serve(path: Path) -> Response:
        return FileResponse(path, media_type=_MEDIA_TYPES[path.suffix], headers=_HEADERS)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def index() -> Response:
        return serve(assets["index.html"])

    @app.api_route(ASSET_PREFIX + "{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def asset(name: str) -> Response:
        path = assets.get(name)
        if path is None:
            return Response("Not found", status_code=404, media_type="text/plain")
        return serve(path)
