"""Hosts and URLs: whether a host is this machine, and the URL a bound server is reached at."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine: a server bound there stays on it, one reached there shares its memory."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_of(host: str, port: int) -> str:
    """The URL this machine reaches a server bound to `host`:`port` at (a wildcard address is reached on loopback)."""
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
