"""The vLLM adapter: everything that touches vLLM internals (scheduler subclasses, request
and block access, version checks, the hook's services and metrics endpoint).

A change here needs the ``vllm_contract`` tests (tests/enginehook/test_vllm_contract.py) and
the real-engine tests. vLLM loads the scheduler by the stable path
``enginehook.scheduler.CacheTTLScheduler`` (a re-export of :mod:`enginehook.vllm.scheduler`).
"""
