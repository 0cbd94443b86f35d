"""The two ways a run ends early without a bug: it could not start, or it stopped.

The CLI turns each into one line and an exit code (2 and 1), never a
traceback: the message names the cause (the env, the key, the file, the record).
Library users catch them like any exception.
"""

from __future__ import annotations


class StartupError(ValueError):
    """What the run was given cannot work (a config key, an env, a data file, a model); nothing was started."""


class RunStopped(RuntimeError):
    """A started run cannot go on (it cannot learn, or its engine is gone); what it made so far is kept."""
