"""A byte budget shared by stdout and stderr, so untrusted output never grows host memory."""

from __future__ import annotations


class CappedOutput:
    """Collects stdout and stderr until their sum reaches `limit` bytes.

    The budget is shared so that a program cannot get twice the limit through
    two streams. Past the limit the rest is dropped and `truncated` is set; the
    caller then stops the program (its output is no longer being read).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.truncated = False
        self._parts: tuple[bytearray, bytearray] = (bytearray(), bytearray())
        self._size = 0

    def add(self, chunk: bytes, *, stderr: bool) -> bool:
        """Append a chunk; False once the budget is spent (nothing more is kept)."""
        room = self.limit - self._size
        if len(chunk) > room:
            chunk = chunk[:room]
            self.truncated = True
        self._parts[stderr].extend(chunk)
        self._size += len(chunk)
        return not self.truncated

    @property
    def stdout(self) -> str:
        return self._parts[0].decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self._parts[1].decode("utf-8", errors="replace")
