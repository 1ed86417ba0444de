"""The web playground at `/`, in a real browser: Debian's Chromium (`executable_path`, no browser
download) driven by Playwright, against `sluice serve` on the default model with an API key. The page
loads without the key and asks for it; a reply streams in pieces, equals what the openai client gets
for the same request and shows its token counts and speed; Stop and Esc end a generation, and the
server aborts it; markdown and code render while raw HTML in a reply stays text. Each test leaves a
screenshot in test-artifacts/playground/.

The same browser also calls the API from pages of other origins: the one `--allowed-origins` names
may (CORS, a preflight before the keyed JSON request), another may not.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Locator, Page, Route, expect, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from serve_fixtures import Server, free_port, running_server

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-playground-5c1e"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "playground"
# As Debian's chromium package installs it; SLUICE_CHROMIUM points elsewhere.
CHROMIUM = os.environ.get("SLUICE_CHROMIUM", "/usr/bin/chromium")
# Headless as root, and none of the background connections that a machine without a network refuses.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STREAM_TIMEOUT_MS = 60_000


class BlankPage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>another origin</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def page_origin() -> Iterator[str]:
    """A server of blank pages on a port of its own: an origin other than the API's."""
    pages = ThreadingHTTPServer(("127.0.0.1", free_port()), BlankPage)
    thread = threading.Thread(target=pages.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{pages.server_address[1]}"
    finally:
        pages.shutdown()
        pages.server_close()


@pytest.fixture(scope="module")
def origins() -> Iterator[tuple[str, str]]:
    """(allowed, not allowed)."""
    with page_origin() as allowed, page_origin() as other:
        yield allowed, other


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, origins: tuple[str, str]) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-playground") / "serve.log"
    args = ["--max-model-len", "2048", "--kv-cache-memory", "0.5", "--max-num-seqs", "4"]
    args += ["--allowed-origins", origins[0]]
    with running_server(args, log, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}: scripts/setup installs Debian's chromium package")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def page(browser: Browser, server: Server, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Page]:
    """A fresh browser context (empty storage) on the playground; on the way out, its screenshot is
    kept, and any script error or Content-Security-Policy refusal fails the test."""
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    opened = context.new_page()
    problems: list[str] = []
    opened.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))

    def on_console(message: ConsoleMessage) -> None:
        if "Content Security Policy" in message.text:
            problems.append(f"CSP: {message.text}")

    opened.on("console", on_console)
    opened.goto(server.url + "/")
    try:
        yield opened
    finally:
        screenshot = tmp_path / f"{request.node.name}.png"
        opened.screenshot(path=str(screenshot), full_page=True)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(screenshot, ARTIFACTS / screenshot.name)
        context.close()
    assert not problems, problems


def enter_key(page: Page) -> None:
    page.fill("#api-key", API_KEY)
    expect(page.locator("#model-name")).to_have_text(MODEL)


def last_reply(page: Page) -> Locator:
    return page.locator(".message.assistant").last


def record_reply_lengths(page: Page) -> None:
    """From now on, window.replyLengths collects the text length of the newest reply at each change."""
    page.evaluate(
        """() => {
            window.replyLengths = [];
            new MutationObserver(() => {
                const replies = document.querySelectorAll(".message.assistant .content");
                const length = replies.length ? replies[replies.length - 1].textContent.length : 0;
                if (window.replyLengths.at(-1) !== length) window.replyLengths.push(length);
            }).observe(document.getElementById("messages"), {subtree: true, childList: true, characterData: true});
        }"""
    )


def abort_count(server: Server) -> float:
    response = server.request("GET", "/metrics")
    assert response.status == 200, response
    pattern = re.compile(
        r'^sluice:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', re.MULTILINE
    )
    return sum(float(value) for value in pattern.findall(str(response.body)))


def test_page_and_assets_need_no_key_while_the_api_does(server: Server) -> None:
    page = server.request("GET", "/", api_key=None)
    assert page.status == 200, page
    assert "<title>Sluice playground</title>" in page.body
    for path, kind in [
        ("/playground/playground.js", "text/javascript"),
        ("/playground/playground.css", "text/css"),
        ("/playground/licences.txt", "text/plain"),
    ]:
        assert f'"{path}"' in page.body, f"the page does not link {path}"
        # Without any Authorization header, as a browser loads a page.
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        connection.close()
        assert response.status == 200, path
        assert response.getheader("Content-Type", "").startswith(kind), path
        assert "script-src 'self'" in response.getheader("Content-Security-Policy", "")
        assert body
    assert server.request("GET", "/v1/models", api_key=None).status == 401
    assert server.request("GET", "/playground/other.js", api_key=None).status == 401


def test_the_page_asks_for_the_key_and_remembers_it(page: Page) -> None:
    expect(page.locator("#model-name")).to_have_text("enter the API key")
    page.fill("#prompt", "Hello")
    page.press("#prompt", "Enter")
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-state", "error")
    expect(reply.locator(".content")).to_contain_text("401")
    # The failed message comes back to the box, ready to send again once the key is in.
    expect(page.locator("#prompt")).to_have_value("Hello")
    enter_key(page)
    page.reload()
    expect(page.locator("#api-key")).to_have_value(API_KEY)
    expect(page.locator("#model-name")).to_have_text(MODEL)


def test_a_reply_streams_and_equals_the_apis_with_its_token_counts(page: Page, server: Server) -> None:
    enter_key(page)
    system = "You are a geography teacher."
    page.fill("#system-prompt", system)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "48")
    record_reply_lengths(page)
    # Shift+Enter is a new line in the message; Enter sends it.
    page.click("#prompt")
    page.keyboard.type("Name three rivers in Europe.")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("Answer in one sentence.")
    expect(page.locator(".message")).to_have_count(0)
    page.keyboard.press("Enter")
    message = "Name three rivers in Europe.\nAnswer in one sentence."
    expect(page.locator(".message.user .content")).to_have_text(message)
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-state", "done", timeout=STREAM_TIMEOUT_MS)

    lengths = page.evaluate("window.replyLengths")
    assert len(lengths) >= 3 and lengths == sorted(lengths), f"the reply did not stream: {lengths}"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    expected = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": message}],
        temperature=0,
        max_tokens=48,
    )
    assert expected.usage is not None
    assert reply.get_attribute("data-markdown") == expected.choices[0].message.content
    stats = reply.locator(".stats")
    expect(stats).to_have_attribute("data-completion-tokens", str(expected.usage.completion_tokens))
    expect(stats).to_have_attribute("data-prompt-tokens", str(expected.usage.prompt_tokens))
    expect(stats).to_contain_text(f"{expected.usage.completion_tokens} tokens")
    expect(stats).to_contain_text(re.compile(r"\d+\.\d tokens/s"))
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()


def wait_for_streaming(page: Page) -> None:
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-state", "streaming")
    try:
        page.wait_for_function(
            """() => {
                const replies = document.querySelectorAll(".message.assistant .content");
                return replies[replies.length - 1].textContent.length >= 20;
            }""",
            timeout=STREAM_TIMEOUT_MS,
        )
    except PlaywrightTimeoutError:
        # Whether it stalled while streaming or ended short tells a hang from a short reply.
        state, text = reply.get_attribute("data-state"), reply.locator(".content").text_content()
        raise AssertionError(
            f"the reply never reached 20 characters: state {state!r}, text {text!r}"
        ) from None


def assert_stopped_for_good(page: Page) -> None:
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-state", "stopped")
    expect(reply.locator(".stats")).to_contain_text("stopped")
    text = reply.locator(".content").text_content()
    time.sleep(1.0)
    assert reply.locator(".content").text_content() == text, "the reply grew after it was stopped"
    expect(page.locator("#send")).to_be_enabled()


def test_stop_and_escape_end_a_generation_and_the_server_aborts_it(page: Page, server: Server) -> None:
    enter_key(page)
    page.fill("#max-tokens", "1500")
    # Greedy: a sampled reply to "go on" could end in fewer characters than streaming is waited for.
    page.fill("#temperature", "0")
    aborted_before = abort_count(server)
    page.fill("#prompt", "Write a very long story about a lighthouse keeper and the sea.")
    page.click("#send")
    wait_for_streaming(page)
    expect(page.locator("#stop")).to_be_enabled()
    page.click("#stop")
    assert_stopped_for_good(page)

    page.fill("#prompt", "Go on with the story, in much more detail.")
    page.press("#prompt", "Enter")
    wait_for_streaming(page)
    page.keyboard.press("Escape")
    assert_stopped_for_good(page)
    expect(page.locator(".message.assistant")).to_have_count(2)

    deadline = time.monotonic() + 10
    while abort_count(server) < aborted_before + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert abort_count(server) == aborted_before + 2, "the server did not abort both generations"


CANNED_REPLY = [
    "# Rivers\n\nThe **Danube** and `Rhine`",
    ":\n\n```python\ndef longest(rivers):\n    return max(rivers)\n```\n\n",
    '<img src="x" onerror="window.pwned = true"> [click](javascript:window.pwned=true)\n',
]


def canned_stream(route: Route) -> None:
    """A chat completion stream with markdown, code and hostile HTML, in OpenAI's chunk shape."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in CANNED_REPLY]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append(
        {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 42, "total_tokens": 53}}
    )
    body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
    route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)


def test_markdown_and_code_render_and_html_in_a_reply_stays_text(page: Page) -> None:
    enter_key(page)
    page.route("**/v1/chat/completions", canned_stream)
    page.fill("#prompt", "Show me markdown.")
    page.press("#prompt", "Enter")
    reply = last_reply(page)
    expect(reply).to_have_attribute("data-state", "done")
    content = reply.locator(".content")
    expect(content.locator("h1")).to_have_text("Rivers")
    expect(content.locator("strong")).to_have_text("Danube")
    expect(content.locator("p code")).to_have_text("Rhine")
    code = content.locator("pre code.language-python")
    expect(code).to_contain_text("def longest(rivers):")
    expect(code.locator(".hljs-keyword").first).to_have_text("def")
    expect(content).to_contain_text('<img src="x" onerror="window.pwned = true">')
    expect(content.locator("img")).to_have_count(0)
    expect(content.locator('a[href^="javascript:"]')).to_have_count(0)
    assert page.evaluate("window.pwned") is None
    expect(reply.locator(".stats")).to_contain_text("11 prompt tokens · 42 tokens")


CROSS_ORIGIN_CHAT = """async ([url, key, model]) => {
    try {
        const response = await fetch(url + "/v1/chat/completions", {
            method: "POST",
            headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
            body: JSON.stringify({model, messages: [{role: "user", content: "Hi"}], max_tokens: 3}),
        });
        const ignored = response.headers.get("x-sluice-ignored-fields");
        return {status: response.status, body: await response.json(), ignored};
    } catch (error) {
        return {blocked: String(error)};
    }
}"""


def test_a_page_of_an_allowed_origin_calls_the_api_and_others_cannot(
    browser: Browser, server: Server, origins: tuple[str, str]
) -> None:
    allowed, other = origins
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(allowed + "/")
        answer = page.evaluate(CROSS_ORIGIN_CHAT, [server.url, API_KEY, MODEL])
        assert answer.get("status") == 200, answer
        assert answer["body"]["object"] == "chat.completion"
        page.goto(other + "/")
        refused = page.evaluate(CROSS_ORIGIN_CHAT, [server.url, API_KEY, MODEL])
        assert "blocked" in refused and "Failed to fetch" in refused["blocked"], refused
    finally:
        context.close()
    # The preflight is answered without the key, for the allowed origin only.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for origin, expected in ((allowed, allowed), (other, None)):
        connection.request(
            "OPTIONS",
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        response = connection.getresponse()
        response.read()
        assert response.getheader("Access-Control-Allow-Origin") == expected, (origin, response.getheaders())
    connection.close()
