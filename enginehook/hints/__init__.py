"""What a client tells the engine about a request: its session (program) id and its hints.

- :mod:`enginehook.hints.sessions`: the ASGI middleware that reads session ids and hint
  fields from HTTP requests (loaded as ``enginehook.sessions.SessionIdMiddleware``);
- :mod:`enginehook.hints.choice`: which session id a request carries (the sources in
  precedence order, an id's limits, sub-agents' programs);
- :mod:`enginehook.hints.ids`: the engine's own check of an id that reached it;
- :mod:`enginehook.hints.flat`: the per-request :class:`~enginehook.hints.flat.Hints` the
  scheduler reads from ``vllm_xargs`` and the KV-hint envelope
  (:mod:`controlplane.kvhints`).
"""
