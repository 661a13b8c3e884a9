"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium, driven by Python
Playwright, which downloads no browser) against the real `colibri serve`: the demo model for
the chat, the random built-in model (whose replies never end) for Stop. Screenshots go to
target/web-screenshots/ (not committed)."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from colibri.demo.builtin import builtin_model_dir

from .server import RunningServer, long_window_builtin, ram_gb_for
from .web_support import CHROMIUM, ROOT, need_chromium

playwright_sync = pytest.importorskip("playwright.sync_api")

SHOTS = ROOT / "target" / "web-screenshots"
KEY = "browser-key-7"
VIEWPORTS = [(360, 640), (768, 1024), (1280, 800), (1920, 1080)]
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    need_chromium()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        (SHOTS / "versions.txt").write_text(
            f"playwright {version('playwright')}\nchromium {b.version}\n"
        )
        yield b
        b.close()


@pytest.fixture(scope="module")
def demo() -> Iterator[RunningServer]:
    srv = RunningServer("--no-kv-persist", default_model=True)
    assert srv.model_id == "colibri-demo"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def endless(tmp_path_factory) -> Iterator[RunningServer]:
    model = long_window_builtin(tmp_path_factory.mktemp("endless"))
    srv = RunningServer("--model", str(model), "--no-kv-persist", "--api-key", KEY)
    yield srv
    srv.stop()


class Page:
    """A fresh browser context and page that records every console error and page error."""

    def __init__(self, browser, width: int, height: int, scheme: str = "light") -> None:
        self.context = browser.new_context(
            viewport={"width": width, "height": height}, color_scheme=scheme
        )
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def open_page(browser) -> Iterator[Callable[..., Page]]:
    pages: list[Page] = []

    def make(width: int = 1280, height: int = 800, scheme: str = "light") -> Page:
        pages.append(Page(browser, width, height, scheme))
        return pages[-1]

    yield make
    for p in pages:
        p.close()


def no_console_errors(p: Page, allowed: re.Pattern[str] | None = None) -> None:
    left = [e for e in p.errors if allowed is None or not allowed.search(e)]
    assert left == [], left


def ask(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_reply(page):
    return page.locator('[data-testid="turn-assistant"]').last


def wait_done(page, timeout_ms: int = 60_000) -> None:
    last_reply(page).and_(page.locator('[aria-busy="false"]')).wait_for(timeout=timeout_ms)


def no_horizontal_overflow(page) -> None:
    widths = page.evaluate(
        "() => [document.documentElement.scrollWidth, document.documentElement.clientWidth,"
        " document.body.scrollWidth]"
    )
    assert widths[0] <= widths[1] and widths[2] <= widths[1], widths


def health(srv: RunningServer, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(srv.url + "/health", headers=headers).json()


def test_the_chat_answers_37_plus_48_with_its_reasoning_apart(demo, open_page):
    p = open_page()
    page = p.page
    page.goto(demo.url + "/")
    page.get_by_text("colibri-demo").first.wait_for()
    ask(page, "What is 37 + 48?")
    wait_done(page)
    reply = last_reply(page)
    assert reply.get_by_test_id("answer").inner_text().strip().rstrip(".") == "85"
    # The reasoning is its own block, folded once the answer came, and can be reopened.
    details = reply.locator("details.reasoning")
    assert details.evaluate("d => d.open") is False
    details.locator("summary").click()
    assert details.evaluate("d => d.open") is True
    trace = reply.get_by_test_id("reasoning").inner_text()
    assert "85" in trace and "<think>" not in trace
    assert "85" not in reply.get_by_test_id("answer").inner_text().replace("85", "", 1)
    stats = reply.get_by_test_id("stats").inner_text()
    assert re.search(r"TTFT \d", stats) and re.search(r"[\d.]+ tok/s", stats), stats
    assert re.search(r"\d+ tokens", stats) and "queue" in stats, stats
    assert "truncated" not in stats
    page.screenshot(path=str(SHOTS / "chat-1280x800-light.png"))
    no_console_errors(p)


def test_a_reply_cut_by_its_budget_is_marked_truncated(demo, open_page):
    p = open_page()
    page = p.page
    page.goto(demo.url + "/#/chat")
    page.get_by_text("colibri-demo").first.wait_for()
    page.get_by_label("Max tokens").fill("2")
    ask(page, "What is 12 + 30?")
    wait_done(page)
    stats = last_reply(page).get_by_test_id("stats")
    assert "truncated" in stats.inner_text()
    assert "2 tokens" in stats.inner_text()
    no_console_errors(p)


def test_stop_ends_the_generation_on_the_server(endless, open_page):
    p = open_page()
    page = p.page
    page.goto(endless.url + "/")
    page.get_by_label("API key").fill(KEY)
    page.get_by_text(endless.model_id).first.wait_for()
    before = health(endless, KEY)
    ask(page, "Hello")
    reply = last_reply(page)
    # Streaming: tokens arrive and the live rate shows, the server holds a slot for it.
    page.wait_for_function(
        "() => { const s = [...document.querySelectorAll('[data-testid=stats]')].pop();"
        " const m = s && s.textContent.match(/(\\d+) tokens/); return m && +m[1] >= 8; }",
        timeout=60_000,
    )
    assert "tok/s" in reply.get_by_test_id("stats").inner_text()
    assert health(endless, KEY)["active"] == 1
    page.get_by_role("button", name="Stop").click()
    reply.get_by_text("stopped").wait_for()
    deadline = time.monotonic() + 20
    while True:
        h = health(endless, KEY)
        if h["active"] == 0 and h["cancelled"] == before["cancelled"] + 1:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
    assert h["completed"] == before["completed"], h
    assert h["admitted"] == before["admitted"] + 1, h
    # The tokens shown stay; the page is ready for the next turn.
    assert reply.get_by_test_id("answer").inner_text().strip()
    page.get_by_role("button", name="Send", exact=True).wait_for()
    page.screenshot(path=str(SHOTS / "chat-stopped-1280x800.png"))
    no_console_errors(p)


def test_a_key_is_asked_for_and_a_wrong_one_refused_in_the_servers_words(endless, open_page):
    p = open_page()
    page = p.page
    page.goto(endless.url + "/")
    banner = page.get_by_test_id("banner")
    banner.wait_for()
    # Learned from the public /health: no refused request needed to know it.
    assert "requires an API key" in banner.inner_text()
    no_console_errors(p)
    page.get_by_label("API key").fill("wrong-key")
    page.get_by_text("Missing or invalid API key").wait_for()
    assert banner.inner_text().startswith("401")
    # The right key clears it; the key is never stored by the page.
    page.get_by_label("API key").fill(KEY)
    banner.wait_for(state="detached")
    page.get_by_text(endless.model_id).first.wait_for()
    stored = page.evaluate(
        "() => JSON.stringify(Object.assign({}, localStorage)) + document.cookie + location.href"
    )
    assert KEY not in stored
    # The browser itself reports the refused requests of the wrong key; nothing else.
    no_console_errors(p, re.compile(r"Failed to load resource.*401"))


def test_edit_export_and_history_survive_a_reload(demo, open_page):
    p = open_page()
    page = p.page
    page.goto(demo.url + "/")
    page.get_by_text("colibri-demo").first.wait_for()
    ask(page, "Hello")
    wait_done(page)
    # Edit the question and resend: the conversation restarts from it.
    page.get_by_role("button", name="Edit and resend this message").click()
    assert page.input_value("#prompt") == "Hello"
    ask(page, "What is 37 + 48?")
    wait_done(page)
    assert page.locator('[data-testid="turn-user"]').count() == 1
    assert page.locator('[data-testid="turn-assistant"]').count() == 1
    assert last_reply(page).get_by_test_id("answer").inner_text().strip().rstrip(".") == "85"
    # Export: the JSON is the chat request's own message shape, the Markdown readable.
    with page.expect_download() as got:
        page.get_by_role("button", name="Export JSON").click()
    exported = json.loads(Path(got.value.path()).read_text())
    assert exported["model"] == "colibri-demo"
    user, reply = exported["messages"]
    assert user == {"role": "user", "content": "What is 37 + 48?"}
    assert reply["role"] == "assistant" and reply["content"].strip().rstrip(".") == "85"
    assert "85" in reply["reasoning_content"]
    with page.expect_download() as got:
        page.get_by_role("button", name="Export Markdown").click()
    md = Path(got.value.path()).read_text()
    assert got.value.suggested_filename == "What-is-37-48.md"
    assert "## You\n\nWhat is 37 + 48?" in md and "Reasoning" in md
    # Kept in IndexedDB: after a reload the conversation is found by search and reopened.
    page.reload()
    page.get_by_text("colibri-demo").first.wait_for()
    history = page.get_by_test_id("history")
    history.locator("summary").click()
    page.get_by_label("Search conversations").fill("37 48")
    history.get_by_role("button", name="What is 37 + 48?", exact=True).click()
    assert last_reply(page).get_by_test_id("answer").inner_text().strip().rstrip(".") == "85"
    page.get_by_label("Search conversations").fill("no such words")
    history.get_by_text("Nothing matches.").wait_for()
    no_console_errors(p)


def test_the_system_page_shows_health_and_the_model(demo, open_page):
    p = open_page()
    page = p.page
    page.goto(demo.url + "/")
    # Keyboard: the System link is reachable and followed with Enter.
    page.locator('a[href="#/system"]').focus()
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"#/system$"))
    assert page.get_by_test_id("health-status").inner_text() == "ok"
    table = page.get_by_test_id("health-table").inner_text()
    for field in ("capacity", "admitted", "completed", "cancelled", "queued"):
        assert field in table
    model = page.get_by_test_id("model-table").inner_text()
    assert "colibri-demo" in model and "32768 tokens" in model
    info = httpx.get(demo.url + "/v1/colibri/info").json()
    engine = page.get_by_test_id("engine-table").inner_text()
    assert info["architecture"] in engine and info["kernel"] in engine
    prefetch = f"prefetch {info['kernel_prefetch']}"
    if info["kernel_prefetch_decode"] != info["kernel_prefetch"]:
        prefetch += f", decode {info['kernel_prefetch_decode']}"
    assert f"({prefetch})" in engine
    assert f"{info['num_experts']} experts ({info['experts_per_token']} per token)" in engine
    page.screenshot(path=str(SHOTS / "system-1280x800-light.png"))
    no_console_errors(p)


def test_the_system_page_shows_each_catalog_models_state_and_the_budget(open_page, tmp_path):
    """With a catalog under one RAM budget: each model's state and RAM (the demo model loaded,
    a second one cold until asked for), the budget and what the loaded ones take, as /health
    says them; the default model's KV figures under its own name only."""
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps([{"id": "spare", "path": str(builtin_model_dir())}]))
    srv = RunningServer(
        "--no-kv-persist", "--catalog", str(catalog), "--ram-gb", "4", default_model=True
    )
    try:
        p = open_page()
        page = p.page
        page.goto(srv.url + "/#/system")
        states = page.get_by_test_id("model-state")
        states.nth(1).wait_for()
        health = httpx.get(srv.url + "/health").json()
        ram = {m["id"]: m["ram_bytes"] for m in health["models"]}
        tables = page.get_by_test_id("model-table")
        demo_text, spare_text = tables.nth(0).inner_text(), tables.nth(1).inner_text()
        assert "colibri-demo" in demo_text and "loaded" in demo_text
        assert "KV per token" in demo_text
        assert "spare" in spare_text and "cold" in spare_text and "KV per token" not in spare_text
        assert page.get_by_test_id("ram-budget").inner_text() == (
            f"RAM budget {4e9 / 2**30:.2f} GiB, loaded models take "
            f"{ram['colibri-demo'] / 2**20:.1f} MiB"
        )
        # Asked for, the second model loads, and the page says so at its next poll (5 s).
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "spare", "prompt": "Hi", "max_tokens": 1},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=model-state]')[1]"
            ".innerText.startsWith('loaded')",
            timeout=15_000,
        )
        no_horizontal_overflow(page)
        no_console_errors(p)
    finally:
        srv.stop()


def test_the_profiling_page_shows_the_last_turn(demo, open_page):
    p = open_page()
    page = p.page
    page.goto(demo.url + "/")
    page.get_by_text("colibri-demo").first.wait_for()
    ask(page, "What is 37 + 48?")
    wait_done(page)
    page.get_by_role("link", name="Profiling").click()
    page.wait_for_url(re.compile(r"#/profiling$"))
    turns = httpx.get(demo.url + "/v1/colibri/profile").json()["turns"]
    count = page.get_by_test_id("turn-count")
    count.wait_for()
    assert count.inner_text() == str(len(turns))
    # The newest turn first: its prompt and reply token counts, and its phase bar.
    first = page.get_by_test_id("turns-table").locator("tbody tr").first
    cells = first.locator("td").all_inner_texts()
    assert cells[0] == str(len(turns))
    assert cells[1:3] == [str(turns[-1]["prefill_tokens"]), str(turns[-1]["decode_tokens"])]
    bar = first.locator(".phasebar")
    assert "expert matmul" in (bar.get_attribute("aria-label") or "")
    widths = bar.locator(".ph").evaluate_all("els => els.map(e => e.getBoundingClientRect().width)")
    assert len(widths) == 5 and sum(widths) > 0
    page.screenshot(path=str(SHOTS / "profiling-1280x800-light.png"))
    no_console_errors(p)


def test_the_brain_page_maps_the_experts_and_flashes_after_a_turn(demo, open_page):
    p = open_page()
    page = p.page
    page.goto(demo.url + "/#/brain")
    grid = page.get_by_test_id("brain-grid")
    grid.wait_for()
    known = httpx.get(demo.url + "/v1/colibri/experts").json()
    assert grid.locator(".cell").count() == known["experts"] * len(known["layers"])
    # A turn from another client: the page sees it on its next poll and flashes its experts.
    question = [{"role": "user", "content": "What is 37 + 48?"}]
    r = httpx.post(
        demo.url + "/v1/chat/completions",
        json={"model": "colibri-demo", "messages": question, "max_tokens": 40},
        timeout=60,
    )
    assert r.status_code == 200
    page.locator(".cell.flash").first.wait_for(timeout=10_000)
    now = httpx.get(demo.url + "/v1/colibri/experts").json()
    assert now["turns"] == known["turns"] + 1
    shown = page.locator(".cell.hit").evaluate_all(
        "els => els.map(e => [Number(e.dataset.layer), Number(e.dataset.expert)])"
    )
    want = [[x["layer"], e] for x in now["layers"] for e in x["routed"]]
    assert sorted(shown) == sorted(want) and want
    page.screenshot(path=str(SHOTS / "brain-1280x800-light.png"))
    # The same map as a table, for screen readers.
    page.get_by_text("As a table").click()
    rows = page.get_by_test_id("brain-table").locator("tbody tr")
    rows.first.wait_for()  # made when opened
    assert rows.count() == known["experts"] * len(known["layers"])
    no_console_errors(p)


def test_the_brio_page_scores_a_question_and_says_how_sure(demo, open_page):
    p = open_page(360, 640)
    page = p.page
    page.goto(demo.url + "/#/brio")
    page.get_by_text("colibri-demo").first.wait_for()
    page.get_by_label("Document").fill("Maths homework for Monday.")
    question = page.get_by_test_id("brio-question").first
    question.get_by_label("Question", exact=True).fill("What is 37 + 48?")
    question.get_by_label("Allowed answers, one per line").fill("85\n45\n42")
    # Keyboard: Score takes the focus and Enter presses it.
    score = page.get_by_role("button", name="Score", exact=True)
    score.focus()
    page.keyboard.press("Enter")
    card = page.get_by_test_id("brio-answer")
    card.wait_for(timeout=30_000)
    assert page.get_by_role("button", name="Score", exact=True).is_enabled()
    # What the server says for the same request, shown as it sent it.
    want = httpx.post(
        demo.url + "/v1/brio",
        json={
            "model": "colibri-demo",
            "state": "Maths homework for Monday.",
            "question": "What is 37 + 48?",
            "options": ["85", "45", "42"],
        },
        timeout=60,
    ).json()
    assert card.get_by_test_id("brio-choice").inner_text() == want["answer"] == "85"
    bars = card.get_by_test_id("brio-bar")
    assert bars.count() == 3
    labels = bars.evaluate_all("els => els.map(e => e.getAttribute('aria-label'))")
    assert [x.split(":")[0] for x in labels] == [c["option"] for c in want["choices"]]
    widths = bars.evaluate_all(
        "els => els.map(e => e.firstElementChild.getBoundingClientRect().width"
        " / e.getBoundingClientRect().width)"
    )
    assert widths[0] > 0.9 and widths[0] == max(widths)
    entropy = card.get_by_test_id("brio-entropy").inner_text()
    assert re.fullmatch(r"entropy \d\.\d\d: (confident|unsure|coin flip)", entropy), entropy
    assert entropy.endswith("confident")  # the demo model knows this sum (entropy ~0)
    assert "elapsed" in page.get_by_test_id("brio-timing").inner_text()
    no_horizontal_overflow(page)
    page.screenshot(path=str(SHOTS / "brio-360x640-light.png"))

    # Two questions: the questions form, an answer card each, in order.
    page.get_by_role("button", name="Add question").click()
    second = page.get_by_test_id("brio-question").nth(1)
    second.get_by_label("Question", exact=True).fill("What is the capital of Portugal?")
    second.get_by_label("Allowed answers, one per line").fill(
        "The capital of Portugal is Lisbon.\nThe capital of Spain is Madrid."
    )
    page.get_by_label("Document").press("Control+Enter")
    page.get_by_test_id("brio-answer").nth(1).wait_for(timeout=30_000)
    answers = page.get_by_test_id("brio-choice").all_inner_texts()
    assert answers == ["85", "The capital of Portugal is Lisbon."]
    no_horizontal_overflow(page)
    page.get_by_role("button", name="Remove question 2").click()
    assert page.get_by_test_id("brio-question").count() == 1

    # The server's refusal in its own words: a document longer than the context.
    page.get_by_label("Document").fill("word " * 20000)  # ~40k tokens
    page.get_by_role("button", name="Score", exact=True).click()
    error = page.get_by_test_id("brio-error")
    error.wait_for(timeout=30_000)
    assert error.inner_text().startswith("400 This model's maximum context length is 32768 tokens")
    assert page.get_by_test_id("brio-answer").count() == 0
    no_horizontal_overflow(page)
    no_console_errors(p, re.compile(r"Failed to load resource.*400"))


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_no_horizontal_overflow_at_any_width_in_either_theme(demo, open_page, scheme):
    long_word = "w" * 300
    for width, height in VIEWPORTS:
        p = open_page(width, height, scheme)
        page = p.page
        page.goto(demo.url + "/")
        page.get_by_text("colibri-demo").first.wait_for()
        ask(page, f"What is 21 + 34? {long_word}")
        wait_done(page)
        no_horizontal_overflow(page)
        page.screenshot(path=str(SHOTS / f"widths-chat-{width}x{height}-{scheme}.png"))
        page.goto(demo.url + "/#/system")
        page.get_by_test_id("health-status").wait_for()
        page.get_by_test_id("engine-table").wait_for()
        no_horizontal_overflow(page)
        page.screenshot(path=str(SHOTS / f"widths-system-{width}x{height}-{scheme}.png"))
        page.goto(demo.url + "/#/profiling")
        page.get_by_test_id("turns-table").wait_for()
        no_horizontal_overflow(page)
        page.screenshot(path=str(SHOTS / f"widths-profiling-{width}x{height}-{scheme}.png"))
        page.goto(demo.url + "/#/brain")
        page.get_by_test_id("brain-grid").wait_for()
        no_horizontal_overflow(page)
        page.screenshot(path=str(SHOTS / f"widths-brain-{width}x{height}-{scheme}.png"))
        page.goto(demo.url + "/#/brio")
        page.get_by_role("button", name="Score", exact=True).click()
        page.get_by_test_id("brio-answer").wait_for()
        no_horizontal_overflow(page)
        page.screenshot(path=str(SHOTS / f"widths-brio-{width}x{height}-{scheme}.png"))
        no_console_errors(p)


def test_the_theme_follows_the_system_and_can_be_switched(demo, open_page):
    def background(page) -> str:
        return page.evaluate("() => getComputedStyle(document.body).backgroundColor")

    p = open_page(scheme="dark")
    page = p.page
    page.goto(demo.url + "/")
    button = page.get_by_role("button", name=re.compile("^Theme"))
    button.wait_for()
    dark = background(page)
    assert page.evaluate("() => document.documentElement.dataset.theme") is None
    button.click()  # system -> light
    assert page.evaluate("() => document.documentElement.dataset.theme") == "light"
    light = background(page)
    assert light != dark
    page.reload()  # the choice is kept
    page.get_by_role("button", name=re.compile("^Theme: light")).wait_for()
    assert background(page) == light
    page.get_by_role("button", name=re.compile("^Theme")).click()  # light -> dark
    assert background(page) == dark
    page.get_by_role("button", name=re.compile("^Theme")).click()  # dark -> system (dark here)
    assert page.evaluate("() => document.documentElement.dataset.theme") is None
    assert background(page) == dark
    no_console_errors(p)


def test_a_server_gone_is_said_in_plain_words(open_page):
    srv = RunningServer("--no-kv-persist")
    try:
        p = open_page()
        page = p.page
        page.goto(srv.url + "/")
        page.get_by_text(srv.model_id).first.wait_for()
        srv.stop()
        ask(page, "Hello")
        error = last_reply(page).get_by_test_id("error")
        error.wait_for()
        assert "cannot reach the server" in error.inner_text()
        page.get_by_role("button", name="Send", exact=True).wait_for()
        # The browser's own report of the refused connection; nothing else.
        no_console_errors(p, re.compile(r"Failed to load resource|ERR_CONNECTION_REFUSED"))
    finally:
        srv.stop()


TIER_WORDS = {"p": "pinned", "c": "cached", "d": "disk", "r": "resident"}
TIER_LEGEND = {
    "pinned": "pinned",
    "cached": "RAM cache",
    "disk": "disk",
    "resident": "RAM (resident)",
}


def legend(page) -> dict[str, int]:
    """The Brain legend's counts per tier (data-tier -> count)."""
    items = page.get_by_test_id("brain-legend").locator("li")
    out = {}
    for i in range(items.count()):
        item = items.nth(i)
        tier = item.get_attribute("data-tier")
        text = item.inner_text()
        assert text.startswith(TIER_LEGEND[tier] + ":"), text
        out[tier] = int(text.rsplit(":", 1)[1])
    return out


def want_legend(body: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for layer in body["layers"]:
        for letter in layer["tiers"]:
            out[TIER_WORDS[letter]] = out.get(TIER_WORDS[letter], 0) + 1
    return out


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> Iterator[RunningServer]:
    """The built-in model (one MoE layer of 8 experts, 4 KiB records) behind a cache of 5
    records, 2 of them pinned by the heat in the KV directory: experts 1 and 4."""
    from colibri.demo.builtin import builtin_model_dir

    from .server import routing_heat_json

    assert (builtin_model_dir() / "experts.bin").stat().st_size == 8 * 4096
    kv = tmp_path_factory.mktemp("tiered-kv")
    (kv / "routing-heat.json").write_text(routing_heat_json({1: [5, 900, 3, 0, 700, 1, 2, 4]}))
    ram = ram_gb_for(builtin_model_dir(), 5.5 * 4096)
    srv = RunningServer("--kv-dir", str(kv), "--ram-gb", ram, "--pin-gb", str(2.5 * 4096 / 1e9))
    yield srv
    srv.stop()


def test_the_brain_page_colours_each_expert_by_where_it_lives(tiered, open_page):
    p = open_page(scheme="dark")
    page = p.page
    page.goto(tiered.url + "/#/brain")
    grid = page.get_by_test_id("brain-grid")
    grid.wait_for()
    body = httpx.get(tiered.url + "/v1/colibri/experts").json()
    assert body["layers"][0]["tiers"] == "dpddpddd"
    # Before any turn: the two hottest pinned, the rest on disk, and the legend says so.
    page.get_by_test_id("brain-legend").wait_for()
    assert legend(page) == {"pinned": 2, "disk": 6} == want_legend(body)

    def shown_tiers() -> list[str]:
        return grid.locator(".cell").evaluate_all("els => els.map(e => e.dataset.tier)")

    assert shown_tiers() == [TIER_WORDS[t] for t in body["layers"][0]["tiers"]]
    # Colour = tier: each cell is drawn in its legend swatch's colour (brightness = heat).
    swatches = dict(
        page.get_by_test_id("brain-legend")
        .locator("li")
        .evaluate_all(
            "els => els.map(e => [e.dataset.tier,"
            " getComputedStyle(e.querySelector('.swatch')).getPropertyValue('--tier').trim()])"
        )
    )
    assert set(swatches) == {"pinned", "disk"} and len(set(swatches.values())) == 2
    tier_colour = grid.locator(".cell").evaluate_all(
        "els => els.map(e => [e.dataset.tier,"
        " getComputedStyle(e).getPropertyValue('--tier').trim()])"
    )
    assert all(colour == swatches[tier] for tier, colour in tier_colour), tier_colour
    # The hottest pinned expert is the brightest cell; the tooltip names layer, expert, tier
    # and selections.
    hot = grid.locator('.cell[data-expert="1"]')
    assert hot.get_attribute("title") == "layer 1, expert 1: pinned, 900 selections"
    assert (
        grid.locator('.cell[data-expert="3"]').get_attribute("title")
        == "layer 1, expert 3: disk, 0 selections"
    )
    # A turn reads experts into the RAM cache: the page shows them there after its next poll.
    r = httpx.post(
        tiered.base_url + "/chat/completions",
        json={"model": tiered.model_id, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 12},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200
    page.locator(".cell.flash").first.wait_for(timeout=10_000)
    body = httpx.get(tiered.url + "/v1/colibri/experts").json()
    want = want_legend(body)
    assert want.get("cached", 0) > 0 and want["pinned"] == 2
    page.wait_for_function(
        "n => document.querySelectorAll('.cell.tier-cached').length === n", arg=want["cached"]
    )
    assert legend(page) == want
    assert shown_tiers() == [TIER_WORDS[t] for t in body["layers"][0]["tiers"]]
    page.screenshot(path=str(SHOTS / "brain-tiers-1280x800-dark.png"))
    # The table says the same in words.
    page.get_by_text("As a table").click()
    rows = page.get_by_test_id("brain-table").locator("tbody tr")
    rows.first.wait_for()
    assert rows.count() == 8
    words = [rows.nth(i).locator("td").nth(2).inner_text() for i in range(8)]
    assert words == [TIER_LEGEND[TIER_WORDS[t]] for t in body["layers"][0]["tiers"]]
    # The System page states the RAM budget the tiers come from.
    page.goto(tiered.url + "/#/system")
    ram = page.get_by_test_id("expert-ram")
    ram.wait_for()
    assert ram.inner_text().startswith("RAM cache of 5 experts (20.0 KiB), 2 of them pinned")
    no_console_errors(p)


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Iterator[RunningServer]:
    """A random model of the built-in recipe with 24 layers (23 MoE) of 64 experts: 1,472 cells,
    over the page's canvas threshold, behind an expert cache of a quarter of them."""
    from colibri.demo.builtin import write_checkpoint
    from colibri.runtime.engine import convert

    root = tmp_path_factory.mktemp("big-map")
    write_checkpoint(root / "hf", num_hidden_layers=24, n_routed_experts=64)
    convert(root / "hf", root / "model", "int4")
    size = (root / "model" / "experts.bin").stat().st_size
    ram = ram_gb_for(root / "model", size / 4)
    srv = RunningServer("--model", str(root / "model"), "--no-kv-persist", "--ram-gb", ram)
    yield srv
    srv.stop()


# The canvas's pixel at (x, y) CSS pixels from its top left, as [r, g, b].
PIXEL_JS = """([x, y]) => {
    const c = document.querySelector('[data-testid=brain-canvas]');
    const d = window.devicePixelRatio || 1;
    const px = c.getContext('2d').getImageData(Math.floor(x * d), Math.floor(y * d), 1, 1);
    return Array.from(px.data).slice(0, 3);
}"""


def canvas_pixel(page, x: float, y: float) -> list[int]:
    return page.evaluate(PIXEL_JS, [x, y])


def test_a_big_map_is_drawn_on_a_canvas_with_a_tooltip_and_a_table(big, open_page):
    p = open_page(1280, 800)
    page = p.page
    r = httpx.post(
        big.base_url + "/chat/completions",
        json={"model": big.model_id, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 6},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200
    body = httpx.get(big.url + "/v1/colibri/experts").json()
    layers, experts = body["layers"], body["experts"]
    assert (len(layers), experts) == (23, 64)
    page.goto(big.url + "/#/brain")
    canvas = page.get_by_test_id("brain-canvas")
    canvas.wait_for()
    assert page.locator(".cell").count() == 0  # no element per cell
    assert legend(page) == want_legend(body)
    lay = json.loads(canvas.get_attribute("data-layout") or "{}")
    step = lay["cell"] + lay["gap"]
    assert lay["cell"] >= 3
    box = canvas.bounding_box()
    assert box is not None

    def centre(row: int, col: int) -> tuple[float, float]:
        return lay["label"] + col * step + lay["cell"] / 2, row * step + lay["cell"] / 2

    # Hover: the tooltip of the cell under the pointer (hit-tested on the canvas).
    tip = page.get_by_test_id("brain-tooltip")
    for row, col in [(0, 0), (2, 10), (22, 63)]:
        x, y = centre(row, col)
        page.mouse.move(box["x"] + x, box["y"] + y)
        layer = layers[row]
        count = layer["counts"][col]
        tier = TIER_LEGEND[TIER_WORDS[layer["tiers"][col]]]
        tip.wait_for()
        assert tip.inner_text().startswith(
            f"layer {layer['layer']}, expert {col}: {tier}, {count} selections"
        ), tip.inner_text()
    page.mouse.move(box["x"] + 2, box["y"] + 2)  # the labels: no cell
    tip.wait_for(state="detached")
    # Each cell in its tier's colour at its heat's brightness (as the DOM cells mix them).
    colours = page.evaluate(
        """() => { const s = getComputedStyle(document.querySelector('[data-testid=brain-canvas]'));
        return Object.fromEntries(['--tier-cached', '--tier-disk', '--code-bg'].map(
            n => [n, s.getPropertyValue(n).trim()])); }"""
    )

    def rgb(hex_: str) -> list[int]:
        return [int(hex_[i : i + 2], 16) for i in (1, 3, 5)]

    top = max(max(x["counts"]) for x in layers)
    seen = set()
    for row, layer in enumerate(layers[:6]):
        for col in range(0, experts, 7):
            letter = layer["tiers"][col]
            heat = math.log2(layer["counts"][col] + 1) / math.log2(top + 1)
            share = 0.08 + 0.92 * heat
            tint = rgb(colours["--tier-cached" if letter == "c" else "--tier-disk"])
            bg = rgb(colours["--code-bg"])
            want = [round(a * share + b * (1 - share)) for a, b in zip(tint, bg, strict=True)]
            got = canvas_pixel(page, *centre(row, col))
            close = all(abs(g - w) <= 2 for g, w in zip(got, want, strict=True))
            assert close, (row, col, letter, got, want)
            seen.add(letter)
    assert seen == {"c", "d"}
    # Keyboard: focus puts a cursor on the first cell, the arrows move it, with the tooltip.
    canvas.focus()
    tip.wait_for()
    assert tip.inner_text().startswith(f"layer {layers[0]['layer']}, expert 0:")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowDown")
    assert tip.inner_text().startswith(f"layer {layers[1]['layer']}, expert 1:")
    page.keyboard.press("Escape")
    tip.wait_for(state="detached")
    # A new turn flashes its experts white, then they fade back.
    before = httpx.get(big.url + "/v1/colibri/experts").json()["turns"]
    r = httpx.post(
        big.base_url + "/chat/completions",
        json={"model": big.model_id, "messages": [{"role": "user", "content": "Hello"}],
              "max_tokens": 4},
        timeout=60,
    )  # fmt: skip
    now = httpx.get(big.url + "/v1/colibri/experts").json()
    assert now["turns"] == before + 1
    row = 3
    col = now["layers"][row]["routed"][0]
    x, y = centre(row, col)
    white = f"xy => ({PIXEL_JS})(xy).every(v => v > 200)"
    page.wait_for_function(white, arg=[x, y], polling="raf", timeout=10_000)
    page.wait_for_function(f"xy => !({white})(xy)", arg=[x, y], timeout=10_000)
    page.screenshot(path=str(SHOTS / "brain-canvas-1280x800-light.png"))
    # The table, one layer at a time.
    page.get_by_text("As a table").click()
    table = page.get_by_test_id("brain-table")
    table.locator("tbody tr").first.wait_for()
    assert table.locator("tbody tr").count() == experts
    page.get_by_label("Layer", exact=True).select_option(str(layers[5]["layer"]))
    first = table.locator("tbody tr").first.locator("td").all_inner_texts()
    assert first[:2] == [str(layers[5]["layer"]), "0"]
    assert first[3] == str(now["layers"][5]["counts"][0])
    no_console_errors(p)


@pytest.mark.parametrize("width", [360, 1920])
def test_the_canvas_map_never_overflows_the_page(big, open_page, width):
    p = open_page(width, 800, "dark")
    page = p.page
    page.goto(big.url + "/#/brain")
    page.get_by_test_id("brain-canvas").wait_for()
    no_horizontal_overflow(page)
    page.screenshot(path=str(SHOTS / f"brain-canvas-{width}x800-dark.png"))
    no_console_errors(p)


def test_a_full_queue_is_said_in_the_servers_words_with_retry_after(open_page, tmp_path):
    """One slot, no queue: while a long generation holds the slot the chat's request is
    refused with 429, shown as the server put it, Retry-After included. The holder is the
    built-in model with a 65,536-token window asked for 20,000 tokens (1,500 in its own window
    ended before the page asked, under a loaded machine)."""
    model = long_window_builtin(tmp_path)
    srv = RunningServer(
        "--model", str(model), "--no-kv-persist", "--kv-slots", "1", "--max-queue", "0"
    )
    holder: dict[str, object] = {}
    try:
        client = httpx.Client(timeout=120)
        req = client.build_request(
            "POST",
            srv.base_url + "/chat/completions",
            json={"model": srv.model_id, "messages": [{"role": "user", "content": "Hello"}],
                  "max_tokens": 20_000, "stream": True},
        )  # fmt: skip
        stream = client.send(req, stream=True)
        holder["stream"] = stream
        assert stream.status_code == 200
        lines = stream.iter_lines()
        while "delta" not in next(lines):
            pass
        assert health(srv)["active"] == 1
        p = open_page(360, 640)
        page = p.page
        page.goto(srv.url + "/")
        page.get_by_text(srv.model_id).first.wait_for()
        rejected = health(srv)["rejected"]
        ask(page, "Hello")
        error = last_reply(page).get_by_test_id("error")
        error.wait_for(timeout=20_000)
        # What the server says to the same request, word for word.
        direct = httpx.post(
            srv.base_url + "/chat/completions",
            json={"model": srv.model_id, "messages": [{"role": "user", "content": "Hello"}]},
        )
        assert direct.status_code == 429
        words = direct.json()["error"]["message"]
        retry = direct.headers["retry-after"]
        assert error.inner_text() == f"429: {words} (retry after {retry} s)", error.inner_text()
        assert health(srv)["rejected"] == rejected + 2
        page.get_by_role("button", name="Send", exact=True).wait_for()
        no_horizontal_overflow(page)
        page.screenshot(path=str(SHOTS / "chat-429-360x640.png"))
        no_console_errors(p, re.compile(r"Failed to load resource.*429"))
    finally:
        s = holder.get("stream")
        if isinstance(s, httpx.Response):
            s.close()
        srv.stop()


def test_slot_choice_regenerate_and_the_context_meter(open_page):
    """With two KV slots the chat offers the choice and sends `cache_slot`; Regenerate asks
    the server again; the meter counts the last turn's tokens against the context."""
    srv = RunningServer("--no-kv-persist", "--kv-slots", "2")
    try:
        p = open_page()
        page = p.page
        page.goto(srv.url + "/")
        page.get_by_text(srv.model_id).first.wait_for()
        slot = page.get_by_label("KV slot")
        assert slot.locator("option").all_inner_texts() == ["any", "0", "1"]
        slot.select_option("1")
        page.get_by_label("Max tokens").fill("5")
        page.get_by_label("Reasoning").uncheck()
        ask(page, "Hello")
        wait_done(page)

        def exported_reply() -> str:
            with page.expect_download() as got:
                page.get_by_role("button", name="Export JSON").click()
            messages = json.loads(Path(got.value.path()).read_text())["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant"]
            return messages[1]["content"]

        shown = exported_reply()
        assert shown

        def again(cache_slot: int) -> dict:
            r = httpx.post(
                srv.base_url + "/chat/completions",
                json={"model": srv.model_id, "messages": [{"role": "user", "content": "Hello"}],
                      "max_tokens": 5, "temperature": 0, "enable_thinking": False,
                      "cache_slot": cache_slot},
                timeout=60,
            )  # fmt: skip
            assert r.status_code == 200
            return r.json()

        # Slot 1 holds the page's conversation (its prompt is reused), slot 0 nothing.
        one, zero = again(1), again(0)
        assert one["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert zero["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert one["choices"][0]["message"]["content"] == shown  # greedy: the same reply
        used = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"]
        meter = page.locator(".meter")
        assert meter.inner_text() == f"context {used} / 2048"
        # Regenerate: the same question asked again (a new admission), one reply shown.
        admitted = health(srv)["admitted"]
        page.get_by_role("button", name="Regenerate").click()
        deadline = time.monotonic() + 60
        while (h := health(srv))["admitted"] != admitted + 1 or h["active"] != 0:
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
        wait_done(page)
        assert page.locator('[data-testid="turn-user"]').count() == 1
        assert page.locator('[data-testid="turn-assistant"]').count() == 1
        assert exported_reply() == shown
        no_console_errors(p)
    finally:
        srv.stop()


def test_a_markdown_reply_shows_highlighted_code_with_a_copy_button(demo, open_page):
    """A reply's Markdown (here a kept conversation reopened from History: the demo model
    writes no code) renders code highlighted, with a button that copies it exactly; no raw
    HTML gets through."""
    p = open_page()
    page = p.page
    p.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=demo.url)
    page.goto(demo.url + "/")
    page.get_by_text("colibri-demo").first.wait_for()
    code = 'def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2), "ok")\n'
    reply = f"Here:\n\n```python\n{code}```\n\n| x | y |\n|---|---|\n| 1 | 2 |\n\n<b>raw</b>"
    conversation = {
        "id": "kept-markdown",
        "title": "Write add in Python",
        "model": "colibri-demo",
        "updatedAt": 1,
        "turns": [
            {"role": "user", "content": "Write add in Python", "reasoning": "", "finish": None},
            {"role": "assistant", "content": reply, "reasoning": "", "finish": "stop"},
        ],
    }
    page.evaluate(
        """c => new Promise((resolve, reject) => {
            const req = indexedDB.open('colibri', 1);
            req.onupgradeneeded = () =>
                req.result.createObjectStore('conversations', {keyPath: 'id'});
            req.onsuccess = () => {
                const tx = req.result.transaction('conversations', 'readwrite');
                tx.objectStore('conversations').put(c);
                tx.oncomplete = () => { req.result.close(); resolve(); };
                tx.onerror = () => reject(tx.error);
            };
            req.onerror = () => reject(req.error);
        })""",
        conversation,
    )
    page.reload()
    page.get_by_text("colibri-demo").first.wait_for()
    history = page.get_by_test_id("history")
    history.locator("summary").click()
    history.get_by_role("button", name="Write add in Python", exact=True).click()
    answer = last_reply(page).get_by_test_id("answer")
    block = answer.locator(".codeblock")
    block.wait_for()
    assert block.locator(".codebar span").first.inner_text() == "python"
    assert block.locator("code.hljs.language-python").inner_text() == code.rstrip("\n")
    assert block.locator(".hljs-keyword").first.inner_text() == "def"
    assert block.locator(".hljs-string").first.inner_text() == '"ok"'
    assert block.locator(".hljs-comment").first.inner_text() == "# sum"
    copy = block.get_by_role("button", name="Copy code")
    copy.click()
    page.wait_for_function("b => b.textContent === 'Copied'", arg=copy.element_handle())
    assert page.evaluate("() => navigator.clipboard.readText()") == code.rstrip("\n")
    assert answer.locator("table td").all_inner_texts() == ["1", "2"]
    assert answer.locator("b").count() == 0 and "raw" in answer.inner_text()
    no_console_errors(p)


def test_profiling_shows_the_cache_hit_rate_and_the_speed_trend(tiered, open_page):
    """Behind an expert cache: the hit rate over the turns kept, as the profile's counters give
    it, and a decode tok/s trend with a point per turn."""
    for question in ("Hi", "Hello there"):
        r = httpx.post(
            tiered.base_url + "/chat/completions",
            json={"model": tiered.model_id, "messages": [{"role": "user", "content": question}],
                  "max_tokens": 6},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 200
    turns = httpx.get(tiered.url + "/v1/colibri/profile").json()["turns"]
    hits = sum(t["cache_hits"] for t in turns)
    misses = sum(t["cache_misses"] for t in turns)
    assert len(turns) >= 2 and misses > 0
    p = open_page()
    page = p.page
    page.goto(tiered.url + "/#/profiling")
    page.get_by_test_id("turn-count").wait_for()
    assert page.get_by_test_id("turn-count").inner_text() == str(len(turns))
    assert page.get_by_test_id("hit-rate").inner_text() == f"{100 * hits / (hits + misses):.1f}%"
    points = page.locator(".trend polyline").get_attribute("points") or ""
    assert len(points.split()) == len(turns)
    assert f"last {len(turns)} turns" in page.locator(".trend figcaption").inner_text()
    no_console_errors(p)


def secs(s: float) -> str:
    """The page's duration format (Profiling.tsx ``secs``)."""
    if 0 < s < 0.001:
        return f"{s * 1e6:.0f} µs"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


DURATION = r"\d+(?:\.\d+)? (?:µs|ms|s)"


def test_profiling_shows_the_reading_overlapped_with_compute(big, open_page):
    """Experts streamed from disk (a quarter of them in RAM): each turn's reading overlapped
    with compute, read busy time minus I/O wait as the profile gives them, per turn and over
    the turns, with its definition in the legend and the tooltips."""
    r = httpx.post(
        big.base_url + "/chat/completions",
        json={"model": big.model_id, "messages": [{"role": "user", "content": "Hello there"}],
              "max_tokens": 8},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200
    turns = httpx.get(big.url + "/v1/colibri/profile").json()["turns"]
    last = turns[-1]
    # The engine counted the reads' busy time: the turn read experts from disk.
    assert last["bytes_read"] > 0 and last["read_busy_s"] > 0, last
    p = open_page()
    page = p.page
    page.goto(big.url + "/#/profiling")
    page.get_by_test_id("turn-count").wait_for()
    assert page.get_by_test_id("turn-count").inner_text() == str(len(turns))
    # The newest turn's row: overlapped = read busy - I/O wait (0 when the wait is longer).
    row = page.get_by_test_id("turns-table").locator("tbody tr").first
    cell = row.get_by_test_id("turn-overlap")
    want = max(0.0, last["read_busy_s"] - last["io_wait_s"])
    assert float(cell.get_attribute("data-overlap-s") or "nan") == pytest.approx(want, abs=1e-12)
    text = cell.inner_text()
    assert re.fullmatch(DURATION + r"(?: \(\d+%\))?", text), text
    assert text.startswith(secs(want)), (text, want)
    share = re.search(r"\((\d+)%\)", text)
    assert share and int(share[1]) == pytest.approx(100 * want / last["read_busy_s"], abs=1)
    title = cell.get_attribute("title") or ""
    assert title == (
        f"read busy {secs(last['read_busy_s'])} − I/O wait {secs(last['io_wait_s'])}"
        f" = {secs(want)} overlapped with compute"
    ), title
    # Every turn's row the same way, and the tile sums them.
    rows = page.get_by_test_id("turns-table").locator("tbody tr")
    assert rows.count() == len(turns)
    shown = rows.get_by_test_id("turn-overlap").evaluate_all(
        "els => els.map(e => Number(e.dataset.overlapS))"
    )
    wants = [max(0.0, t["read_busy_s"] - t["io_wait_s"]) for t in reversed(turns)]
    assert shown == pytest.approx(wants, abs=1e-12)
    total = page.get_by_test_id("overlap-total").inner_text()
    m = re.fullmatch(f"({DURATION}) of ({DURATION}) read", total)
    assert m, total
    assert m[1] == secs(sum(wants)) and m[2] == secs(sum(t["read_busy_s"] for t in turns))
    # The definition: in the legend and in the column's and the tile's tooltips.
    legend = page.get_by_test_id("overlap-legend").inner_text()
    assert "Overlap = read busy time" in legend and "− I/O wait" in legend
    header = page.get_by_test_id("turns-table").locator("th", has_text="overlap")
    assert "read busy time − I/O wait" in (header.get_attribute("title") or "")
    no_horizontal_overflow(page)
    page.screenshot(path=str(SHOTS / "profiling-overlap-1280x800-light.png"))
    no_console_errors(p)


def test_the_brio_page_says_a_model_the_server_does_not_know_in_its_words(demo, open_page):
    """The real server's 404s on the Brio page: a model it does not serve (the page was given
    the server's own model list with the model renamed, as if it had gone since) is said in the
    server's words; a server without the /v1/brio route (a request sent to a path this server
    lacks) gets the page's note that scoring needs a newer colibri."""
    p = open_page()
    page = p.page

    def renamed(route) -> None:
        real = route.fetch()
        body = real.json()
        for card in body["data"]:
            card["id"] = "gone-model"
        route.fulfill(response=real, json=body)

    page.route("**/v1/models", renamed)
    page.goto(demo.url + "/#/brio")
    page.get_by_text("gone-model").first.wait_for()
    score = page.get_by_role("button", name="Score", exact=True)
    score.click()
    error = page.get_by_test_id("brio-error")
    error.wait_for(timeout=30_000)
    want = httpx.post(
        demo.url + "/v1/brio",
        json={"model": "gone-model", "state": "Maths homework for Monday.",
              "question": "What is 37 + 48?", "options": ["85", "45", "42"]},
    )  # fmt: skip
    assert want.status_code == 404 and want.json()["error"]["code"] == "model_not_found"
    assert error.inner_text() == f"404 {want.json()['error']['message']}"
    assert "gone-model" in error.inner_text()
    assert page.get_by_test_id("brio-absent").count() == 0
    assert page.get_by_test_id("brio-answer").count() == 0
    no_horizontal_overflow(page)
    page.screenshot(path=str(SHOTS / "brio-unknown-model-1280x800-light.png"))

    # The route itself absent: the server's plain 404 for a path it lacks.
    page.unroute("**/v1/models")
    page.route("**/v1/brio", lambda route: route.continue_(url=demo.url + "/v1/brio-absent"))
    page.reload()
    page.get_by_text("colibri-demo").first.wait_for()
    page.get_by_role("button", name="Score", exact=True).click()
    absent = page.get_by_test_id("brio-absent")
    absent.wait_for(timeout=30_000)
    assert "no /v1/brio route (it answered 404)" in absent.inner_text()
    assert page.get_by_test_id("brio-error").count() == 0
    no_console_errors(p, re.compile(r"Failed to load resource.*404"))
