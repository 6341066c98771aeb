"""GET /docs: Swagger UI over the app's OpenAPI schema, its script, style and icon served by the server itself
from the copy of swagger-ui's dist files that the fastapi-offline package ships. FastAPI's own page loads them
from a CDN, and so is a blank page on a machine without internet access, where a server often runs."""
from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request

DOCS_ROUTE = "/docs"
ASSETS_ROUTE = "/docs/assets"            # public like /docs: Authentication guards /v1/ only
SWAGGER_JS, SWAGGER_CSS, FAVICON = "swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"


def swagger_assets() -> Path:
    """The folder of swagger-ui's files inside the installed fastapi-offline package."""
    return Path(str(files("fastapi_offline") / "static"))


def install_docs(app: FastAPI) -> None:
    """Serve DOCS_ROUTE and its assets under ASSETS_ROUTE. The app must be made with docs_url=None, so that
    FastAPI does not add its CDN page at the same path."""
    openapi_url = app.openapi_url
    if openapi_url is None:
        raise ValueError("the docs page shows the app's OpenAPI schema: the app must serve one")
    app.mount(ASSETS_ROUTE, StaticFiles(directory=swagger_assets()), name="docs-assets")

    async def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")       # behind a proxy that serves the app under a prefix
        return get_swagger_ui_html(openapi_url=f"{root}{openapi_url}", title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{root}{ASSETS_ROUTE}/{SWAGGER_JS}",
                                   swagger_css_url=f"{root}{ASSETS_ROUTE}/{SWAGGER_CSS}",
                                   swagger_favicon_url=f"{root}{ASSETS_ROUTE}/{FAVICON}",
                                   swagger_ui_parameters=app.swagger_ui_parameters)

    # A plain Starlette route (not @app.get): it answers HEAD as well, as FastAPI's own docs route did.
    app.add_route(DOCS_ROUTE, docs, methods=["GET"], include_in_schema=False)
