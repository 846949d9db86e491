"""The episode as an HTML page (``GET /sessions/{id}/notebook.html``, ``kernel-env export
--html``) holds a cell's output, never runs it: a cell displays a script, an ``onerror=``
handler and a ``javascript:`` link, and the page keeps its table, image and traceback but none
of those, carries a Content-Security-Policy with no script source, and fetches nothing. The
pages are checked as text and in Debian's chromium (Selenium, every host but loopback
unresolvable), opened from disk as a user opens a shared file."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import nbformat
import pytest
from browser import chromium, png
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output, new_raw_cell
from serverkit import small_settings, thread_server

pytestmark = pytest.mark.integration  # kernels, servers, a browser

from selenium.webdriver.common.by import By  # noqa: E402

TOKEN = "notebook-html-token-5d2"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PWNED = "document.title='pwned'"


PNG = png()
ATTACK_HTML = (
    "<table><thead><tr><th>name</th></tr></thead>"
    "<tbody><tr><td>table-cell-ok</td></tr></tbody></table>"
    f"<script>{PWNED}</script>"
    f'<img src=x onerror="{PWNED}">'
    f'<a id=js href="javascript:{PWNED}">click</a>'
)
# One cell: the attack as HTML, an image (with a handler smuggled in its metadata), JavaScript
# and Markdown outputs; then a plain print and an error, for the traceback.
CELL = f"""import base64
from IPython.display import HTML, Image, display
display(HTML({ATTACK_HTML!r}))
display(Image(data=base64.b64decode({PNG!r})))
display({{"image/png": {PNG!r}}}, raw=True,
        metadata={{"image/png": {{"width": "4 onload={PWNED}"}}}})
display({{"application/javascript": {PWNED!r}, "text/plain": "js"}}, raw=True)
display({{"text/markdown": "[md](javascript:{PWNED})", "text/plain": "md"}}, raw=True)
print("plain text out")
"""


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str]]:
    """A server with an episode that ran the attack cell and a failing one; (url, session)."""
    with thread_server(small_settings(token=TOKEN, sandbox="none", pool_size=0)) as url:
        reply = httpx.post(
            f"{url}/reset", json={"task_prompt": "show it"}, headers=AUTH, timeout=60
        )
        session = reply.headers["X-Session-Id"]
        for code in (CELL, "1 / 0"):
            body = {"action": {"code": code}}
            headers = {**AUTH, "X-Session-Id": session}
            assert httpx.post(f"{url}/step", json=body, headers=headers, timeout=60).is_success
        recorded = httpx.get(f"{url}/sessions/{session}/notebook", headers=AUTH, timeout=60).text
        attacks = (
            f"<script>{PWNED}",
            "onerror=",
            "4 onload=",
            "javascript:",
            "application/javascript",
        )
        for attack in attacks:
            assert attack in recorded  # the episode holds every attack the page must defuse
        yield url, session


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = chromium()
    yield driver
    driver.quit()


class _Elements(HTMLParser):
    """Every start tag of a page with its attributes, and its <title>."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.title = ""
        self._in_title = False
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))
        self._in_title = tag == "title"

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
            self._in_title = False


def assert_inert(page: str) -> None:
    """Nothing in ``page`` can run or fetch, and its policy says so."""
    elements = _Elements(page)
    names = {tag for tag, _ in elements.tags}
    assert not names & {"script", "iframe", "object", "embed", "link", "base", "form"}, names
    assert "<script" not in page.lower()
    for tag, attrs in elements.tags:
        handlers = [name for name in attrs if name.startswith("on")]
        assert not handlers, (tag, attrs)
        assert not any("javascript:" in v.lower().replace(" ", "") for v in attrs.values()), attrs
        for name in ("src", "srcset", "poster", "data"):
            assert attrs.get(name, "data:").startswith("data:"), (tag, attrs)  # fetches nothing
    assert "url(http" not in page and "@import" not in page
    policies = [
        a["content"] for _, a in elements.tags if a.get("http-equiv") == "Content-Security-Policy"
    ]
    assert len(policies) == 1, policies
    policy = policies[0]
    assert "default-src 'none'" in policy and "script-src" not in policy


def assert_rich_outputs_kept(page: str) -> None:
    assert "<td>table-cell-ok</td>" in page and "<th>name</th>" in page
    images = [a for tag, a in _Elements(page).tags if tag == "img"]
    assert any(a.get("src", "").startswith("data:image/png;base64,") for a in images), images
    assert "plain text out" in page and "ZeroDivisionError" in page


def assert_nothing_runs_in_chromium(browser: Any, path: Path) -> None:
    """Open ``path`` from disk: the title stays the page's own, the image shows, and the link
    (if it survived at all) does nothing when clicked."""
    title = _Elements(path.read_text()).title
    browser.get(path.resolve().as_uri())
    images = browser.find_elements(By.CSS_SELECTOR, 'img[src^="data:image/png"]')
    assert images and all(img.get_property("naturalWidth") == 4 for img in images)
    assert "table-cell-ok" in browser.find_element(By.TAG_NAME, "table").text
    assert browser.title == title and "pwned" not in title
    for link in browser.find_elements(By.ID, "js"):
        link.click()
    assert browser.title == title


def test_served_page_keeps_outputs_and_runs_nothing(
    served: tuple[str, str], tmp_path: Path, browser: Any
) -> None:
    """GET /sessions/{id}/notebook.html: a CSP that allows no script, in a sandbox, as a
    header; the body holds the table, the image and the traceback, and no script, handler or
    javascript: URL; saved and opened in chromium, nothing in it runs."""
    url, session = served
    response = httpx.get(f"{url}/sessions/{session}/notebook.html", headers=AUTH, timeout=60)
    assert response.status_code == 200
    saved = tmp_path / "served.html"
    saved.write_text(response.text)
    assert_nothing_runs_in_chromium(browser, saved)
    assert_inert(response.text)
    assert_rich_outputs_kept(response.text)
    policy = response.headers.get("content-security-policy", "")
    directives = [d.strip() for d in policy.split(";")]
    assert "default-src 'none'" in directives and "sandbox" in directives
    assert not [d for d in directives if d.startswith("script-src")]
    assert response.headers["x-content-type-options"] == "nosniff"


def test_cli_export_html_keeps_outputs_and_runs_nothing(
    served: tuple[str, str], tmp_path: Path, browser: Any
) -> None:
    """`kernel-env export SESSION --html` (the client's export path) writes the same inert
    page next to the notebook."""
    url, session = served
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "kernel_env",
            "export",
            session,
            "--url",
            url,
            "--html",
            "-o",
            str(tmp_path / "run.ipynb"),
        ],
        env={**os.environ, "KERNEL_ENV_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert_nothing_runs_in_chromium(browser, tmp_path / "run.html")
    page = (tmp_path / "run.html").read_text()
    assert_inert(page)
    assert_rich_outputs_kept(page)


def test_a_hostile_notebook_file_becomes_an_inert_page(tmp_path: Path, browser: Any) -> None:
    """`kernel-env export x.ipynb --html` on a notebook written by someone else: active
    output kinds (JavaScript, Mermaid, widgets), an unquoted-attribute injection through image
    metadata, and scripts, handlers and javascript: links in Markdown and raw cells all end up
    as inert text or nothing."""
    nb = new_notebook(
        cells=[
            new_markdown_cell(f"# Title\n\n[md](javascript:{PWNED}) <script>{PWNED}</script>"),
            new_raw_cell(f'<img src=x onerror="{PWNED}">', metadata={"raw_mimetype": "text/html"}),
            new_code_cell(
                "x",
                execution_count=1,
                outputs=[
                    new_output("display_data", data={"text/html": ATTACK_HTML}),
                    new_output(
                        "display_data",
                        data={"image/png": PNG},
                        metadata={"image/png": {"width": f"4 onload={PWNED}"}},
                    ),
                    new_output(
                        "display_data", data={"text/vnd.mermaid": f'<img src=x onerror="{PWNED}">'}
                    ),
                    new_output("display_data", data={"application/javascript": PWNED}),
                    new_output("stream", name="stdout", text="plain text out"),
                    new_output(
                        "error",
                        ename="ZeroDivisionError",
                        evalue="division by zero",
                        traceback=["ZeroDivisionError: division by zero"],
                    ),
                ],
            ),
        ],
        metadata={"widgets": {"application/vnd.jupyter.widget-state+json": {"state": {}}}},
    )
    source = tmp_path / "hostile.ipynb"
    nbformat.write(nb, source, version=4)
    cli = subprocess.run(
        [sys.executable, "-m", "kernel_env", "export", str(source), "--html"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert_nothing_runs_in_chromium(browser, tmp_path / "hostile.html")
    page = (tmp_path / "hostile.html").read_text()
    assert_inert(page)
    assert_rich_outputs_kept(page)
