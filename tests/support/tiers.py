"""The CPU kernel tiers this machine runs, for the tests that run a kernel at each of them.

An AVX-512 BF16 machine runs avx512bf16, avx512 and avx2; a Zen 3 avx2 alone (sluice/cpu_tiers.py).
"none" (torch's own ops) runs everywhere. PLACES adds CUDA where torch sees a device.
"""

from __future__ import annotations

import pytest
import torch

from sluice.cpu_tiers import NO_TIER, cpu_flags, host_arch, runnable_tiers

# Best first.
KERNEL_TIERS = [tier.name for tier in runnable_tiers(host_arch(), cpu_flags())]
ALL_TIERS = [*KERNEL_TIERS, NO_TIER]

# Where an engine test runs: each CPU kernel tier this machine has, none, and CUDA (its Triton kernels,
# cuBLAS GEMMs and graphs) where torch sees a device; LLM(**place).
PLACES = [
    *(pytest.param({"cpu_isa": tier}, id=tier) for tier in ALL_TIERS),
    pytest.param(
        {"device": "cuda"},
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]
