"""The CPU kernel tiers this machine runs, for the tests that run a kernel at each of them.

An AVX-512 BF16 machine runs avx512bf16, avx512 and avx2; a Zen 3 avx2 alone (sluice/cpu_tiers.py).
"none" (torch's own ops) runs everywhere.
"""

from __future__ import annotations

from sluice.cpu_tiers import NO_TIER, cpu_flags, host_arch, runnable_tiers

# Best first.
KERNEL_TIERS = [tier.name for tier in runnable_tiers(host_arch(), cpu_flags())]
ALL_TIERS = [*KERNEL_TIERS, NO_TIER]
