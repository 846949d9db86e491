"""The web view and /docs in a real browser: Debian's chromium, driven by Selenium, against
the real server on loopback, with every other host unresolvable (no network).

``KERNEL_ENV_SCREENSHOTS=1`` also saves the pages as PNGs under docs/images/ (for the README).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import chromium, png
from fake_openai import FakeOpenAI
from jupyterkit import gateway_client
from serverkit import small_settings, thread_server

from kernel_env.languages.catalog import installed_kernels

pytestmark = pytest.mark.integration  # kernels, servers or other processes

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

TOKEN = "web-view-token-81c"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHOTS = Path(__file__).resolve().parent.parent / "docs" / "images"


PNG = png()


R = "ir" in installed_kernels()  # make kernels installs it


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    kernels = ("python3", "ir") if R else ("python3",)
    settings = small_settings(token=TOKEN, sandbox="none", max_sessions=8, kernels=kernels)
    with thread_server(settings) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = chromium("--window-size=1400,1000")
    yield driver
    driver.quit()


def _until(driver: Any, predicate: Callable[[Any], Any], timeout: float = 30) -> Any:
    """``predicate``, polled until true; an element the page redrew while it was read is
    another poll, not a failure."""
    from selenium.common.exceptions import StaleElementReferenceException

    wait = WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException]
    )
    return wait.until(predicate)


def _reset(server: str, task: str) -> str:
    reply = httpx.post(f"{server}/reset", json={"task_prompt": task}, headers=AUTH, timeout=60)
    return reply.headers["X-Session-Id"]


def _step(server: str, session: str, code: str) -> dict[str, Any]:
    headers = {**AUTH, "X-Session-Id": session}
    body = {"action": {"code": code}}
    return httpx.post(f"{server}/step", json=body, headers=headers, timeout=60).json()


def _open(browser: Any, server: str) -> None:
    browser.get(f"{server}/web")
    browser.execute_script("sessionStorage.clear()")  # each test logs in afresh
    browser.refresh()
    login = _until(browser, lambda d: d.find_element(By.ID, "login"))
    _until(browser, lambda d: login.is_displayed())
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()


def _select(browser: Any, session: str) -> None:
    """Click the session's row; the list re-renders as sessions change, so a row found may
    be replaced before the click lands: found and clicked again until the click takes."""
    _until(
        browser,
        lambda d: d.find_element(By.CSS_SELECTOR, f'tr[data-session="{session}"]').click() or True,
    )


def _shot(browser: Any, name: str) -> None:
    if os.environ.get("KERNEL_ENV_SCREENSHOTS"):
        SHOTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(SHOTS / name))


def test_web_lists_live_sessions_and_streams_a_running_cell(server: str, browser: Any) -> None:
    first, second = _reset(server, "alpha: count the words"), _reset(server, "beta: find it")
    _open(browser, server)
    listed = _until(
        browser,
        lambda d: (
            len(r := d.find_elements(By.CSS_SELECTOR, "#sessions tr")) >= 2
            and " ".join(row.text for row in r)
        ),
    )
    assert "alpha: count the words" in listed and "beta: find it" in listed
    _select(browser, first)
    running = threading.Thread(
        target=_step,
        args=(server, first, "import time\nprint('first line')\ntime.sleep(4)\nprint('second')"),
    )
    running.start()
    try:
        outputs = _until(
            browser,
            lambda d: (
                "first line" in d.find_element(By.CSS_SELECTOR, ".cell .outputs").text
                and d.find_element(By.CSS_SELECTOR, ".cell .outputs")
            ),
        )
        assert running.is_alive() and "second" not in outputs.text  # shown while it runs
        assert browser.find_elements(By.CSS_SELECTOR, ".cell.running")
        _shot(browser, "web-view.png")
    finally:
        running.join(timeout=60)
    _until(browser, lambda d: "second" in d.find_element(By.CSS_SELECTOR, ".cell .outputs").text)
    assert second in browser.page_source


@pytest.mark.skipif(not R, reason="no R kernel here: make kernels installs it")
def test_an_r_episode_shows_its_cells_and_outputs(server: str, browser: Any) -> None:
    """Another language's episode is shown as a Python one is: its cells, and its outputs
    in their richest form (IRkernel's value as HTML, in its frame)."""
    body = {"task_prompt": "in R", "kernel_name": "ir"}
    reply = httpx.post(f"{server}/reset", json=body, headers=AUTH, timeout=60)
    session = reply.headers["X-Session-Id"]
    assert "error" not in _step(server, session, "x <- 1:10; sum(x)")
    _open(browser, server)
    _select(browser, session)
    cell = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#cells .cell"))
    assert "x <- 1:10; sum(x)" in cell.text
    frame = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#cells iframe.html"))
    browser.switch_to.frame(frame)
    try:
        _until(browser, lambda d: d.find_element(By.TAG_NAME, "body").text.strip() == "55")
    finally:
        browser.switch_to.default_content()


def test_images_and_html_render(server: str, browser: Any) -> None:
    session = _reset(server, "rich outputs")
    code = (
        "import base64\nfrom IPython.display import HTML, Image, display\n"
        f"display(Image(data=base64.b64decode('{PNG}')))\n"
        "display(HTML('<table><tr><td id=\"cell-x\">cell-x</td></tr></table>'))\n"
    )
    _step(server, session, code)
    _open(browser, server)
    _select(browser, session)
    image = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#cells img.figure"))
    _until(browser, lambda d: d.execute_script("return arguments[0].naturalWidth", image) == 4)
    frame = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#cells iframe.html"))
    browser.switch_to.frame(frame)
    try:
        assert _until(browser, lambda d: d.find_element(By.ID, "cell-x")).text == "cell-x"
    finally:
        browser.switch_to.default_content()


def test_html_frames_fit_their_output(server: str, browser: Any) -> None:
    """A one-line HTML output gets a frame of about its height, not a mostly blank box; a
    tall one is capped (it scrolls inside its frame)."""
    session = _reset(server, "frames")
    code = (
        "from IPython.display import HTML, display\n"
        "display(HTML('<b>one line</b>'))\n"
        "display(HTML('<div style=\"height: 3000px\">tall</div>'))\n"
    )
    _step(server, session, code)
    _open(browser, server)
    _select(browser, session)
    frames = _until(
        browser,
        lambda d: (
            (f := d.find_elements(By.CSS_SELECTOR, "#cells iframe.html")) and len(f) == 2 and f
        ),
    )
    small, tall = _until(
        browser,
        lambda d: (h := [f.size["height"] for f in frames]) and h[0] < 60 and h[1] >= 590 and h,
    )
    assert small > 10 and tall <= 610


def test_a_link_opens_one_session(server: str, browser: Any) -> None:
    """/web#session=ID shows that session's episode, and the episode's link is that URL."""
    session = _reset(server, "linked: one session")
    _step(server, session, "print('linked output')")
    _open(browser, server)
    browser.get(f"{server}/web#session={session}")
    _until(browser, lambda d: "linked output" in d.find_element(By.ID, "cells").text)
    assert browser.find_element(By.ID, "title").text == "linked: one session"
    link = browser.find_element(By.ID, "session-link").get_attribute("href")
    assert link == f"{server}/web#session={session}"


def test_a_cells_script_cannot_reach_the_page(server: str, browser: Any) -> None:
    """HTML from a cell tries to read the page's token and cookie and to change the page: it
    runs in a sandboxed frame without scripts, so none of it happens."""
    session = _reset(server, "attack")
    attack = (
        "<script>"
        "try { parent.document.body.setAttribute('data-pwned', "
        "parent.sessionStorage.getItem('kernel_env_token') + document.cookie) } catch (e) {}"
        "try { top.document.title = 'pwned' } catch (e) {}"
        "try { parent.window.pwned = true } catch (e) {}"
        "document.write('<p id=ran>script ran</p>')"
        "</script><p id=benign>benign</p>"
    )
    _step(server, session, f"from IPython.display import HTML, display\ndisplay(HTML({attack!r}))")
    _open(browser, server)
    browser.execute_script("document.cookie = 'kernel_env_probe=secret'")
    _select(browser, session)
    frame = _until(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#cells iframe.html"))
    browser.switch_to.frame(frame)
    try:
        assert _until(browser, lambda d: d.find_element(By.ID, "benign")).text == "benign"
        assert not browser.find_elements(By.ID, "ran")  # no script ran in the frame at all
    finally:
        browser.switch_to.default_content()
    assert "allow-scripts" not in (frame.get_attribute("sandbox") or "")
    time.sleep(0.5)
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-pwned") is None
    assert browser.title != "pwned" and browser.execute_script("return window.pwned") is None


def test_docs_render_the_operations_with_no_network(server: str, browser: Any) -> None:
    browser.get(f"{server}/docs")
    try:
        operations = _until(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock"), 60)
    except TimeoutException:
        pytest.fail(f"Swagger UI did not render: {browser.page_source[:500]}")
    paths = " ".join(o.text for o in operations)
    assert "/reset" in paths and "/step" in paths
    _shot(browser, "docs-offline.png")


def test_the_list_shows_a_page_of_sessions_and_turns_to_the_next(browser: Any) -> None:
    """Of 150 sessions the list shows the first 100 and says so; "next" shows the other 50,
    "previous" the first page again."""
    from kernel_env.kernel.scripted import ScriptedSource
    from kernel_env.server import create_app

    settings = small_settings(token=TOKEN, max_sessions=150, pool_size=0, claim_ttl=0)
    app = create_app(settings, kernel_factory=ScriptedSource())
    with thread_server(settings, app) as url, httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(150):
            assert client.post("/reset", json={}, headers=AUTH).status_code == 200
        _open(browser, url)
        status = browser.find_element(By.ID, "status")
        rows = lambda d: d.find_elements(By.CSS_SELECTOR, "#sessions tr")  # noqa: E731
        _until(browser, lambda d: status.text == "100 of 150 session(s)" and len(rows(d)) == 100)
        assert not browser.find_element(By.ID, "previous-page").is_displayed()
        first = rows(browser)[0].get_attribute("data-session")  # its text has a running clock
        browser.find_element(By.ID, "next-page").click()
        _until(browser, lambda d: status.text == "50 of 150 session(s)" and len(rows(d)) == 50)
        assert not browser.find_element(By.ID, "next-page").is_displayed()
        browser.find_element(By.ID, "previous-page").click()
        _until(
            browser,
            lambda d: len(rows(d)) == 100 and rows(d)[0].get_attribute("data-session") == first,
        )


def test_an_ended_episode_is_listed_and_opens_read_only(tmp_path: Path, browser: Any) -> None:
    """With an episode store, an episode whose session closed is listed under "Ended
    episodes" and opens from its stored notebook, outputs included; its download is the
    stored notebook."""
    settings = small_settings(token=TOKEN, sandbox="none", episodes=str(tmp_path))
    with thread_server(settings) as url:
        session = _reset(url, "ended: kept by the store")
        _step(url, session, "print('kept output')")
        _step(url, session, "FINAL('done')")
        closed = httpx.delete(f"{url}/sessions/{session}", headers=AUTH, timeout=30)
        assert closed.status_code == 204
        [kept] = httpx.get(f"{url}/episodes", headers=AUTH, timeout=10).json()["episodes"]
        _open(browser, url)
        row = _until(
            browser,
            lambda d: d.find_element(By.CSS_SELECTOR, f'tr[data-episode="{kept["episode_id"]}"]'),
        )
        assert "ended: kept by the store" in row.text and "done" in row.text
        row.click()
        _until(browser, lambda d: "kept output" in d.find_element(By.ID, "cells").text)
        assert browser.find_element(By.ID, "title").text == "ended: kept by the store"
        assert not browser.find_element(By.ID, "download-html").is_displayed()
        link = browser.find_element(By.ID, "session-link").get_attribute("href")
        assert link == f"{url}/web#episode={kept['episode_id']}"
        browser.get(f"{url}/web#session={session}")  # the closed session's own link
        _until(browser, lambda d: "has ended" in d.find_element(By.ID, "cells").text)


# -- JupyterLab 4 on the Jupyter door ------------------------------------------------------

LAB_TOKEN = "jupyterlab-token-5hQz"
LLM_ANSWER = "hello from the fake model"
NOTEBOOK = {
    "cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "x = 6 * 7\nprint('x is', x)"},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "print(llm_query('hi'))"},
    ],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                "language": "python"}},
    "nbformat": 4, "nbformat_minor": 5,
}  # fmt: skip
# The notebook's kernel, as JupyterLab's own application object sees it (exposed by
# --LabApp.expose_app_in_browser): its status, or what is not there yet.
KERNEL_STATUS = """
const app = window.jupyterapp;
const widget = app && app.shell.currentWidget;
const kernel = widget && widget.sessionContext && widget.sessionContext.session
  && widget.sessionContext.session.kernel;
return kernel ? [kernel.status, kernel.id] : [null, null];
"""


def test_jupyterlab_runs_a_notebook_in_a_kernel_env_kernel(tmp_path: Path, browser: Any) -> None:
    """JupyterLab 4 with ``--gateway-url`` at the server opens a notebook in a kernel_env
    kernel and runs it: a cell's output, a matplotlib figure, ``llm_query`` answered by the
    server's model. A second tab shows the same episode, those cells in it, in ``/web``."""
    (tmp_path / "demo.ipynb").write_text(json.dumps(NOTEBOOK))
    with FakeOpenAI(lambda body: LLM_ANSWER) as llm:
        settings = small_settings(token=TOKEN, max_sessions=4, step_timeout=60,
                                  llm_base_url=llm.url, llm_model="fake")  # fmt: skip
        with (
            thread_server(settings) as url,
            gateway_client("jupyterlab", url, TOKEN, tmp_path, own_token=LAB_TOKEN,
                                      extra=("--LabApp.expose_app_in_browser=True",)) as lab,
        ):  # fmt: skip
            kernel_id, outputs = _run_all_in_jupyterlab(browser, f"{lab}/lab/tree/demo.ipynb")
            assert "x is 42" in outputs and LLM_ANSWER in " ".join(outputs)
            _shot(browser, "jupyterlab.png")
            lab_tab = browser.current_window_handle
            browser.switch_to.new_window("tab")
            try:
                _shows_the_episode_in_web(browser, url, kernel_id)
            finally:
                browser.close()
                browser.switch_to.window(lab_tab)


def _run_all_in_jupyterlab(browser: Any, notebook: str) -> tuple[str, list[str]]:
    """Open ``notebook``, run all its cells once its kernel is idle, wait for their outputs
    (the figure drawn); the kernel's id, and the outputs' text."""
    browser.get(f"{notebook}?token={LAB_TOKEN}")
    _, kernel_id = _until(
        browser, lambda d: (s := d.execute_script(KERNEL_STATUS))[0] == "idle" and s, 120
    )
    browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    outputs = _until(
        browser,
        lambda d: (
            (t := [o.text for o in d.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")])
            and LLM_ANSWER in " ".join(t)
            and t
        ),
        90,
    )
    figure = browser.find_element(By.CSS_SELECTOR, ".jp-OutputArea-output img")
    assert _until(browser, lambda d: d.execute_script("return arguments[0].naturalWidth", figure))
    return str(kernel_id), outputs


def _shows_the_episode_in_web(browser: Any, url: str, kernel_id: str) -> None:
    sessions = httpx.get(f"{url}/sessions", headers=AUTH, timeout=10).json()["sessions"]
    [session] = [s["session_id"] for s in sessions if s["kernel_id"] == kernel_id]
    _open(browser, url)
    _select(browser, session)
    cells = _until(
        browser,
        lambda d: (t := d.find_element(By.ID, "cells").text) and LLM_ANSWER in t and t,
    )
    assert "x is 42" in cells and "llm_query('hi')" in cells
    assert browser.find_elements(By.CSS_SELECTOR, "#cells img.figure")  # the figure too
    _shot(browser, "jupyterlab-web.png")
