"""Tell the routers in front of the engine that a session ended.

A session-affine router counts a session as active until it hears that it finished:
vllm-router's ``sticky_least_loaded`` places new sessions on the engine with the fewest
active ones and forgets a session only on ``POST /finish_session?session_id=...`` or after
``VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S`` (7,200 s by default). The end of a program
reaches the engine (a ``last_turn`` or ``release`` hint, Dynamo's final-request header) and
never the router, so finished sessions weigh on placement for two hours.

The session middleware calls :meth:`RouterNotifier.finish` once a request that ends its
session has been answered; the notifier posts ``/finish_session`` to every router named in
``$CACHETTL_ROUTER_URLS`` (comma-separated base URLs, e.g. ``http://router:30000``), on a
worker thread with a short timeout, never delaying a reply. A router that cannot be reached
is logged once per URL until it answers again; nothing is retried (the router's own idle
expiry remains the backstop).
"""

from __future__ import annotations

import logging
import os
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

__all__ = ["ENV", "RouterNotifier"]

logger = logging.getLogger("enginehook")

#: The environment variable naming the routers (comma-separated base URLs).
ENV = "CACHETTL_ROUTER_URLS"
_TIMEOUT_S = 2.0


def _urls(text: str) -> list[str]:
    urls = []
    for part in text.split(","):
        url = part.strip().rstrip("/")
        if not url:
            continue
        scheme = urllib.parse.urlsplit(url).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"${ENV}: {url!r} is not an http(s) URL")
        urls.append(url)
    return urls


class RouterNotifier:
    """Posts ``/finish_session`` for ended sessions to ``urls`` (default: the routers in
    ``$CACHETTL_ROUTER_URLS``).

    >>> RouterNotifier([]).finish("s-1")  # no router named: nothing to do
    False
    """

    def __init__(self, urls: Sequence[str] | None = None) -> None:
        self.urls = list(urls) if urls is not None else _urls(os.environ.get(ENV, ""))
        self._pool = ThreadPoolExecutor(1, "cachettl-routers") if self.urls else None
        self._failing: set[str] = set()
        self.sent = 0
        self.failed = 0

    def finish(self, session_id: str) -> bool:
        """Tell every router that ``session_id`` ended (in the background); ``False`` when
        no router is named."""
        if self._pool is None:
            return False
        self._pool.submit(self._post_all, session_id)
        return True

    def _post_all(self, session_id: str) -> None:
        query = urllib.parse.urlencode({"session_id": session_id})
        for url in self.urls:
            request = urllib.request.Request(f"{url}/finish_session?{query}", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=_TIMEOUT_S):
                    pass
            except OSError as exc:
                self.failed += 1
                if url not in self._failing:
                    self._failing.add(url)
                    logger.warning("CacheTTL: %s/finish_session failed: %s", url, exc)
                continue
            self.sent += 1
            self._failing.discard(url)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
