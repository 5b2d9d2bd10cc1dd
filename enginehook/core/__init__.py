"""What both hosts run: the vLLM scheduler and the simulator drive these modules alike.

Plain ids, block counts and times; nothing here imports vLLM. A change here moves simulator
results: check it with ``scripts/sim-fingerprint`` (enginehook/README.md, "Which tests").
"""
