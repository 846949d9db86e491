"""The browser tests' shared pieces: Debian's chromium driven by Selenium, headless, with every
host but loopback unresolvable (no network), and a small PNG to display."""

from __future__ import annotations

import base64
import shutil
import struct
import zlib
from typing import Any

import pytest

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def chromium(*extra: str) -> Any:
    """A headless chromium (its driver's ``quit()`` ends it); fails the test where it is
    missing (``make system-deps`` installs it)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.fail("chromium and chromium-driver are missing: `make system-deps` installs them")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in CI; the pages are ours and loopback-only
        "--disable-gpu",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # no network
        *extra,
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


def png(width: int = 4, height: int = 4) -> str:
    """A red ``width`` x ``height`` PNG, base64-encoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    image = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows))
    return base64.b64encode(image + chunk(b"IEND", b"")).decode()
