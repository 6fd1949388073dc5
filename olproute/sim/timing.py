"""Ground-truth batch times for the simulator.

The default is a roofline of the model on its GPU: the larger of compute time (linear
layers plus attention) and memory time (weights plus KV reads and writes), plus the
tensor-parallel all-reduces and a fixed per-batch overhead, times seeded lognormal noise
of mean 1. It is deliberately not the 4-coefficient linear model that the BEA estimator
fits (``max`` of two sums is not linear in the batch sums), so the estimator is tested
against something it cannot reproduce exactly. ``LinearTiming`` is that 4-term model,
for tests that need the estimator's own model as the truth.

Both take the batch sums of ``BatchCore.schedule``: (num_seqs, num_tokens,
num_decode_tokens, sum_decode_context, num_prefill_tokens, sum_prefill_attention,
num_prefill_seqs, sum_prefill_context).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from olproute.config.schema import GpuProfile, ModelProfile

_NOISE_BLOCK = 4096


class _LognormalNoise:
    """Multiplicative noise of mean 1 and the given coefficient of variation."""

    def __init__(self, cv: float, rng: np.random.Generator) -> None:
        self._rng = rng
        self._sigma = math.sqrt(math.log1p(cv * cv)) if cv > 0 else 0.0
        self._buf: list[float] = []

    def draw(self) -> float:
        if self._sigma == 0.0:
            return 1.0
        if not self._buf:
            mu = -0.5 * self._sigma * self._sigma
            self._buf = self._rng.lognormal(mu, self._sigma, _NOISE_BLOCK).tolist()
            self._buf.reverse()
        return self._buf.pop()


class RooflineTiming:
    """Batch time in seconds of one instance: model profile on tensor_parallel GPUs."""

    def __init__(
        self,
        model: ModelProfile,
        gpu: GpuProfile,
        tensor_parallel: int,
        overhead_s: float,
        noise_cv: float,
        rng: np.random.Generator,
    ) -> None:
        tp = float(tensor_parallel)
        flops_per_s = gpu.peak_bf16_flops * gpu.compute_efficiency * tp
        bytes_per_s = gpu.hbm_bandwidth_bytes_per_s * gpu.memory_efficiency * tp
        # linear layers: 2 FLOPs per parameter per token
        self._s_per_token_flops = 2.0 * model.num_params / flops_per_s
        # attention: QK^T and PV, 2 FLOPs per multiply-add, per query-key pair
        attn_flops = 4.0 * model.num_layers * model.num_attention_heads * model.head_dim
        self._s_per_key_flops = attn_flops / flops_per_s
        self._weights_s = model.weight_bytes / bytes_per_s
        self._s_per_kv_token = model.kv_bytes_per_token / bytes_per_s
        # two ring all-reduces of the hidden states per layer
        if tensor_parallel > 1:
            self._comm_fixed_s = 2.0 * model.num_layers * gpu.interconnect_latency_s
            ring = 2.0 * (tp - 1.0) / tp
            self._comm_s_per_token = (2.0 * model.num_layers * ring * model.hidden_size
                                      * model.bytes_per_param / gpu.interconnect_bytes_per_s)
        else:
            self._comm_fixed_s = 0.0
            self._comm_s_per_token = 0.0
        self._overhead_s = overhead_s
        self._noise = _LognormalNoise(noise_cv, rng)

    def mean_time_s(self, sums: Sequence[float]) -> float:
        """Noise-free batch time in seconds."""
        num_tokens, num_decode, dec_ctx = sums[1], sums[2], sums[3]
        pre_tokens, pre_attn, pre_ctx = sums[4], sums[5], sums[7]
        keys = dec_ctx + num_decode + pre_attn
        compute = self._s_per_token_flops * num_tokens + self._s_per_key_flops * keys
        memory = self._weights_s + self._s_per_kv_token * (dec_ctx + num_decode + pre_ctx
                                                           + pre_tokens)
        comm = self._comm_fixed_s + self._comm_s_per_token * num_tokens
        return max(compute, memory) + comm + self._overhead_s

    def __call__(self, sums: Sequence[float]) -> float:
        return self.mean_time_s(sums) * self._noise.draw()


class LinearTiming:
    """The 4-term batch-time model of docs/design.md section 2, as a ground truth for tests:
    T = b0 + b1*num_tokens + b2*sum_decode_context + b3*sum_prefill_attention."""

    def __init__(
        self, beta: Sequence[float], noise_cv: float, rng: np.random.Generator
    ) -> None:
        if len(beta) != 4:
            raise ValueError("beta must have 4 coefficients")
        self.beta = tuple(float(b) for b in beta)
        self._noise = _LognormalNoise(noise_cv, rng)

    def mean_time_s(self, sums: Sequence[float]) -> float:
        b0, b1, b2, b3 = self.beta
        return b0 + b1 * sums[1] + b2 * sums[3] + b3 * sums[5]

    def __call__(self, sums: Sequence[float]) -> float:
        return self.mean_time_s(sums) * self._noise.draw()
