"""The HTML reports in a real browser: headless Chromium opens them offline, asks for nothing, and draws every chart.

Playwright drives the system's Chromium (Debian's `chromium` package), never a browser it downloads
itself. Without that browser the test skips, unless REDLINE_REQUIRE_BROWSER=1 (CI's setting): then
a missing browser fails it, so CI cannot pass without having looked at the page.
"""

import importlib.util
import os
from pathlib import Path

import pytest

from redline.render.html import bench_report, run_report, write_report
from report_samples import bench_result, images, write_run

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REQUIRE_ENV = "REDLINE_REQUIRE_BROWSER"

# Each image drawn on a canvas: decoded (complete, with a width) and not one flat colour.
DRAWN_IMAGES = """() => Array.from(document.images).map((img) => {
    const canvas = document.createElement("canvas");
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    const context = canvas.getContext("2d");
    let colours = 0;
    if (img.naturalWidth > 0) {
        context.drawImage(img, 0, 0);
        const pixels = new Uint32Array(context.getImageData(0, 0, canvas.width, canvas.height).data.buffer);
        colours = new Set(pixels).size;
    }
    return {alt: img.alt, complete: img.complete, width: img.naturalWidth, colours: colours};
})"""


def missing_browser() -> str:
    """Why the browser test cannot run here ("" when it can)."""
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)"
    for module, package in (("playwright", "playwright"), ("matplotlib", "'redline[report]'")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install {package})"
    return ""


@pytest.fixture(scope="module")
def browser():
    why = missing_browser()
    if why and os.environ.get(REQUIRE_ENV, "") == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 and the browser test cannot run: {why}")
    if why:
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(params=["bench", "run"])
def report_file(request, tmp_path) -> Path:
    html = bench_report(bench_result()) if request.param == "bench" else run_report(write_run(tmp_path / "run"))
    return write_report(tmp_path / f"{request.param}.html", html)


def test_chromium_opens_the_report_offline_and_draws_every_chart(browser, report_file):
    page = browser.new_page()
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(report_file.as_uri(), wait_until="load")
        drawn = page.evaluate(DRAWN_IMAGES)
        title = page.title()
    finally:
        page.close()
    assert [url for url in requests if not url.startswith("data:")] == [report_file.as_uri()]
    assert errors == []
    assert title.startswith("redline ")
    expected = images(report_file.read_text(encoding="utf-8"))
    assert [image["alt"] for image in drawn] == [image["alt"] for image in expected] and drawn
    for image in drawn:
        assert image["complete"] and image["width"] > 0, image["alt"]
        assert image["colours"] > 1, f"blank image: {image['alt']}"
