"""Hardware/model profiles: the constants behind prefill, reload and decode times.

Each profile is a documented roofline, not a measurement of ours:

* prefill FLOPs for ``t`` context tokens = ``2·P·t`` (weights) + ``2·L·d·t²`` (causal
  attention: QKᵀ and AV, each ``2·t²·d`` per layer, halved by the causal mask), run at
  ``prefill_mfu`` of the peak dense BF16 rate;
* decode time per step = (weight bytes + KV bytes read) / (HBM bandwidth · ``decode_mbu``);
* KV bytes per token = 2 (K and V) · layers · KV heads · head dim · 2 bytes (BF16);
* reload time = KV bytes / ``offload_bandwidth_bps`` (effective PCIe host↔device rate).

Sources of the constants:

* Model shapes: Llama-3.1 model cards / ``config.json`` (8B: 32 layers, d_model 4096,
  8 KV heads of dim 128, 8.03e9 parameters; 70B: 80 layers, d_model 8192, 8 KV heads of
  dim 128, 70.6e9 parameters).
* Peak dense BF16 tensor throughput and HBM bandwidth: NVIDIA H100 SXM5 datasheet
  (989 TFLOP/s, 3.35 TB/s, 80 GB) and A100 SXM4 80GB datasheet (312 TFLOP/s, 2.04 TB/s).
* Utilisation: prefill MFU 0.55 on one GPU and 0.45 under TP4 (an all-reduce per layer),
  decode bandwidth utilisation 0.7 (0.6 under TP4). These are our assumptions, in the
  range FlashAttention-2 reports for long-sequence forward passes on A100/H100 (50–70 % of
  peak, Dao 2023); the simulator checks the resulting step times against published vLLM
  figures and records the comparison.
* Offload bandwidth: PCIe Gen5 x16 (H100) ≈ 50 GB/s effective of 64 GB/s; PCIe Gen4 x16
  (A100) ≈ 25 GB/s effective of 32 GB/s; TP4 reloads four shards in parallel (4×).
* KV pool: memory left after weights at ``gpu_memory_utilization`` 0.9, less 4 GB of
  activations and CUDA graphs per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_PROFILE", "PROFILES", "HardwareProfile", "get_profile"]

#: The profile used wherever none is named (the paper's setting).
DEFAULT_PROFILE = "llama3.1-8b-h100"


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """A (model, GPU, parallelism) setup: enough to price prefill, decode and reload."""

    name: str
    model: str
    gpu: str
    tensor_parallel: int
    params: float  # model parameters
    layers: int
    d_model: int
    kv_heads: int
    head_dim: int
    peak_flops: float  # per GPU, dense BF16, FLOP/s
    hbm_bandwidth_bps: float  # per GPU, bytes/s
    hbm_bytes: float  # per GPU
    prefill_mfu: float
    decode_mbu: float
    offload_bandwidth_bps: float  # effective host↔device, all GPUs together
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 4e9  # per GPU
    bytes_per_param: float = 2.0
    kv_dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one token, all layers, all GPUs."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def kv_pool_bytes(self) -> float:
        """Bytes left for the KV cache over all GPUs."""
        per_gpu = (
            self.hbm_bytes * self.gpu_memory_utilization
            - self.params * self.bytes_per_param / self.tensor_parallel
            - self.activation_reserve_bytes
        )
        return max(0.0, per_gpu) * self.tensor_parallel

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens of KV the pool holds."""
        return int(self.kv_pool_bytes // self.kv_bytes_per_token)

    def prefill_s(self, tokens: float, cached_tokens: float = 0.0) -> float:
        """Roofline time to prefill ``tokens`` new tokens after ``cached_tokens`` of context."""
        t, c = float(tokens), float(cached_tokens)
        linear = 2.0 * self.params * t
        # Attention of the new tokens over the full context (causal within the new part).
        attention = 2.0 * self.layers * self.d_model * (t * t + 2.0 * t * c)
        rate = self.peak_flops * self.tensor_parallel * self.prefill_mfu
        return (linear + attention) / rate

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """Roofline time of one decode step for ``batch`` sequences holding ``context_tokens``."""
        weight_bytes = self.params * self.bytes_per_param
        kv_bytes = context_tokens * self.kv_bytes_per_token
        rate = self.hbm_bandwidth_bps * self.tensor_parallel * self.decode_mbu
        flops = 2.0 * self.params * batch
        compute = flops / (self.peak_flops * self.tensor_parallel * self.prefill_mfu)
        return max((weight_bytes + kv_bytes) / rate, compute)

    def reload_s(self, tokens: float) -> float:
        """Time to copy ``tokens`` of KV from host memory back to the GPU(s)."""
        return float(tokens) * self.kv_bytes_per_token / self.offload_bandwidth_bps

    def prefill_table(
        self, sizes: tuple[int, ...] = (1000, 2000, 4000, 8000, 16000, 32000, 65536, 131072)
    ) -> list[tuple[int, float]]:
        """``(tokens, seconds)`` points for the cost model's quadratic fit (paper §5.2)."""
        return [(n, self.prefill_s(n)) for n in sizes]


_H100: dict[str, Any] = {"peak_flops": 989e12, "hbm_bandwidth_bps": 3.35e12, "hbm_bytes": 80e9}
_A100: dict[str, Any] = {"peak_flops": 312e12, "hbm_bandwidth_bps": 2.039e12, "hbm_bytes": 80e9}
_LLAMA_8B: dict[str, Any] = {
    "params": 8.03e9,
    "layers": 32,
    "d_model": 4096,
    "kv_heads": 8,
    "head_dim": 128,
}
_LLAMA_70B: dict[str, Any] = {
    "params": 70.6e9,
    "layers": 80,
    "d_model": 8192,
    "kv_heads": 8,
    "head_dim": 128,
}

PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile(
            name=DEFAULT_PROFILE,
            model="Llama-3.1-8B",
            gpu="H100-SXM-80GB",
            tensor_parallel=1,
            prefill_mfu=0.55,
            decode_mbu=0.7,
            offload_bandwidth_bps=50e9,
            **_LLAMA_8B,
            **_H100,
        ),
        HardwareProfile(
            name="llama3.1-8b-a100",
            model="Llama-3.1-8B",
            gpu="A100-SXM-80GB",
            tensor_parallel=1,
            prefill_mfu=0.55,
            decode_mbu=0.7,
            offload_bandwidth_bps=25e9,
            **_LLAMA_8B,
            **_A100,
        ),
        HardwareProfile(
            name="llama3.1-70b-h100-tp4",
            model="Llama-3.1-70B",
            gpu="H100-SXM-80GB",
            tensor_parallel=4,
            prefill_mfu=0.45,
            decode_mbu=0.6,
            offload_bandwidth_bps=200e9,
            **_LLAMA_70B,
            **_H100,
        ),
    )
}


def get_profile(name: str) -> HardwareProfile:
    """The profile called ``name``; the error lists the valid names.

    >>> get_profile("llama3.1-8b-h100").kv_bytes_per_token
    131072
    >>> round(get_profile("llama3.1-8b-h100").prefill_s(4000), 3)
    0.126
    """
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware profile {name!r}; valid: {', '.join(sorted(PROFILES))}"
        ) from None
