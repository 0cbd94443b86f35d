"""The rich console every command prints through: one for the whole CLI, its width and colours read once."""

from __future__ import annotations

from rich.console import Console

console = Console()
