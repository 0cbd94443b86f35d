"""The trajectory viewer: a self-contained HTML page per JSONL file (`relax-gym view F.jsonl -o F.html`)."""

from relax_gym.viewer.render import render_html, write_html

__all__ = ["render_html", "write_html"]
