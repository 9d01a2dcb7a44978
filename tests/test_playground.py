"""The playground page at `/` in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium; `scripts/install_browser.sh` installs them) against the live service with the real SmolLM2:
a chat answer streams in with TTFT and tok/s shown, stop cancels a stream and the engine ends up with no
running request, a Chinese sentence translates into Latin-script text, API errors are shown as messages.
Screenshots go to test-artifacts/."""

import re
import shutil
import time

import httpx
import pytest
from live_service import ROOT, live_service

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]
from selenium import webdriver  # noqa: E402  (a test extra; `make test` installs it)
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
ARTIFACTS = ROOT / "test-artifacts"
RUNNING = re.compile(r'^attnserve_num_requests_running\{model="smollm2-135m-instruct"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.fail("chromium / chromedriver not installed: run scripts/install_browser.sh (`make test` does)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,900",
                "--disable-gpu", "--no-first-run"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=opts)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with live_service(generator="smollm2", log_path=tmp_path_factory.mktemp("svc") / "service.log") as u:
        yield u


def _set(drv, element_id: str, value: str):
    el = drv.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value)


def _answer(drv):
    return drv.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


CANCELLED = re.compile(r'^attnserve_request_success_total\{finished_reason="cancelled",model="smollm2-135m-instruct"\} '
                       r"(\S+)$", re.M)


def _metric(url: str, pattern: re.Pattern) -> float:
    m = pattern.search(httpx.get(url + "/metrics", timeout=10).text)
    return float(m.group(1)) if m else 0.0


def _running(url: str) -> float:
    return _metric(url, RUNNING)


def test_chat_streams_stop_cancels_translate_and_errors(browser, url):
    ARTIFACTS.mkdir(exist_ok=True)
    # the engine panel re-renders its rows on every refresh: an element found just before may be gone
    drv, wait = browser, WebDriverWait(browser, 240, poll_frequency=0.05,
                                       ignored_exceptions=(StaleElementReferenceException,))
    drv.get(url + "/")
    assert drv.find_element(By.LINK_TEXT, "API docs").get_attribute("href").endswith("/docs")
    assert drv.find_element(By.LINK_TEXT, "Metrics").get_attribute("href").endswith("/metrics")
    wait.until(lambda d: "smollm2-135m-instruct" in d.find_element(By.ID, "models").text)

    # Chat: the answer is seen while still streaming (partial text), then complete with its stats.
    _set(drv, "temperature", "0")
    _set(drv, "max-tokens", "48")
    _set(drv, "chat-input", "What is the capital of France?")
    drv.find_element(By.ID, "chat-send").click()
    partial = wait.until(lambda d: "streaming" in _answer(d).get_attribute("class") and _answer(d).text.strip())
    wait.until(lambda d: "streaming" not in _answer(d).get_attribute("class"))
    final = _answer(drv).text
    assert final.startswith(partial) and len(final) > len(partial) and "Paris" in final
    stats = drv.find_element(By.ID, "chat-stats")
    assert "TTFT" in stats.text and "tok/s" in stats.text and float(stats.get_attribute("data-ttft-ms")) > 0
    # the answer's own figures: TTFT, tok/s and tokens used (prompt + completion from the service's usage)
    per_answer = drv.find_elements(By.CSS_SELECTOR, ".msg-stats")[-1]
    completion = int(per_answer.get_attribute("data-tokens"))
    prompt_tokens = int(per_answer.get_attribute("data-prompt-tokens"))
    assert 0 < completion <= 48 and prompt_tokens > 5
    assert int(per_answer.get_attribute("data-total-tokens")) == prompt_tokens + completion
    assert float(per_answer.get_attribute("data-tok-per-s")) > 0
    assert "TTFT" in per_answer.text and "tok/s" in per_answer.text and f"= {prompt_tokens + completion} tokens" \
        in per_answer.text
    # the live engine panel, read from /metrics and refreshed: the generator idle after its answer
    updated = drv.find_element(By.ID, "engine-panel").get_attribute("data-updated")
    wait.until(lambda d: d.find_element(By.ID, "engine-panel").get_attribute("data-updated") != updated)
    row = drv.find_element(By.CSS_SELECTOR, '.engine-row[data-model="smollm2-135m-instruct"]')
    assert row.get_attribute("data-running") == "0" and "KV cache" in row.text
    drv.save_screenshot(str(ARTIFACTS / "playground-chat.png"))

    # Stop mid-stream: the page marks the answer stopped and the engine frees the request.
    _set(drv, "temperature", "0.7")
    _set(drv, "max-tokens", "600")
    _set(drv, "chat-input", "Write a long story about a dragon who learns to bake bread.")
    drv.find_element(By.ID, "chat-send").click()
    wait.until(lambda d: len(_answer(d).text) > 20)
    # the panel sees the stream running in the engine within a refresh
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, '.engine-row[data-model="smollm2-135m-instruct"]')
               .get_attribute("data-running") == "1")
    cancelled = _metric(url, CANCELLED)
    assert _running(url) >= 1  # the stream is live in the engine
    drv.find_element(By.ID, "chat-stop").click()
    wait.until(lambda d: "[stopped]" in _answer(d).text)
    assert drv.find_element(By.ID, "chat-send").is_enabled()
    deadline = time.monotonic() + 30
    while (_running(url) != 0 or _metric(url, CANCELLED) == cancelled) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(url, CANCELLED) == cancelled + 1  # the engine saw the disconnect and ended the request
    assert _running(url) == 0  # ... and reports no running request
    assert "finish: stopped" in drv.find_element(By.ID, "chat-stats").text

    # An API error (max_tokens beyond the engine's context) is shown as a readable message.
    _set(drv, "max-tokens", "8000")
    _set(drv, "chat-input", "Hello")
    drv.find_element(By.ID, "chat-send").click()
    err = wait.until(lambda d: d.find_element(By.ID, "error").is_displayed() and d.find_element(By.ID, "error"))
    assert err.text.startswith("Error 400") and "max_tokens" in err.text

    # Translate: a Chinese sentence, zh->en, line by line, comes back in Latin script.
    drv.find_element(By.ID, "tab-translate").click()
    assert not drv.find_element(By.ID, "error").is_displayed()
    _set(drv, "tr-input", "会议在星期二举行。\n\n五月物价上涨。")
    drv.find_element(By.CSS_SELECTOR, "#tr-direction option[value='zh-en']").click()
    _set(drv, "tr-beam", "2")
    drv.find_element(By.ID, "tr-go").click()
    wait.until(lambda d: d.find_element(By.ID, "tr-copy").is_enabled())
    lines = drv.find_element(By.ID, "tr-output").get_attribute("textContent").split("\n")
    assert len(lines) == 3 and lines[1] == ""  # one output line per input line, blank kept
    for line in (lines[0], lines[2]):
        assert re.search(r"[A-Za-z]", line) and not re.search(r"[\u4e00-\u9fff]", line)
    drv.save_screenshot(str(ARTIFACTS / "playground-translate.png"))

    # Empty input is refused in the page with a message.
    _set(drv, "tr-input", " ")
    drv.find_element(By.ID, "tr-go").click()
    assert "one or more sentences" in drv.find_element(By.ID, "error").text
