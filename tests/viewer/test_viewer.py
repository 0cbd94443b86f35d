"""The trajectory viewer: the page holds what the JSONL holds, escaped, and works in a real browser.

Records are built with the embedded tiny tokenizer so token ids, masks and
segment texts agree the way the rollout manager writes them; the browser tests
drive Debian's chromium through playwright (never `playwright install`).
"""

from __future__ import annotations

import base64
import importlib.util
import io
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from relax_gym import messages
from relax_gym.models import build_tokenizer
from relax_gym.trajectory import Segment, Trajectory, read_jsonl, write_jsonl
from relax_gym.viewer import render_html, write_html
from relax_gym.viewer.render import _Detokenizer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SCRIPT = "<script>alert(1)</script>"
# resolves with how a media element's metadata load ended, kicking the load once if none began
# A media error is retried twice, a second apart: on a machine short of memory (the end of CI's suite) Chromium's
# decoder process failed to start once and the element said MEDIA_ERR_SRC_NOT_SUPPORTED; a source it really
# cannot decode fails all three loads, and `loads` says how many it took.
METADATA_LOADED = """el => new Promise(resolve => {
  let loads = 0;
  const done = () => resolve({duration: el.duration, readyState: el.readyState, loads,
                              error: el.error && el.error.code, visibility: document.visibilityState});
  const load = () => { loads += 1; el.load(); };
  if (el.readyState >= 1) return done();
  el.addEventListener("loadedmetadata", done, {once: true});
  el.addEventListener("error", () => loads < 3 ? setTimeout(load, 1000) : done());
  load();
  setTimeout(done, 60000);
})"""
# a spread of rollout logprobs so every heat class shows up
LOGPROBS = (-0.01, -0.05, -0.2, -0.01, -1.0, -0.02, -2.5, -0.1, -4.0)
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _media_items(parts: list[messages.Part]) -> list[Any]:
    """Media in the shape `Trajectory.media` keeps them (as the rollout manager extracts them from messages)."""
    out: list[Any] = []
    for part in parts:
        if part["type"] == "image":
            out.append(part["image"])
        elif part["type"] == "audio":
            out.append((part["audio"], part["sampling_rate"]))
    return out


def build(tok, turns: list[tuple[str, str, list[messages.Part]]], **fields: Any) -> Trajectory:
    """A record whose tokens are the tokenized segment texts, masked and versioned as the contract says."""
    fields = {"reward": 0.0, "step_rewards": [], "status": "completed", **fields}
    t = Trajectory(token_ids=[], prompt_len=0, loss_mask=[], rollout_logprobs=[], versions=[], **fields)
    turn = 0
    for kind, text, parts in turns:
        ids = tok.encode(text)
        turn += kind == "policy"
        start, first_media = len(t.token_ids), len(t.media)
        t.token_ids += ids
        trained = kind == "policy"
        t.loss_mask += [int(trained)] * len(ids)
        t.rollout_logprobs += [LOGPROBS[k % len(LOGPROBS)] if trained else 0.0 for k in range(len(ids))]
        t.versions += [2 + turn if trained else -1] * len(ids)
        t.media += _media_items(parts)
        t.segments.append(Segment(kind, start, len(t.token_ids), turn, text, list(range(first_media, len(t.media)))))  # type: ignore[arg-type]
    t.prompt_len = t.segments[0].end
    t.check()
    return t


def records(tok) -> list[Trajectory]:
    """A math success with a script in its output, a vision episode, an audio one, and a failure."""
    img = Image.fromarray(np.tile(np.linspace(0, 255, 48, dtype=np.uint8), (32, 1))).convert("RGB")
    clip = messages.audio(0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000), 16000)
    sys_user = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    header = "<|im_start|>assistant\n"
    math_ok = build(tok, [
        ("prompt", sys_user.format("What is 6 * 7?") + header, []),
        ("policy", f"I could write {SCRIPT} but the answer is 42 é😀.{IM_END}", []),
    ], reward=1.0, step_rewards=[1.0], group_id="g0", env_id="relax/Math-v0", task="What is 6 * 7?",
        metrics={"turns": 1, "answer": "42", "timings": {"generate_s": 0.12}}, infos=[{"correct": True}], seed=7)
    look = messages.user(messages.image(img), "What colour is the left edge?")
    vision = build(tok, [
        ("prompt", sys_user.format("Find the colour of the left edge.") + header, []),
        ("policy", '<tool_call>{"name": "crop", "arguments": {"box": [0, 0, 8, 32]}}</tool_call>' + IM_END, []),
        ("glue", "\n", []),
        ("env", "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the left edge?"
                f"{IM_END}\n" + header, look["content"]),
        ("policy", f"The left edge is black.{IM_END}", []),
    ], reward=0.5, step_rewards=[0.0, 0.5], group_id="g1", env_id="relax/DeepEyes-v0",
        task="Find the colour of the left edge.", metrics={"tool_calls": 1})
    listen = messages.user(clip, "Which note is this?")
    audio = build(tok, [
        ("prompt", "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>Which note is this?" f"{IM_END}\n" + header,
         listen["content"]),
        ("policy", "It sounds like the note A, at four hundred and", []),
    ], reward=0.0, step_rewards=[0.0], status="truncated", status_reason="max_new_tokens reached",
        group_id="g2", env_id="relax/AudioQA-v0", task="Which note is this?")
    failed = build(tok, [
        ("prompt", sys_user.format("What is 1 + 1?") + header, []),
        ("policy", f"2{IM_END}", []),
    ], reward=math.nan, step_rewards=[], status="failed", status_reason="reward function timed out after 5.0 s",
        group_id="g0", env_id="relax/Math-v0", task="What is 1 + 1?")
    return [math_ok, vision, audio, failed]


@pytest.fixture(scope="module")
def jsonl(tok, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("view") / "rollouts.jsonl"
    write_jsonl(records(tok), path)
    return path


@pytest.fixture(scope="module")
def page_html(jsonl) -> Path:
    return write_html(jsonl, jsonl.with_suffix(".html"))


@pytest.fixture(scope="module")
def token_html(jsonl, tok) -> Path:
    return write_html(jsonl, jsonl.with_name("tokens.html"), tokenizer=tok)


# --- the HTML itself ---------------------------------------------------------------


def test_model_output_is_escaped_never_markup(page_html, token_html):
    for path in (page_html, token_html):
        text = path.read_text()
        assert "<script>alert" not in text
        assert len(re.findall(r"<script\b", text)) == 1  # the page's own, and only it
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page_html.read_text()
    assert '">&lt;</span>' in token_html.read_text()  # per token, "<" is a piece of its own


def test_media_are_inlined_as_data_urls(page_html, jsonl):
    text = page_html.read_text()
    (png,) = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert Image.open(io.BytesIO(base64.b64decode(png))).size == (48, 32)
    (wav,) = re.findall(r'<audio controls preload="metadata" src="data:audio/wav;base64,([A-Za-z0-9+/=]+)"', text)
    assert base64.b64decode(wav)[:4] == b"RIFF"
    assert not re.search(r'(?:src|href)="(?!data:)', text), "the page must not reach the network"


def test_summary_counts_what_the_file_holds(page_html):
    text = page_html.read_text()

    def stat(key: str) -> str:
        return re.search(rf'data-stat="{key}"><b>([^<]*)</b>', text).group(1)

    assert stat("count") == "4"
    assert stat("reward") == "0.5"  # the failed record's NaN reward is left out, not counted as 0
    assert "mean reward · 1 NaN left out" in text
    assert stat("groups") == "3"
    assert stat("status-completed") == "2" and stat("status-truncated") == "1" and stat("status-failed") == "1"
    assert 'data-stat="status-aborted"' not in text
    assert "<tr><td>relax/Math-v0</td><td>2</td><td>1</td><td>1</td>" in text
    assert text.count('<details class="card') == 4
    assert 'data-status="failed"' in text and "reward function timed out after 5.0 s" in text


def test_cards_show_counts_versions_and_turns(page_html, jsonl):
    text = page_html.read_text()
    vision = list(read_jsonl(jsonl))[1]
    trained = vision.num_generated
    assert f"{len(vision.token_ids)} · <em>{trained} trained</em> · {len(vision.token_ids) - trained} masked" in text
    assert "<i>versions</i>3–4" in text
    assert '<div class="turn">turn 2 · step reward 0.5</div>' in text
    assert "template glue" in text and "env observation" in text


def test_tokenizer_adds_per_token_logprobs_and_heat(token_html, jsonl, tok):
    text = token_html.read_text()
    math_ok = next(read_jsonl(jsonl))
    policy = math_ok.segments[1]
    first = policy.start
    assert f'title="#{first} id {math_ok.token_ids[first]} · logprob -0.010 · v3 · p 0.990"' in text
    for cls in ("h1", "h2", "h3"):
        assert f'class="t {cls}"' in text


def test_detokenizer_pieces_rebuild_the_text_exactly(tok):
    ids = tok.encode("naïve café: 😀 ok" + IM_END)
    pieces = _Detokenizer(tok).pieces(ids)
    assert "".join(p for p, _, _ in pieces) == tok.decode(ids)
    assert [a for _, a, _ in pieces] == [0, *(b for _, _, b in pieces[:-1])] and pieces[-1][2] == len(ids)
    assert not any("\ufffd" in p for p, _, _ in pieces)


def test_records_without_segments_or_consistency_still_render(tok):
    bare = Trajectory([1, 2, 3, 4, 5], 2, [0, 0, 1, 1, 0], [0.0, 0.0, -0.5, -0.1, 0.0], [-1, -1, 0, 0, -1],
                      1.0, [1.0], "completed")
    broken = Trajectory([1, 2, 3], 1, [0, 1], [0.0, -1.0], [-1, 0], 0.0, [], "aborted")
    page = render_html([bare, broken], tokenizer=tok)
    assert page.count('<div class="seg ') == 3 + 2  # runs of the loss mask: prompt, policy, env; prompt, policy
    assert "record check failed" in page and "differ in length" in page
    assert "the file holds no trajectories" in render_html([])


def test_control_characters_in_model_output_show_as_pictures_and_bad_files_are_one_line(tok, tmp_path, capsys):
    from relax_gym.cli import main

    noisy = build(tok, [("prompt", "question", []), ("policy", f"a\x00b\x07c{IM_END}", [])], reward=0.0,
                  step_rewards=[])
    page = render_html([noisy], tokenizer=tok)
    assert not re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", page)  # raw, they make the page "binary"
    assert "\u2400" in page and "\u2407" in page  # per token: NUL and BEL, as pictures
    assert main(["view", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x.html")]) == 2
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["view", str(tmp_path / "metrics.jsonl"), "-o", str(tmp_path / "x.html")]) == 2
    out = capsys.readouterr().out
    assert "missing.jsonl: no such file" in out and "metrics.jsonl:1: not a trajectory record" in out
    assert "Traceback" not in out


def test_large_files_start_collapsed(tok):
    many = [build(tok, [("prompt", f"question {i}", []), ("policy", f"answer {i}{IM_END}", [])],
                  reward=float(i % 2), step_rewards=[], env_id=f"relax/E{i % 3}-v0") for i in range(500)]
    page = render_html(many, tokenizer=tok)
    assert page.count('<details class="card') == 500
    assert " open>" not in page
    assert page.count("<template>") == 500


# --- in a real browser -----------------------------------------------------------------


def _browser_missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is absent (run scripts/install_browser.sh)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Any]:
    missing = _browser_missing()
    if missing:
        if os.environ.get("RELAX_GYM_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{missing}, and RELAX_GYM_REQUIRE_BROWSER=1")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 900},
        )
        yield context
        context.close()


class Loaded:
    """A page opened from a file, with every console error, page error and dialog it raised."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.errors: list[str] = []
        self.page = browser.new_page()
        self.page.on("console", lambda m: m.type in ("error", "warning") and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.errors.append(f"dialog: {d.message}"), d.dismiss()))
        self.page.goto(path.as_uri())
        self.page.wait_for_load_state("load")


@pytest.fixture
def loaded(browser, page_html) -> Iterator[Loaded]:
    view = Loaded(browser, page_html)
    yield view
    view.page.close()


def test_page_shows_every_trajectory_without_errors(loaded):
    page = loaded.page
    assert page.locator("details.card").count() == 4
    assert page.locator("details.card[open] .seg").count() >= 9  # opened and filled from their templates
    assert SCRIPT in page.locator("#t1").inner_text()  # shown as text, never run
    assert page.inner_text('[data-stat="count"] b') == "4"
    assert loaded.errors == []


def test_image_decodes_and_audio_loads(loaded):
    page = loaded.page
    img = page.locator(".media img")
    assert img.count() == 1
    page.wait_for_function("() => document.querySelector('.media img').complete")
    assert img.evaluate("el => [el.naturalWidth, el.naturalHeight]") == [48, 32]
    audio = page.locator("audio")
    assert audio.count() == 1
    # Chromium may defer a media element's load while its page is hidden, and a busy machine
    # left CI's page there for the whole wait: show the page, ask for the load, and report how
    # it ended instead of waiting on readyState alone.
    page.bring_to_front()
    state = audio.evaluate(METADATA_LOADED)
    assert state["error"] is None, state
    assert state["duration"] == pytest.approx(0.5, abs=0.01), state
    assert loaded.errors == []


def test_filters_and_collapse(loaded):
    from playwright.sync_api import expect

    page = loaded.page
    failed = page.locator('details.card[data-status="failed"]')
    expect(failed).to_be_visible()
    page.locator('#f-status input[value="failed"]').uncheck()
    expect(failed).to_be_hidden()
    expect(page.locator("details.card:visible")).to_have_count(3)
    expect(page.locator("#f-count")).to_have_text("3 of 4 shown")
    page.select_option("#f-env", "relax/AudioQA-v0")
    expect(page.locator("details.card:visible")).to_have_count(1)
    page.select_option("#f-env", "")
    page.locator('#f-status input[value="failed"]').check()
    expect(page.locator("#f-count")).to_have_text("4 of 4 shown")

    first = page.locator("#t1")
    first.locator(":scope > summary").click()
    expect(first).not_to_have_attribute("open", "")
    expect(first.locator(".convo")).to_be_hidden()
    page.click("#expand-all")
    expect(first.locator(".convo")).to_be_visible()
    page.click("#collapse-all")
    expect(page.locator("details.card[open]")).to_have_count(0)
    assert loaded.errors == []


def test_per_token_page_and_lazy_cards(browser, token_html, tok, tmp_path):
    from playwright.sync_api import expect

    view = Loaded(browser, token_html)
    spans = view.page.locator("#t1 .seg.policy .t")
    assert spans.count() > 5
    assert "logprob" in spans.first.get_attribute("title")
    assert SCRIPT in view.page.locator("#t1 .seg.policy").inner_text()
    assert view.errors == []
    view.page.close()

    many = [build(tok, [("prompt", f"question {i}", []), ("policy", f"answer {i}{IM_END}", [])],
                  reward=1.0, step_rewards=[]) for i in range(500)]
    big = tmp_path / "big.html"
    big.write_text(render_html(many, tokenizer=tok))
    view = Loaded(browser, big)
    assert view.page.locator(".seg").count() == 0  # conversations stay in their templates until opened
    view.page.locator("#t250 > summary").click()
    expect(view.page.locator("#t250 .seg")).to_have_count(2)  # filled on the toggle event: wait for it
    assert view.errors == []
    view.page.close()


def test_real_rollouts_through_the_cli_render_in_the_browser(browser, tmp_path):
    """`relax-gym rollout` (real tiny models, real engine) then `relax-gym view`, then Chromium."""
    from playwright.sync_api import expect

    from relax_gym.trajectory import read_jsonl

    def cli(*args: str) -> None:  # a process of its own: playwright's sync API holds this one's event loop
        done = subprocess.run([sys.executable, "-m", "relax_gym.cli", *args], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    runs = [("relax/DeepEyes-v0", "tiny-vl"), ("relax/AudioQA-v0", "tiny-audio"), ("relax/GuessNumber-v0", "tiny")]
    for i, (env_id, model) in enumerate(runs):
        cli("rollout", "--env", env_id, "--model", model, "-n", "2", "--group", "2", "--out",
            str(tmp_path / f"{i}.jsonl"), "--max-new-tokens", "8", "--max-turns", "2")
    merged = tmp_path / "all.jsonl"
    merged.write_text("".join((tmp_path / f"{i}.jsonl").read_text() for i in range(len(runs))))
    trajs = list(read_jsonl(merged))
    assert len(trajs) == 12
    html = tmp_path / "all.html"
    cli("view", str(merged), "-o", str(html), "--model", "tiny")
    view = Loaded(browser, html)
    page = view.page
    assert page.locator("details.card").count() == 12
    page.click("text=expand all")
    images = sum(1 for t in trajs for m in t.media if not isinstance(m, tuple))
    clips = sum(1 for t in trajs for m in t.media if isinstance(m, tuple))
    assert images >= 4 and clips >= 4
    expect(page.locator(".media img")).to_have_count(images)  # cards fill in as they open
    expect(page.locator("audio")).to_have_count(clips)
    assert view.errors == []
    view.page.close()
