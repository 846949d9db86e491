"""Every reference a newcomer follows resolves: docs paths, markdown links, acceptance ids."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("kernel_env", "tests", "benchmarks", "examples", "scripts", "deploy")

# docs/<page>.md written as a path (not the tail of a URL such as https://x/docs/y.md)
DOC_PATH = re.compile(r"(?<![\w/.:-])docs/[\w./-]+\.md\b")
# [text](target): a relative link (not a URL, not an in-page anchor)
LINK = re.compile(r"\[[^\]]*\]\((?!https?:|mailto:|#)([^)\s#]+)(?:#[^)]*)?\)")
# an acceptance id as cited: F3, B1, S5, P12 (a letter, then a number; a word of its own)
ACCEPTANCE_ID = re.compile(r"(?<![\w-])([FBSP])(\d{1,2})(?![\w-])")
DEFINED_ID = re.compile(r"^\| ([FBSP]\d{1,2}) \|", re.M)
# a measured time as the code's comments once cited them: "~5 ms", "0.17 ms of", "0.2 s of CPU"
MEASURED_TIME = re.compile(
    r"~ ?\d[\d.]* ?(?:ms|s|µs)\b|\d[\d.]* ?ms (?:of|a|per|against|instead|less|sooner)\b"
    r"|\d[\d.]* ?s of CPU"
)


def _text_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in SOURCES:
        files += sorted(
            p
            for p in (ROOT / folder).rglob("*")
            if p.suffix in (".py", ".md", ".sh", ".yaml")
            and p.is_file()
            and "node_modules" not in p.parts  # npm's packages (tests/node), not ours
        )
    return [p for p in files if p != Path(__file__).resolve()]  # this file's examples


def _markdown_files() -> list[Path]:
    return [p for p in _text_files() if p.suffix == ".md"] + [ROOT / "notebooks" / "README.md"]


def test_every_docs_path_exists() -> None:
    """A `docs/<page>.md` named in code, tests, benchmarks or docs is a file in docs/."""
    missing = [
        f"{path.relative_to(ROOT)}: {ref}"
        for path in _text_files()
        for ref in DOC_PATH.findall(path.read_text(errors="replace"))
        if not (ROOT / ref).is_file()
    ]
    assert missing == []


def test_every_relative_markdown_link_resolves() -> None:
    """Relative links in the README, docs/ and the other READMEs point at files that exist."""
    broken = [
        f"{path.relative_to(ROOT)}: {target}"
        for path in _markdown_files()
        for target in LINK.findall(path.read_text())
        if not (path.parent / target).exists()
    ]
    assert broken == []


def test_every_cited_acceptance_id_is_defined() -> None:
    """An id such as F3 or P1 cited in the code, tests or benchmarks is a row of
    docs/acceptance.md, which says what it means and where it is checked."""
    defined = set(DEFINED_ID.findall((ROOT / "docs" / "acceptance.md").read_text()))
    cited = {
        f"{letter}{number}": path.relative_to(ROOT)
        for folder in ("kernel_env", "tests", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != Path(__file__).resolve()
        for letter, number in ACCEPTANCE_ID.findall(path.read_text())
    }
    assert {ident: str(path) for ident, path in cited.items() if ident not in defined} == {}
    assert len(cited) > 20  # the pattern still finds the ids the code cites


def test_no_measured_time_in_the_code() -> None:
    """The code says why; the figures that decided it live in benchmarks/README.md ("The
    figures behind the code's choices"), where a run on another machine can correct them."""
    cited = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sorted((ROOT / "kernel_env").rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if MEASURED_TIME.search(line)
    ]
    assert cited == []


def test_the_checks_see_broken_references(tmp_path: Path) -> None:
    """The patterns catch what they are for, and pass over URLs and plain words."""
    assert DOC_PATH.findall("see docs/nowhere.md, https://x.org/docs/a.md") == ["docs/nowhere.md"]
    assert LINK.findall("[a](missing.md) [b](https://x.org) [c](#top) [d](ok.md#part)") == [
        "missing.md",
        "ok.md",
    ]
    assert MEASURED_TIME.findall(
        "costs ~5 ms; 0.17 ms of it; ~0.4 s; 0.2 s of CPU; a 5 ms default; timeout=1.5"
    ) == ["~5 ms", "0.17 ms of", "~0.4 s", "0.2 s of CPU"]
    assert ACCEPTANCE_ID.findall("F3: killed; (P12) and S5, not PF3 or F3a or x-F1") == [
        ("F", "3"),
        ("P", "12"),
        ("S", "5"),
    ]


# -- the architecture's trees ----------------------------------------------------------------

TREE_BRANCH = re.compile(r"^((?:│   |    )*)(?:├── |└── )(\S+)(.*)$")
PY_NAME = re.compile(r"\b\w+\.py\b")
# Not drawn: E2B's generated protocol code and the web view's static files.
UNDRAWN = ("server/e2b/proto/", "server/webview/")


def tree_modules(block: str) -> set[str]:
    """The ``.py`` paths a text tree names: a file on a branch of its own, or a folder's
    modules listed on its branch and the lines under it that continue it."""
    lines = block.splitlines()
    root, found = lines[0].split()[0], set()
    stack: list[str] = [root]
    folder_line = False
    for line in lines[1:]:
        branch = TREE_BRANCH.match(line)
        if branch is None:  # a continuation of the line above
            if folder_line:
                found.update(stack[-1] + name for name in PY_NAME.findall(line))
            continue
        depth = len(branch.group(1)) // 4 + 1
        del stack[depth:]
        name, rest = branch.group(2), branch.group(3)
        folder_line = name.endswith("/")
        if folder_line:
            stack.append(stack[-1] + name)
            found.update(stack[-1] + module for module in PY_NAME.findall(rest))
        else:
            found.add(stack[-1] + name)
    return {path for path in found if path.endswith(".py")}


def _trees(page: str) -> list[str]:
    return re.findall(r"```text\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)


def test_the_architectures_trees_are_the_package() -> None:
    """docs/architecture.md draws every module of the package (the layout's tree, and the
    server's under Doors), and nothing that is not there."""
    drawn = set().union(*(tree_modules(block) for block in _trees("architecture.md")))
    drawn = {p.removeprefix("kernel_env/") for p in drawn}
    package = ROOT / "kernel_env"
    actual = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if not str(p.relative_to(package)).startswith(UNDRAWN)
    }
    undrawn_inits = {p for p in actual if p.endswith("/__init__.py")} - drawn
    assert sorted(actual - undrawn_inits - drawn) == []
    assert sorted(drawn - actual) == []


def test_the_tree_reader_sees_files_and_folders() -> None:
    """The tree reader takes files on branches, folders' listed modules, and their
    continuation lines; a planted tree with a missing module shows it."""
    block = (
        "pkg/\n"
        "├── a.py        one\n"
        "├── sub/        x.py, y.py (about z.txt)\n"
        "│               w.py\n"
        "│   └── deep.py  three\n"
        "└── b.py        two\n"
    )
    assert tree_modules(block) == {
        "pkg/a.py",
        "pkg/sub/x.py",
        "pkg/sub/y.py",
        "pkg/sub/w.py",
        "pkg/sub/deep.py",
        "pkg/b.py",
    }
