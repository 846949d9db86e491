"""``GET /api/kernelspecs`` and its resources: every kernel the server serves (``--kernels``)
as a kernelspec, in Jupyter Server's model (``name``, ``spec``, ``resources``).

A spec says what a client shows and how it talks to the kernel (``display_name``,
``language``, ``interrupt_mode``), never how it starts: ``argv`` is empty and ``env`` is
``{}``, since the server starts it, sandboxed, from its pool. ``metadata.kernel_env`` names
the helpers the kernel has.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response

from kernel_env.errors import UnknownSession

__all__ = ["DEFAULT_KERNEL", "available", "kernelspec", "kernelspecs", "language_of", "resource"]

DEFAULT_KERNEL = "python3"
_LOGO = "logo-svg.svg"
_DISPLAY = {"python3": "Python 3", "ir": "R", "bash": "Bash", "deno": "Deno"}


def available(request: HTTPConnection) -> dict[str, dict[str, Any]]:
    """The kernels served: name -> language and helpers (the menu's description)."""
    menu: dict[str, Any] = request.app.state.runtime.kernels.describe()
    return dict(menu["available"])


def language_of(request: HTTPConnection, name: str) -> str:
    return str(available(request).get(name, {}).get("language", "python"))


def _model(name: str, described: dict[str, Any]) -> dict[str, Any]:
    language = described.get("language", name)
    return {
        "name": name,
        "spec": {
            "argv": [],
            "display_name": f"{_DISPLAY.get(name, name)} (kernel_env, sandboxed)",
            "language": language,
            "interrupt_mode": "signal",
            "env": {},
            "metadata": {"kernel_env": {"helpers": described.get("helpers", []), "episode": True}},
        },
        "resources": {"logo-svg": f"/kernelspecs/{name}/{_LOGO}"},
    }


def _default(names: list[str]) -> str:
    return DEFAULT_KERNEL if DEFAULT_KERNEL in names or not names else sorted(names)[0]


async def kernelspecs(request: Request) -> JSONResponse:
    served = available(request)
    specs = {name: _model(name, described) for name, described in sorted(served.items())}
    return JSONResponse({"default": _default(list(served)), "kernelspecs": specs})


async def kernelspec(request: Request) -> JSONResponse:
    name = request.path_params["name"]
    described = available(request).get(name)
    if described is None:
        raise UnknownSession(f"Kernel spec {name} not found")
    return JSONResponse(_model(name, described))


async def resource(request: Request) -> Response:
    """A kernelspec's resource file: its logo."""
    name, path = request.path_params["name"], request.path_params["resource"]
    if name not in available(request) or path != _LOGO:
        raise UnknownSession(f"Kernel spec resource {name}/{path} not found")
    logo = resources.files(__package__).joinpath("resources", _LOGO).read_bytes()
    return Response(logo, media_type="image/svg+xml")
