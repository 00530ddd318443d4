"""The explorer in a real headless browser (Debian's chromium, driven by Selenium through Debian's
chromium-driver; no browser is downloaded): the numbers the page shows are the model's attention weights, served
and exported, the exported file works with the network off, and the page asks nothing of any other server.

Set QKV_EXPLORER_SCREENSHOT=FILE.png to keep the screenshot (the README's picture comes from here)."""

import json
import os
import re
import shutil
import subprocess
import time

import pytest
from clitools import ENV, command

from qkv.checkpoint import load_checkpoint
from qkv.explore import lm_result, translation_result

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:
    webdriver = None
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (CHROMIUM and DRIVER and webdriver),
    reason="needs Debian's chromium and chromium-driver and selenium (.ci/run installs them)")]


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100",
                "--disable-background-networking", "--disable-component-update", "--no-first-run"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def _serve(model_dir):
    proc = subprocess.Popen(command("explore", "--model", model_dir, "--port", "0"), env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:\d+/", line)
    if not match:
        proc.kill()
        raise AssertionError(f"no address in {line!r}: {proc.stderr.read()}")
    return proc, match.group(0)


@pytest.fixture(scope="module")
def lm_server(lm_dir):
    proc, url = _serve(lm_dir)
    yield url
    proc.terminate()
    proc.wait(10)


def _requests(driver) -> list[str]:
    """The URLs the page asked for since the last call (from Chromium's DevTools log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def _no_script_errors(driver):
    """No script error (a 400 answer is logged by the network layer: not the page's fault)."""
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE" and e["source"] != "network"]
    assert not errors, errors


def _attributes(driver, selector, *names):
    """Each element's attributes (``text``: its rendered text), read in one script: a WebDriver call per
    attribute of hundreds of cells would take seconds."""
    script = ("return Array.from(document.querySelectorAll(arguments[0]), e => arguments[1].map("
              "n => n === 'text' ? e.innerText : e.getAttribute(n)));")
    return [tuple(row) for row in driver.execute_script(script, selector, list(names))]


def _detail(driver, layer, head):
    """Click the model view's thumbnail of (layer, head); the detail table's numbers by (query, key)."""
    wait = WebDriverWait(driver, 30)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model-view .thumb"))
    driver.find_element(By.CSS_SELECTOR, f'.thumb[data-layer="{layer}"][data-head="{head}"]').click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#detail-table td[data-query]"))
    cells = _attributes(driver, "#detail-table td[data-query]", "data-query", "data-key", "text")
    return {(int(q), int(k)): text for q, k, text in cells}


def _check_numbers(shown, attention, rows):
    assert {q for q, _ in shown} == set(range(rows))
    for (q, k), text in shown.items():
        assert abs(float(text) - attention[q][k]) <= 0.0005 + 1e-9 and len(text.split(".")[1]) == 3, (q, k, text)


def test_the_served_page_shows_the_models_attention(browser, lm_server, lm_dir, tmp_path):
    browser.get(lm_server)
    box = WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "input"))
    box.clear()
    box.send_keys("the 猫 sat")
    browser.find_element(By.ID, "run").click()
    ckpt = load_checkpoint(lm_dir)
    expected = lm_result(ckpt.model, ckpt.tokenizers["text"], "the 猫 sat", name="lm")
    shown = _detail(browser, 1, 2)
    steps = expected["steps"]  # at the last step: every row that wrote a token (the last one read the last token)
    _check_numbers(shown, expected["views"][0]["attention"][1][2], steps["first"] + len(steps["tokens"]))
    lines = _attributes(browser, "#head-view line.attn", "data-head")
    assert lines and set(lines) == {("2",)}  # the clicked head alone
    token = browser.find_element(By.CSS_SELECTOR, '.query-token[data-index="3"]')
    ActionChains(browser).move_to_element(token).perform()
    lines = _attributes(browser, "#head-view line.attn", "class", "data-query")
    shown = {query for cls, query in lines if "dim" not in cls.split()}
    assert len(lines) > 1 and shown == {"3"}  # hovering isolates a row
    labels = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#head-view .query-token")]
    assert "猫" in labels  # Chinese labels are drawn
    screenshot = os.environ.get("QKV_EXPLORER_SCREENSHOT") or str(tmp_path / "explorer.png")
    assert browser.save_screenshot(screenshot)
    assert all(url.startswith(lm_server) or url.startswith("data:") for url in _requests(browser))
    _no_script_errors(browser)


def test_the_page_says_what_was_wrong_with_an_input(browser, lm_server):
    browser.get(lm_server)
    box = WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "input"))
    box.clear()
    box.send_keys("x" * 80)
    browser.find_element(By.ID, "run").click()
    error = WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "error").text)
    assert error.startswith("the prompt is 80 tokens long; the explorer shows at most 48")


def test_an_exported_translation_opens_from_disk_with_the_network_off(browser, translator_dir, tmp_path):
    out = tmp_path / "translation.html"
    subprocess.run(command("explore", "--model", translator_dir, "--export", out, "--text", "the cat"), env=ENV,
                   check=True, capture_output=True)
    ckpt = load_checkpoint(translator_dir)
    expected = translation_result(ckpt.model, ckpt.tokenizers, "the cat", name="t")
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd("Network.emulateNetworkConditions",
                            {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})
    try:
        _requests(browser)  # forget earlier tests' requests
        browser.get(out.as_uri())
        views = {v["id"]: v for v in expected["views"]}
        from selenium.webdriver.support.ui import Select

        for view_id in ("encoder", "cross"):
            Select(browser.find_element(By.ID, "view")).select_by_value(view_id)
            time.sleep(0.2)
            shown = _detail(browser, 1, 3)
            _check_numbers(shown, views[view_id]["attention"][1][3], len(views[view_id]["queries"]))
        assert all(url.startswith("file:") or url.startswith("data:") for url in _requests(browser))
        _no_script_errors(browser)
    finally:
        browser.execute_cdp_cmd("Network.emulateNetworkConditions",
                                {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1})


def test_an_opened_image_shows_its_patches_attention(browser, vit_dir, png):
    from qkv.explore import image_result
    from qkv.images import image_from_bytes

    proc, url = _serve(vit_dir)
    try:
        browser.get(url)
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "image-file").is_enabled())
        browser.find_element(By.ID, "image-file").send_keys(str(png))
        browser.find_element(By.ID, "run").click()
        ckpt = load_checkpoint(vit_dir)
        pixels = image_from_bytes(png.read_bytes(), channels=1, size=(8, 8))
        expected = image_result(ckpt.model.vit, pixels, mean=[0.5], std=[0.25], name="vit")
        shown = _detail(browser, 1, 1)
        _check_numbers(shown, expected["views"][0]["attention"][1][1], 5)
        assert browser.find_element(By.ID, "image-canvas").is_displayed()
        assert all(url_.startswith(url) or url_.startswith("data:") for url_ in _requests(browser))
        _no_script_errors(browser)
    finally:
        proc.terminate()
        proc.wait(10)
