"""What a client tells the engine about a request: its session (program) id and its hints.

- :mod:`enginehook.hints.sessions`: the ASGI middleware that reads session ids and hint
  fields from HTTP requests (loaded as ``enginehook.sessions.SessionIdMiddleware``);
- :mod:`enginehook.hints.flat`: the per-request :class:`~enginehook.hints.flat.Hints` the
  scheduler reads from ``vllm_xargs`` and the KV-hint envelope
  (:mod:`controlplane.kvhints`).
"""
