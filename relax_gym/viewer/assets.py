"""The page's skeleton, stylesheet and script, kept apart from the Python that fills them.

They are Python strings rather than package data so that a wheel ships them
with no packaging configuration. The page runs under a Content-Security-Policy
that admits only these two inline blocks (by hash) and `data:` media: nothing
is fetched, and markup smuggled into a record could not run even if escaping
ever failed.
"""

from string import Template

PAGE = Template("""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="$csp">
<link rel="icon" href="data:,">
<title>$title</title>
<style>$css</style>
</head>
<body>
<header class="top"><h1>$title</h1></header>
$summary
$toolbar
<main id="cards">
$cards
</main>
<script>$js</script>
</body>
</html>
""")

CSS = """
:root {
  --fg: #1f2328; --muted: #656d76; --line: #d8dee4; --bg: #f6f8fa; --card: #fff;
  --trained: #dcf5e3; --trained-edge: #1a7f37;
  --prompt: #eef0f3; --prompt-edge: #8c959f;
  --env: #e8eef8; --env-edge: #6e87b5;
  --glue: #f6f8fa; --glue-edge: #c4cbd3;
  --ok: #1a7f37; --warn: #9a6700; --bad: #cf222e; --off: #6e7781;
}
* { box-sizing: border-box; }
[hidden] { display: none !important; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "Liberation Sans", sans-serif;
  color: var(--fg); background: var(--bg); }
.top { padding: 14px 20px 4px; }
.top h1 { margin: 0; font-size: 18px; font-weight: 600; word-break: break-all; }
.summary { margin: 8px 20px; display: flex; flex-wrap: wrap; gap: 16px; align-items: flex-start; }
.stats { display: flex; flex-wrap: wrap; gap: 8px; }
.stat { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: 6px 12px; min-width: 92px; }
.stat b { display: block; font-size: 18px; }
.stat span { color: var(--muted); font-size: 12px; }
.stat[data-stat="status-completed"] b { color: var(--ok); }
.stat[data-stat="status-truncated"] b { color: var(--warn); }
.stat[data-stat="status-failed"] b { color: var(--bad); }
table { border-collapse: collapse; background: var(--card); font-size: 13px; }
th, td { border: 1px solid var(--line); padding: 3px 8px; text-align: right; white-space: nowrap; }
th { background: var(--bg); font-weight: 600; }
td:first-child, th:first-child { text-align: left; }
tr.total td { font-weight: 600; background: var(--bg); }
td.zero { color: #b6bdc5; }
.toolbar { position: sticky; top: 0; z-index: 2; background: var(--bg); border-bottom: 1px solid var(--line);
  padding: 8px 20px; display: flex; flex-wrap: wrap; gap: 6px 18px; align-items: center; }
.toolbar label { white-space: nowrap; }
.toolbar button, .toolbar select { font: inherit; padding: 2px 8px; }
#f-count { color: var(--muted); }
.legend { display: flex; flex-wrap: wrap; gap: 4px 12px; font-size: 12px; color: var(--muted); width: 100%; }
.legend span { white-space: nowrap; }
.sw { display: inline-block; width: 22px; height: 12px; vertical-align: -1px; margin-right: 4px;
  border: 1px solid; border-left-width: 4px; border-radius: 2px; }
.sw.policy { background: var(--trained); border-color: var(--trained-edge); }
.sw.prompt { background: var(--prompt); border-color: var(--prompt-edge); }
.sw.env { background: var(--env); border-color: var(--env-edge); }
.sw.glue { background: var(--glue); border-color: var(--glue-edge); border-style: dashed; }
.sw.t { border-width: 1px; }
main { padding: 6px 20px 40px; }
.card { background: var(--card); border: 1px solid var(--line); border-left: 5px solid var(--off);
  border-radius: 6px; margin: 8px 0; content-visibility: auto; contain-intrinsic-size: auto 64px; }
.card.st-completed { border-left-color: var(--ok); }
.card.st-truncated { border-left-color: var(--warn); }
.card.st-failed { border-left-color: var(--bad); }
.card > summary { cursor: pointer; padding: 6px 10px; list-style: none; }
.card > summary::-webkit-details-marker { display: none; }
.card > summary::before { content: "\\25B8"; float: left; width: 16px; color: var(--muted); }
.card[open] > summary::before { content: "\\25BE"; }
.card[open] > summary { border-bottom: 1px solid var(--line); }
.row1, .row2 { display: flex; flex-wrap: wrap; gap: 4px 14px; align-items: baseline; }
.row2 { font-size: 12px; color: var(--muted); padding-left: 16px; }
.idx { color: var(--muted); font-variant-numeric: tabular-nums; }
.env-id { font-weight: 600; }
.task { color: var(--muted); overflow: hidden; text-overflow: ellipsis; white-space: nowrap; max-width: 60ch; }
.reward b { font-variant-numeric: tabular-nums; }
.kv i { font-style: normal; color: #8c959f; margin-right: 3px; }
.kv em { font-style: normal; color: var(--trained-edge); }
.reason { color: var(--bad); font-weight: 600; }
.badge { border-radius: 10px; padding: 0 8px; font-size: 12px; font-weight: 600; color: #fff; background: var(--off); }
.badge.st-completed { background: var(--ok); }
.badge.st-truncated { background: var(--warn); }
.badge.st-failed { background: var(--bad); }
.body { padding: 8px 12px 12px; }
.facts { display: flex; flex-wrap: wrap; gap: 10px 24px; margin-bottom: 10px; font-size: 13px; }
.facts h4 { margin: 0 0 2px; font-size: 12px; color: var(--muted); font-weight: 600; }
.facts pre { margin: 0; white-space: pre-wrap; word-break: break-word; max-width: 80ch;
  max-height: 12em; overflow: auto; }
.facts table td { text-align: left; white-space: normal; word-break: break-word; max-width: 60ch; }
.turn { margin: 12px 0 4px; font-size: 12px; font-weight: 600; color: var(--muted);
  border-bottom: 1px solid var(--line); }
.seg { margin: 4px 0; border: 1px solid; border-left-width: 4px; border-radius: 4px; padding: 3px 8px 5px; }
.seg.policy { background: var(--trained); border-color: var(--trained-edge); }
.seg.prompt { background: var(--prompt); border-color: var(--prompt-edge); }
.seg.env { background: var(--env); border-color: var(--env-edge); }
.seg.glue { background: var(--glue); border-color: var(--glue-edge); border-style: dashed; padding: 1px 8px; }
.seg-head { display: flex; gap: 10px; font-size: 11px; color: var(--muted);
  text-transform: uppercase; letter-spacing: .03em; }
.seg-head .mask { font-weight: 600; }
.seg.policy .seg-head .mask { color: var(--trained-edge); }
.seg-head .rng { margin-left: auto; text-transform: none; font-variant-numeric: tabular-nums; }
.text { margin: 0; white-space: pre-wrap; word-break: break-word;
  font: 13px/1.45 ui-monospace, "SFMono-Regular", "DejaVu Sans Mono", "Liberation Mono", monospace; }
.seg.prompt .text, .seg.env .text { max-height: 28em; overflow: auto; color: #424a53; }
.seg.glue .text { color: var(--muted); font-size: 12px; }
.empty { color: var(--muted); font-style: italic; }
.t { border-radius: 2px; }
.t:hover { outline: 1px solid var(--trained-edge); }
.t.m { color: var(--muted); background: #e4e7eb; text-decoration: line-through dotted; }
.t.h1 { background: rgba(255, 140, 0, .22); }
.t.h2 { background: rgba(255, 100, 0, .40); }
.t.h3 { background: rgba(230, 40, 20, .50); }
.media { display: flex; flex-wrap: wrap; gap: 10px; margin-top: 6px; }
.media figure { margin: 0; font-size: 11px; color: var(--muted); }
.media img { display: block; min-height: 96px; max-width: 320px; max-height: 320px; border: 1px solid var(--line);
  image-rendering: auto; cursor: zoom-in; background: #fff; }
.media img.zoom { max-width: none; max-height: none; cursor: zoom-out; }
.media .strip { display: flex; flex-wrap: wrap; gap: 2px; max-width: 640px; }
.media .strip img { min-height: 0; max-width: 120px; max-height: 120px; }
.media audio { display: block; width: 300px; }
.warn { color: var(--bad); }
details.more summary { cursor: pointer; color: var(--muted); font-size: 12px; }
"""

JS = """
"use strict";
(() => {
  const cards = Array.from(document.querySelectorAll("details.card"));
  // A card's conversation sits in an inert template element until first opened, so a large file stays light.
  const fill = (card) => {
    const tpl = card.querySelector(":scope > template");
    if (!tpl) return;
    card.querySelector(":scope > .body").append(tpl.content);
    tpl.remove();
  };
  document.addEventListener("toggle", (e) => {
    const card = e.target;
    if (card instanceof HTMLDetailsElement && card.classList.contains("card") && card.open) fill(card);
  }, true);
  cards.filter((c) => c.open).forEach(fill);

  const boxes = Array.from(document.querySelectorAll("#f-status input"));
  const envSel = document.getElementById("f-env");
  const count = document.getElementById("f-count");
  const apply = () => {
    const statuses = new Set(boxes.filter((b) => b.checked).map((b) => b.value));
    let shown = 0;
    for (const c of cards) {
      const visible = statuses.has(c.dataset.status) && (!envSel.value || c.dataset.env === envSel.value);
      c.hidden = !visible;
      shown += visible ? 1 : 0;
    }
    count.textContent = `${shown} of ${cards.length} shown`;
  };
  boxes.forEach((b) => b.addEventListener("change", apply));
  envSel.addEventListener("change", apply);
  const setOpen = (open) => () => cards.forEach((c) => { if (!c.hidden) c.open = open; });
  document.getElementById("expand-all").addEventListener("click", setOpen(true));
  document.getElementById("collapse-all").addEventListener("click", setOpen(false));
  document.addEventListener("click", (e) => {
    if (e.target instanceof HTMLImageElement && e.target.closest(".media")) e.target.classList.toggle("zoom");
  });
  apply();
})();
"""
