"""The package's layers: no module imports a layer above its own (docs/architecture.md).

Read from the source with ``ast``, imports inside functions included, so a call-time import
cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kernel_env

PACKAGE = Path(kernel_env.__file__).parent

# Lowest first. A module may import its own layer and those below. A name ending in "." is a
# package: every module under it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "errors",
            "text",
            "answers",
            "outputs",
            "streaming",
            "models",
            "kernel_side",
            "rubric",
            "llm",
        ),
    ),
    ("kernel", ("kernel", "kernel.", "pool")),
    (
        "episode",
        ("hostcalls", "record", "recursion", "environment", "notebook", "archive", "checker"),
    ),
    ("agent", ("agent",)),
    ("client", ("client", "remote", "replay")),
    ("server", ("server", "server.")),
    ("integrations", ("integrations", "integrations.")),
    # Episodes over a Ray cluster: a server per node (server) and the client that places them.
    ("ray", ("ray", "ray.")),
    ("cli", ("cli", "__main__")),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _find_layer(module: str) -> int | None:
    """The index of ``module``'s layer (``module`` relative to the package), if it has one."""
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            if module == name or (name.endswith(".") and module.startswith(name)):
                return index
    return None


def _layer(module: str) -> int:
    index = _find_layer(module)
    if index is None:
        raise LookupError(f"kernel_env.{module} is in no layer: add it to LAYERS in {__name__}")
    return index


def _imports(path: Path) -> set[str]:
    """The kernel_env modules ``path`` imports, relative to the package; the root package
    itself (its ``__version__``, ``__file__``) is left out: it defines names and loads nothing."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "kernel_env":  # `from kernel_env import answers` is a module
                names = [
                    f"kernel_env.{alias.name}"
                    for alias in node.names
                    if (PACKAGE / f"{alias.name}.py").exists() or (PACKAGE / alias.name).is_dir()
                ]
            else:
                names = [node.module]
        else:
            continue
        found.update(n.removeprefix("kernel_env.") for n in names if n.startswith("kernel_env."))
    return found


def test_every_module_has_a_layer() -> None:
    """A new module is placed in a layer on purpose, not by accident."""
    modules = [_module_name(path) for path in sorted(PACKAGE.rglob("*.py"))]
    unplaced = [m for m in modules if m and _find_layer(m) is None]
    assert unplaced == [], f"add these to LAYERS in {__name__}: {unplaced}"
    assert "streaming" in modules  # the walk found the package's modules


def test_no_module_imports_a_layer_above_its_own() -> None:
    """The import graph only points down (or within a layer)."""
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if not module:
            continue
        for target in sorted(_imports(path)):
            if _layer(target) > _layer(module):
                upward.append(
                    f"kernel_env.{module} imports kernel_env.{target} "
                    f"({LAYERS[_layer(module)][0]} -> {LAYERS[_layer(target)][0]})"
                )
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The reader finds call-time imports (the kind that hid the episode layer's dependency
    on the client and the agent)."""
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from kernel_env.client import AsyncKernelEnv\n"
        "    from kernel_env import agent\n"
    )
    assert _imports(module) == {"client", "agent"}
