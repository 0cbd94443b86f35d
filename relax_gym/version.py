"""The installed package's version, in a module of its own so that any part (a server's `/health`) can read it
without importing the package face, which imports the env API and everything under it."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("relax-gym")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
