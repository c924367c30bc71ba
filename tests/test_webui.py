"""The chat page of `lattice serve` (``GET /``) and the stream extension it reads (``speculative.show_drafts``).

Without a browser: the page is served (and not under ``--no-webui``), self-contained (no request elsewhere), and the
streamed spans of drafted text agree with the text and the metrics. With Debian's Chromium and ChromeDriver and
selenium installed: the page in a real headless browser, a message sent with the keyboard, the streamed answer
waited for, its marked spans checked against what the server streamed and its metrics; a key asked for behind
``--api-key``. Skipped, saying why, where those are not installed.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from .serve_harness import MODEL_NAME, request, running_server

PROMPT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."


def _stream(base: str, body: dict) -> tuple[str, list[list[int]], dict]:
    """A streamed chat completion's text, its drafted spans and its metrics."""
    raw = request(base, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert raw.status_code == 200, raw.text
    text, spans, metrics = "", [], {}
    for line in raw.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices") or []:
            text += (choice.get("delta") or {}).get("content") or ""
        spans += (chunk.get("speculative") or {}).get("drafted") or []
        metrics = chunk.get("speculative_metrics") or metrics
    return text, spans, metrics


def test_the_page_is_served_self_contained_and_the_stream_marks_drafted_text(loaded):
    with running_server(loaded, method="ngram", adaptive=False) as (base, _):
        page = request(base, "GET", "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<title>lattice serve</title>" in page.text and "show_drafts" in page.text
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)  # nothing fetched from elsewhere
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40}
        text, spans, metrics = _stream(base, {**body, "speculative": {"show_drafts": True}})
        plain, none, _ = _stream(base, body)
        assert text == plain and none == []  # off unless asked; the text the same either way
        assert metrics["accepted_tokens"] > 0 and spans
        ends = 0
        for start, end in spans:
            assert ends <= start < end  # in order, not overlapping
            ends = end
        assert ends <= len(text) + 8  # offsets into the generated text (a held-back tail may follow)
    with running_server(loaded, webui=False) as (base, _):
        assert request(base, "GET", "/").status_code == 404


def _browser():
    """A headless Chromium driven through ChromeDriver (selenium), or a skip naming what is missing."""
    missing = [name for name in ("chromium", "chromedriver") if shutil.which(name) is None]
    if missing:
        pytest.skip(f"the browser test needs Debian's chromium and chromium-driver ({', '.join(missing)} not found)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="the browser test needs selenium (pip install)")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,800"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    return webdriver.Chrome(options=options, service=service)


def test_the_page_in_a_browser_streams_an_answer_with_its_drafted_tokens_marked(loaded, tmp_path):
    driver = _browser()  # skips first where the browser or selenium is missing
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        with running_server(loaded, method="ngram", adaptive=False) as (base, _):
            driver.get(base + "/")
            WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "model").text == MODEL_NAME)
            box = driver.switch_to.active_element  # the message box has the focus: the keyboard alone suffices
            assert box.get_attribute("id") == "prompt"
            box.send_keys(PROMPT)
            box.send_keys(Keys.ENTER)
            answer = WebDriverWait(driver, 120).until(
                lambda d: d.find_element(By.CSS_SELECTOR, ".turn.assistant[data-done='1']")
            )
            shown = answer.find_element(By.CSS_SELECTOR, ".text").text
            marked = [m.text for m in answer.find_elements(By.CSS_SELECTOR, ".text mark")]
            metrics = json.loads(answer.get_attribute("data-metrics"))
            spans = json.loads(answer.get_attribute("data-drafted"))
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 512}
            text, want_spans, want_metrics = _stream(base, {**body, "speculative": {"show_drafts": True}})
            assert shown.strip() == text.strip()  # the page shows the server's answer
            assert spans == want_spans and metrics["accepted_tokens"] == want_metrics["accepted_tokens"] > 0
            want_marked = [text[a:b].strip() for a, b in spans if text[a:b].strip()]
            assert [m.strip() for m in marked if m.strip()] == want_marked and want_marked
            assert "tok/s" in answer.find_element(By.CSS_SELECTOR, ".stats").text
            # the first text shown within a second of the server's first token (its prefill's end)
            first_ms = float(answer.get_attribute("data-first-ms"))
            assert first_ms <= 1000 * (metrics["prefill_s"] + metrics["calibration_s"]) + 1000
            driver.save_screenshot(str(tmp_path / "page.png"))
        with running_server(loaded, api_key="s3cret") as (base, _):
            driver.get(base + "/")
            WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "key").is_displayed())
            key = driver.find_element(By.ID, "key")
            key.send_keys("s3cret")
            key.send_keys(Keys.TAB)  # its change event: the page retries with the key
            WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "model").text == MODEL_NAME)
    finally:
        driver.quit()
