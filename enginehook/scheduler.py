"""The stable path vLLM loads the hook by:
``--scheduler-cls enginehook.scheduler.CacheTTLScheduler`` (or ``CacheTTLAsyncScheduler``).
The classes live in :mod:`enginehook.vllm.scheduler`."""

from enginehook.vllm.scheduler import CacheTTLAsyncScheduler, CacheTTLScheduler

__all__ = ["CacheTTLAsyncScheduler", "CacheTTLScheduler"]
