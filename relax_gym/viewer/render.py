"""Renders trajectory records as one self-contained HTML page (`relax-gym view`).

Every string that comes from a record (model output, env text, task, metrics)
reaches the page through `html.escape`: model output is untrusted. Media are
inlined as `data:` URLs so the page works offline and can be mailed around.
Each card's conversation is rendered into an inert `<template>` that the page
script moves into place when the card is first opened, which keeps files with
hundreds of trajectories quick to load.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from relax_gym.trajectory import Segment, Trajectory, media_to_json, png_b64, read_jsonl
from relax_gym.video import Video
from relax_gym.viewer.assets import CSS, JS, PAGE

STATUSES: tuple[str, ...] = ("completed", "truncated", "aborted", "failed")
KIND_LABELS = {"prompt": "prompt", "policy": "policy", "env": "env observation", "glue": "template glue"}
#: a page with at most this many trajectories opens every card at load; larger ones start collapsed
OPEN_LIMIT = 20
#: tokens joined into one displayed piece at most (a UTF-8 character spans up to 4 byte-level tokens)
MAX_GROUP = 8
#: heat classes for low-probability generated tokens: (probability below, css class)
HEAT = ((0.05, "h3"), (0.2, "h2"), (0.5, "h1"))
_REPEATS = re.compile(r"(<\|[A-Za-z_]+\|>)\1{3,}")  # e.g. hundreds of <|image_pad|> in a row


def _hash(block: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(block.encode()).digest()).decode() + "'"


CSP = (
    f"default-src 'none'; img-src data:; media-src data:; style-src {_hash(CSS)}; "
    f"script-src {_hash(JS)}; base-uri 'none'; form-action 'none'"
)


class Decoder(Protocol):
    """What the viewer needs of a tokenizer (any Hugging Face tokenizer has it)."""

    def decode(self, token_ids: list[int]) -> str: ...


class _Detokenizer:
    """Splits generated ids into displayed pieces of one or more tokens that decode to whole characters.

    A byte-level token can hold part of a UTF-8 character, and SentencePiece drops a word's leading space
    when a token is decoded alone; decoding each piece after its predecessor and keeping the difference
    handles both. Decodes are cached: the same token pairs recur across a file.
    """

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[tuple[int, ...], str] = {}

    def decode(self, ids: tuple[int, ...]) -> str:
        if ids not in self.cache:
            self.cache[ids] = self.tokenizer.decode(list(ids))
        return self.cache[ids]

    def _piece(self, prev: tuple[int, ...], group: tuple[int, ...]) -> str:
        if not prev:
            return self.decode(group)
        head, full = self.decode(prev), self.decode(prev + group)
        return full[len(head):] if full.startswith(head) else self.decode(group)

    def pieces(self, ids: list[int]) -> list[tuple[str, int, int]]:
        """(text, start, end) over `ids`, end exclusive."""
        out: list[tuple[str, int, int]] = []
        prev: tuple[int, ...] = ()
        i = 0
        while i < len(ids):
            j = i + 1
            while j < len(ids) and j - i < MAX_GROUP and self._piece(prev, tuple(ids[i:j])).endswith("\ufffd"):
                j += 1
            group = tuple(ids[i:j])
            out.append((self._piece(prev, group), i, j))
            prev, i = group, j
        return out


#: control characters (NUL and the like, which a random model writes) as their visible Unicode pictures: raw
#: in an HTML file they are parse errors, and tools take the page for a binary file
_CONTROL_PICTURES = {c: 0x2400 + c for c in range(32) if chr(c) not in "\t\n\r"} | {0x7F: 0x2421}


def _e(value: Any) -> str:
    return html.escape(str(value).translate(_CONTROL_PICTURES), quote=True)


def _num(x: Any) -> str:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    return str(x) if isinstance(x, int) else f"{x:.4g}"


def _value(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, int | float) and not isinstance(v, bool):
        return _num(v)
    return json.dumps(v, ensure_ascii=False, default=str)


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _env(t: Trajectory) -> str:
    return t.env_id or "(no env)"


def _status_class(status: str) -> str:
    return f"st-{status}" if status in STATUSES else "st-other"


def _all_statuses(trajs: Sequence[Trajectory]) -> list[str]:
    """The four contract statuses, then any others a record carries (shown, never dropped)."""
    return [*STATUSES, *sorted({t.status for t in trajs} - set(STATUSES))]


def _versions(t: Trajectory) -> str:
    trained = [v for v, m in zip(t.versions, t.loss_mask, strict=False) if m]
    if not trained:
        return "—"
    lo, hi = min(trained), max(trained)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def _problem(t: Trajectory) -> str | None:
    try:
        t.check()
    except ValueError as err:
        return str(err)
    return None


# --- summary and toolbar -------------------------------------------------------------


def _env_row(name: str, trajs: Sequence[Trajectory], statuses: list[str], total: bool = False) -> str:
    counts: Counter[str] = Counter(t.status for t in trajs)
    n = len(trajs)
    tds = f"<td>{name}</td><td>{n}</td><td>{_num(_mean([t.reward for t in trajs]))}</td>"
    tds += "".join(f"<td>{counts[s]}</td>" if counts[s] else '<td class="zero">0</td>' for s in statuses)
    tokens, trained = sum(len(t.token_ids) for t in trajs), sum(t.num_generated for t in trajs)
    tds += f"<td>{tokens / n:.0f}</td><td>{trained / n:.0f}</td>"
    return f'<tr class="total">{tds}</tr>' if total else f"<tr>{tds}</tr>"


def _summary(trajs: Sequence[Trajectory]) -> str:
    if not trajs:
        return '<section class="summary"><p class="empty">the file holds no trajectories</p></section>'
    statuses = _all_statuses(trajs)
    counts: Counter[str] = Counter(t.status for t in trajs)
    total_tokens = sum(len(t.token_ids) for t in trajs)
    trained = sum(t.num_generated for t in trajs)
    unscored = sum(not math.isfinite(t.reward) for t in trajs)
    reward_label = f"mean reward · {unscored} NaN left out" if unscored else "mean reward"
    tiles = [
        ("count", str(len(trajs)), "trajectories"),
        ("reward", _num(_mean([t.reward for t in trajs])), reward_label),
        ("groups", str(len({t.group_id for t in trajs})), "groups"),
        ("tokens", f"{total_tokens:,}", f"tokens · {trained:,} trained"),
        *((f"status-{s}", str(counts[s]), s) for s in statuses if counts[s]),
    ]
    stats = "".join(f'<div class="stat" data-stat="{_e(k)}"><b>{v}</b><span>{_e(label)}</span></div>'
                    for k, v, label in tiles)
    by_env: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_env.setdefault(_env(t), []).append(t)
    rows = [_env_row(_e(env), ts, statuses) for env, ts in sorted(by_env.items())]
    rows.append(_env_row("all", trajs, statuses, total=True))
    head = "".join(f"<th>{_e(h)}</th>" for h in ("env", "n", "mean reward", *statuses, "mean tokens", "mean trained"))
    return (f'<section class="summary"><div class="stats">{stats}</div>'
            f'<table class="envs"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></section>')


def _toolbar(trajs: Sequence[Trajectory], per_token: bool) -> str:
    counts: Counter[str] = Counter(t.status for t in trajs)
    boxes = "".join(f'<label><input type="checkbox" value="{_e(s)}" checked> {_e(s)} ({counts[s]})</label> '
                    for s in _all_statuses(trajs) if counts[s])
    envs = Counter(_env(t) for t in trajs)
    options = "".join(f'<option value="{_e(env)}">{_e(env)} ({n})</option>' for env, n in sorted(envs.items()))
    legend = [
        '<span><span class="sw policy"></span>trained: policy tokens (loss_mask 1)</span>',
        '<span><span class="sw prompt"></span>masked: prompt</span>',
        '<span><span class="sw env"></span>masked: env observation</span>',
        '<span><span class="sw glue"></span>masked: template glue</span>',
    ]
    if per_token:
        legend += [
            '<span><span class="sw t m"></span>masked token inside a policy turn</span>',
            *(f'<span><span class="sw t {cls}"></span>p &lt; {p}</span>' for p, cls in reversed(HEAT)),
            "<span>hover a token for its rollout logprob and version</span>",
        ]
    return (
        f'<nav class="toolbar"><span id="f-status">status: {boxes}</span>'
        f'<label>env: <select id="f-env"><option value="">all ({len(trajs)})</option>{options}</select></label>'
        '<span><button id="expand-all" type="button">expand all</button> '
        '<button id="collapse-all" type="button">collapse all</button></span>'
        f'<span id="f-count">{len(trajs)} of {len(trajs)} shown</span>'
        f'<div class="legend">{"".join(legend)}</div></nav>'
    )


# --- one trajectory ------------------------------------------------------------------


def _media(item: Any, index: int) -> str:
    if isinstance(item, Image.Image):
        return (f'<figure><img src="data:image/png;base64,{png_b64(item)}" alt="image {index}">'
                f"<figcaption>image {index} · {item.width}×{item.height}</figcaption></figure>")
    if isinstance(item, Video):  # a strip of the frames the model saw, each titled with its time
        frames = "".join(f'<img src="data:image/png;base64,{png_b64(f)}" alt="video {index} frame {i}" '
                         f'title="{i / item.fps:.2f} s">' for i, f in enumerate(item.frames))
        width, height = item.frames[0].size
        return (f'<figure><div class="strip">{frames}</div><figcaption>video {index} · {len(item.frames)} frames · '
                f"{item.fps:g} fps · {item.duration_s:.2f} s · {width}×{height}</figcaption></figure>")
    wave, rate = item
    wav = media_to_json(item)["wav_b64"]
    return (f'<figure><audio controls preload="metadata" src="data:audio/wav;base64,{wav}"></audio>'
            f"<figcaption>audio {index} · {len(wave) / rate:.2f} s · {rate} Hz</figcaption></figure>")


def _segments(t: Trajectory) -> list[Segment]:
    """The record's segments; for a record without them, runs of the loss mask stand in for turns."""
    if t.segments:
        return t.segments
    segs = [Segment("prompt", 0, t.prompt_len, 0)] if t.prompt_len else []
    i, turn, n = t.prompt_len, 0, len(t.loss_mask)
    while i < n:
        j = i
        while j < n and t.loss_mask[j] == t.loss_mask[i]:
            j += 1
        trained = t.loss_mask[i] == 1
        turn += trained
        segs.append(Segment("policy" if trained else "env", i, j, turn))
        i = j
    return segs


def _token_spans(t: Trajectory, seg: Segment, detok: _Detokenizer) -> str:
    out = []
    for text, a, b in detok.pieces(t.token_ids[seg.start:seg.end]):
        idx = range(seg.start + a, seg.start + b)
        trained = any(t.loss_mask[i] for i in idx)
        lines = [
            f"#{i} id {t.token_ids[i]} · logprob {t.rollout_logprobs[i]:.3f} · v{t.versions[i]}"
            if t.loss_mask[i] else f"#{i} id {t.token_ids[i]} · masked"
            for i in idx
        ]
        cls = "t"
        if trained:
            p = math.exp(sum(t.rollout_logprobs[i] for i in idx))
            lines[-1] += f" · p {p:.3f}" if len(lines) == 1 else f"\njoint p {p:.3f}"
            cls += next((f" {c}" for limit, c in HEAT if p < limit), "")
        else:
            cls += " m"
        out.append(f'<span class="{cls}" title="{_e(chr(10).join(lines))}">{_e(text)}</span>')
    return "".join(out)


def _segment(t: Trajectory, seg: Segment, media: list[str], detok: _Detokenizer | None, per_token: bool) -> str:
    ids = t.token_ids[seg.start:seg.end]
    n, k = len(ids), sum(t.loss_mask[seg.start:seg.end])
    state = "masked" if k == 0 else "trained" if k == n else f"trained {k} of {n}"
    if seg.kind == "policy" and detok is not None and per_token:
        body = _token_spans(t, seg, detok)
    else:
        text = seg.text or (detok.tokenizer.decode(ids) if detok is not None and ids else "")
        if seg.kind == "glue":  # mostly whitespace: shown escaped ("\\n") or it would look empty
            text = json.dumps(text, ensure_ascii=False)[1:-1]
        collapsed = _REPEATS.sub(lambda m: f"{m.group(1)}×{len(m.group(0)) // len(m.group(1))}", text)
        body = _e(collapsed) if text else f'<span class="empty">no text recorded ({n} tokens)</span>'
    items = [media[i] if 0 <= i < len(media) else f'<span class="warn">media index {i} is not in the record</span>'
             for i in seg.media]
    kind = seg.kind if seg.kind in KIND_LABELS else "env"
    return (
        f'<div class="seg {kind}"><div class="seg-head"><span>{_e(KIND_LABELS.get(seg.kind, seg.kind))}</span>'
        f'<span class="mask">{state}</span><span class="rng">tokens {seg.start}–{seg.end} ({n})</span></div>'
        f'<div class="text">{body}</div>'
        + (f'<div class="media">{"".join(items)}</div>' if items else "")
        + "</div>"
    )


def _conversation(t: Trajectory, detok: _Detokenizer | None, per_token: bool) -> str:
    media = [_media(m, i) for i, m in enumerate(t.media)]
    out, turn = [], 0
    placed: set[int] = set()
    for seg in _segments(t):
        if seg.turn != turn and seg.turn > 0:
            turn = seg.turn  # one env step per policy turn: step_rewards[turn - 1] scored this one
            step = (f" · step reward {_num(t.step_rewards[turn - 1])}"
                    if 0 < turn <= len(t.step_rewards) else "")
            out.append(f'<div class="turn">turn {turn}{step}</div>')
        out.append(_segment(t, seg, media, detok, per_token))
        placed.update(seg.media)
    loose = [m for i, m in enumerate(media) if i not in placed]
    if loose:
        out.append(f'<div class="turn">media no segment brought in</div><div class="media">{"".join(loose)}</div>')
    return f'<div class="convo">{"".join(out)}</div>'


def _facts(t: Trajectory, problem: str | None) -> str:
    facts = []
    if problem:
        facts.append(f'<div><h4>record check</h4><pre class="warn">{_e(problem)}</pre></div>')
    if t.task:
        facts.append(f"<div><h4>task</h4><pre>{_e(t.task)}</pre></div>")
    if t.status_reason:
        facts.append(f'<div><h4>status reason</h4><pre class="warn">{_e(t.status_reason)}</pre></div>')
    if t.step_rewards:
        facts.append(f"<div><h4>step rewards</h4><pre>{_e(', '.join(_num(r) for r in t.step_rewards))}</pre></div>")
    if t.seed is not None:
        facts.append(f"<div><h4>seed</h4><pre>{t.seed}</pre></div>")
    if t.metrics:
        rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(_value(v))}</td></tr>" for k, v in t.metrics.items())
        facts.append(f"<div><h4>metrics</h4><table>{rows}</table></div>")
    if t.infos:
        dump = json.dumps(t.infos, indent=1, ensure_ascii=False, default=str)
        facts.append(f'<div><details class="more"><summary>infos ({len(t.infos)} steps)</summary>'
                     f"<pre>{_e(dump)}</pre></details></div>")
    return f'<div class="facts">{"".join(facts)}</div>'


def _card(number: int, t: Trajectory, detok: _Detokenizer | None, open_: bool) -> str:
    problem = _problem(t)
    total, trained = len(t.token_ids), t.num_generated
    turns = sum(s.kind == "policy" for s in _segments(t))
    steps = ", ".join(_num(r) for r in t.step_rewards[:8]) + (" …" if len(t.step_rewards) > 8 else "")
    row2 = [
        f'<span class="kv"><i>group</i>{_e(t.group_id or "—")}</span>',
        f'<span class="kv"><i>turns</i>{turns}</span>',
        f'<span class="kv"><i>tokens</i>{total} · <em>{trained} trained</em> · {total - trained} masked</span>',
        f'<span class="kv"><i>versions</i>{_versions(t)}</span>',
    ]
    if t.step_rewards:
        row2.append(f'<span class="kv"><i>step rewards</i>{_e(steps)}</span>')
    if t.status_reason:
        row2.append(f'<span class="reason" title="{_e(t.status_reason)}">{_e(_short(t.status_reason, 140))}</span>')
    if problem:
        row2.append('<span class="reason">record check failed (open for details)</span>')
    status = _status_class(t.status)
    task = f'<span class="task" title="{_e(_short(t.task, 2000))}">{_e(_short(t.task, 160))}</span>' if t.task else ""
    return (
        f'<details class="card {status}" id="t{number}" data-status="{_e(t.status)}" data-env="{_e(_env(t))}"'
        f'{" open" if open_ else ""}><summary>'
        f'<span class="row1"><span class="idx" title="record {number} of the file">#{number}</span>'
        f'<span class="badge {status}">{_e(t.status)}</span><span class="env-id">{_e(_env(t))}</span>'
        f'<span class="reward">reward <b>{_num(t.reward)}</b></span>{task}</span>'
        f'<span class="row2">{"".join(row2)}</span></summary><div class="body"></div>'
        f"<template>{_facts(t, problem)}{_conversation(t, detok, problem is None)}</template></details>"
    )


# --- public API ------------------------------------------------------------------------


def render_html(
    trajectories: Sequence[Trajectory], *, title: str = "relax_gym trajectories", tokenizer: Decoder | None = None
) -> str:
    """The page for `trajectories`; with a `tokenizer`, policy turns show per-token logprobs."""
    trajs = list(trajectories)
    detok = _Detokenizer(tokenizer) if tokenizer is not None else None
    open_ = len(trajs) <= OPEN_LIMIT
    cards = "\n".join(_card(i, t, detok, open_) for i, t in enumerate(trajs, 1))
    return PAGE.substitute(
        csp=CSP, title=_e(title), css=CSS, js=JS, summary=_summary(trajs),
        toolbar=_toolbar(trajs, detok is not None), cards=cards,
    )


def write_html(jsonl_path: str | Path, html_path: str | Path, *, tokenizer: Decoder | None = None) -> Path:
    """Renders a trajectories JSONL file (as `write_jsonl` writes it) to a self-contained HTML page."""
    src, out = Path(jsonl_path), Path(html_path)
    out.write_text(render_html(list(read_jsonl(src)), title=src.name, tokenizer=tokenizer), encoding="utf-8")
    return out
