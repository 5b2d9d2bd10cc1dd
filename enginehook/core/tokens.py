"""Bearer tokens: read from files (one printable line, whitespace stripped), and where one
may travel in clear (a loopback host only).

The hook's settings, the TTL-aware router and the cluster tools read their control-plane and
pin-command tokens through :func:`read_token`, so a bad file fails alike everywhere; the
link, the router's pin drops and the hook's endpoint ask :func:`is_loopback_host`.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

__all__ = ["is_loopback_host", "read_token"]


def read_token(path: str, where: str = "additional_config.cachettl.token_file") -> str:
    """The bearer token in ``path`` (whitespace stripped); a clear error naming ``where``
    (the setting that named the file)."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: cannot read {path!r}: {exc}") from None
    if not token or any(ord(c) < 0x21 or ord(c) > 0x7E for c in token):
        raise ValueError(f"{where}: {path!r} holds no token on one printable line")
    return token


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an IP address, without brackets) is this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
