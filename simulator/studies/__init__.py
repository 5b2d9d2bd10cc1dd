"""Studies over the simulator's model: benchmarks, ablations, seed verdicts, the frontier,
fidelity and calibration against the real engine, the demo, and their reports.

The model itself (engine, KV pool, loop, traces, workloads, policies, metrics) lives at the
top of :mod:`simulator`; nothing in the model imports a study.
"""
