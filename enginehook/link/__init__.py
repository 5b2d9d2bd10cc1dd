"""The hook's link to the control plane: events out, model snapshots in.

- :mod:`enginehook.link.sinks`: where finished tool calls go (nowhere, a JSONL file, or the
  control plane) and the factory that picks one from the hook's config;
- :mod:`enginehook.link.remote`: the background link with its durable event buffer;
- :mod:`enginehook.link.transport`: how events reach the control plane (the gRPC transport,
  the checked client, the events as the control plane's records);
- :mod:`enginehook.link.snapshot`: turning a streamed snapshot into local models.

Nothing here runs on the scheduler's thread except enqueueing an event.
"""
