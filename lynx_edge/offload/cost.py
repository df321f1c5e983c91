"""Per-step cost model: for each expert a layer-step needs, hit / fetch / CPU compute.

Figures come from the hardware profile. One expert of b bytes needed by n tokens costs
    fetch  latency_link + b / h2d_GBps            (then GPU: b / hbm_GBps + n·f / gpu_FLOPs)
    cpu    latency_cpu + max(b / cpu_expert_GBps, n·f / cpu_FLOPs)
(an INT4 store's experts: b / cpu_int4_expert_GBps, their kernel's own measured rate, where the
profile has one)
with f = 6·D·I FLOPs per token. The link and the CPU work in parallel, so the misses are split
greedily (most tokens first) onto whichever finishes sooner — Fiddler's rule, balanced over the
step. LYNX's remap (onto resident or already-fetched experts) is decided before this, in the
router: residency-aware lynx_select counts resident experts as free, so only the critical set
minus what is resident reaches the miss list. Glossary: D hidden, I expert intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass

from .profile import Profile


@dataclass
class CostModel:
    profile: Profile
    expert_bytes: int
    flops_per_token: float  # 6·D·I: gate, up, down GEMVs
    pinned: bool = True
    cpu_mode: str = "auto"  # auto | never | always
    fmt: str = "bf16"  # the store's expert format: "int4" takes the profile's INT4 CPU rate

    def fetch_s(self) -> float:
        p = self.profile
        bw = p.h2d_pinned_gbps if self.pinned else p.h2d_pageable_gbps
        return p.link_latency_us * 1e-6 + self.expert_bytes / (bw * 1e9)

    def gpu_s(self, n: int) -> float:
        p = self.profile
        return self.expert_bytes / (p.gpu_hbm_gbps * 1e9) + n * self.flops_per_token / (p.gpu_tflops * 1e12)

    def cpu_s(self, n: int) -> float:
        p = self.profile
        gbps = (p.cpu_int4_expert_gbps if self.fmt == "int4" else None) or p.cpu_expert_gbps
        return p.cpu_latency_us * 1e-6 + max(self.expert_bytes / (gbps * 1e9),
                                             n * self.flops_per_token / (p.cpu_gflops * 1e9))

    def split(self, misses: list[int], counts: list[int]) -> tuple[list[int], list[int]]:
        """misses (expert ids), counts[e] = tokens of e → (fetch, cpu), each in ascending id order."""
        if self.cpu_mode == "never" or not misses:
            return list(misses), []
        if self.cpu_mode == "always":
            return [], list(misses)
        link = cpu = 0.0
        fetch, on_cpu = [], []
        for e in sorted(misses, key=lambda e: (-counts[e], e)):
            a, b = link + self.fetch_s() + self.gpu_s(counts[e]), cpu + self.cpu_s(counts[e])
            if a <= b:
                fetch.append(e)
                link += self.fetch_s()
            else:
                on_cpu.append(e)
                cpu += self.cpu_s(counts[e])
        return sorted(fetch), sorted(on_cpu)

    def layer_s(self, hit_tokens: list[int], fetch_tokens: list[int], cpu_tokens: list[int]) -> float:
        """Estimated expert time of one layer-step: link ∥ CPU, plus GPU compute of resident work."""
        link = len(fetch_tokens) * self.fetch_s()
        cpu = sum(self.cpu_s(n) for n in cpu_tokens)
        gpu = sum(self.gpu_s(n) for n in hit_tokens + fetch_tokens)
        return max(link, cpu) + gpu


__all__ = ["CostModel"]
