"""The web dashboard (built from ``web/`` into ``colibri/_web``), served at ``/`` beside the APIs.

``/`` answers the dashboard's ``index.html`` (never cached: it names the current bundle) and
``/assets/*`` its hashed files (cached for good: a new build has new names). Nothing else is
taken: every other path stays the APIs' own, unknown ones still 404 in the API's envelope. The
page and its files are public like ``/health`` (a browser cannot send a key with a page load);
every API call the page makes needs the key as any client's does (``security.py``).
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from colibri.errors import ApiError

WEB_DIR = Path(__file__).resolve().parent.parent / "_web"
ASSETS_PREFIX = "/assets/"

# Only the page's own files and the same origin: a reply rendered in the page can load nothing
# and send nothing elsewhere, and no other site may frame it.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


def dashboard_dir() -> Path | None:
    """The built dashboard in the package, or None when it is missing (a broken install)."""
    return WEB_DIR if (WEB_DIR / "index.html").is_file() else None


def is_page_path(path: str) -> bool:
    """Paths of the dashboard's public files (``/`` and ``/assets/...``)."""
    return path == "/" or path.startswith(ASSETS_PREFIX)


async def index(request: Request) -> Response:
    root = dashboard_dir()
    if root is None:
        raise ApiError(
            404,
            "The web dashboard is not in this installation (colibri/_web/index.html is "
            "missing); the APIs under /v1 work without it",
            code="not_found",
        )
    return FileResponse(root / "index.html", headers=_PAGE_HEADERS)


class _Assets(StaticFiles):
    """Hashed build files: immutable, so a browser asks for each once."""

    def file_response(self, full_path, stat_result, scope: Scope, status_code: int = 200):
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers["Cache-Control"] = "public, max-age=31536000, immutable"
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def routes() -> list[BaseRoute]:
    out: list[BaseRoute] = [Route("/", index, methods=["GET"])]
    root = dashboard_dir()
    if root is not None and (root / "assets").is_dir():
        out.append(Mount("/assets", app=_Assets(directory=root / "assets"), name="assets"))
    return out
