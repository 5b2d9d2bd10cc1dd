"""Step-time model: how long one engine step (a mixed batch) takes on a hardware profile.

One vLLM step runs every scheduled token in a single forward pass, so

    step = max(memory time, compute time, reload time) + overhead

* memory time: weights plus the KV of every scheduled sequence read once from HBM
  (``HardwareProfile.decode_step_s`` with no compute term);
* compute time: ``HardwareProfile.prefill_s`` of each prefill chunk (linear FLOPs plus the
  attention of the chunk over its cached context) plus ``2·P`` FLOPs per decode token;
* reload time: KV reloaded from the CPU tier in this step over the offload bandwidth,
  overlapped with compute layer by layer as LMCache does (hence ``max``, not a sum);
* overhead: CPU-side scheduling and sampling, 0.95 ms per step (vLLM's scheduling
  overhead in the paper's Table 4).

The constants behind the profile (peak FLOP/s, HBM bandwidth, utilisation) are documented
in :mod:`estimator.profiles`; simulator/README.md compares the resulting step times with
published vLLM figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from estimator.profiles import HardwareProfile

__all__ = ["STEP_OVERHEAD_S", "StepTimer"]

STEP_OVERHEAD_S = 0.95e-3


class StepTimer:
    """Step times of one profile.

    >>> from estimator.profiles import get_profile
    >>> timer = StepTimer(get_profile("llama3.1-8b-h100"))
    >>> round(timer.step([], 1, 1000) * 1000, 2)        # one decode token, 1k context
    7.85
    >>> round(timer.step([(2048, 0)], 0, 0) * 1000, 1)  # one full prefill chunk
    63.4
    """

    def __init__(self, profile: HardwareProfile, overhead_s: float = STEP_OVERHEAD_S) -> None:
        self.profile = profile
        self.overhead_s = overhead_s
        rate = profile.peak_flops * profile.tensor_parallel * profile.prefill_mfu
        self._decode_token_s = 2.0 * profile.params / rate

    def step(
        self,
        prefills: Sequence[tuple[int, int]],
        decodes: int,
        context_tokens: float,
        reload_tokens: int = 0,
    ) -> float:
        """One step: ``prefills`` as ``(new, cached)`` token pairs, ``decodes`` decode
        tokens, ``context_tokens`` the KV read by all scheduled sequences."""
        profile = self.profile
        memory = profile.decode_step_s(0, context_tokens)
        compute = decodes * self._decode_token_s
        for new, cached in prefills:
            compute += profile.prefill_s(new, cached)
        reload = profile.reload_s(reload_tokens) if reload_tokens else 0.0
        return max(memory, compute, reload) + self.overhead_s

    def decode_run(
        self, batch: int, context_tokens: float, steps: int, start: float, limit: float
    ) -> tuple[int, float]:
        """Up to ``steps`` decode-only steps of ``batch`` sequences, the first reading
        ``context_tokens`` (growing by ``batch`` per step), each starting before ``limit``:
        ``(steps taken, their total time)``."""
        now = start
        count = 0
        while count < steps and now < limit:
            now += self.step((), batch, context_tokens + count * batch)
            count += 1
        return count, now - start
