"""Projection: replay recorded routing through the cache and cost model for a model shape and a
hardware profile → bytes per step, hit rate and tok/s. Always labelled "projected".

A trace is what the engine records with EngineConfig(record_routing=True):
`model.routing.stats.steps` ({layer: ids [T, K]} per forward) and `.decode` (phase per forward).
Only decode steps are replayed. When the trace's (E, K) equal the target shape's, expert ids
are replayed as they are and target layer l replays trace layer l mod L_trace (its own cache
keys). Otherwise the replay runs at the trace's (E, K) with the same cache fraction and bytes and
time are scaled by the ratio of expected unique experts per layer-step under uniform routing,
E·(1 − (1 − K/E)^B), target over trace, and by layers ("scaled": coarse). The trace holds ids only, so a
step's critical set is its rank-0 choices. Glossary: B batch, E experts, K top-k, L layers.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cache import ExpertCache
from .cost import CostModel
from .profile import Profile, load_profile

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int  # MoE layers
    num_experts: int  # E
    top_k: int  # K
    hidden: int  # D
    inter: int  # I (per expert)
    non_expert_params: float  # attention, embeddings, head, routers, norms
    kv_heads: int
    head_dim: int

    def expert_bytes(self, fmt: str = "bf16") -> int:
        if fmt == "int4":
            from .store import Int4Format

            return Int4Format(self.hidden, self.inter, 128).nbytes
        return 3 * self.hidden * self.inter * {"bf16": 2, "fp16": 2, "fp32": 4}[fmt]

    def kv_bytes(self, batch: int, ctx: int) -> int:
        return 2 * self.layers * batch * self.kv_heads * ctx * self.head_dim * 2  # bf16


# Published configs (config.json of each HF repo). non_expert = total params − L·E·3·D·I.
MODEL_SHAPES = {
    "mixtral-8x7b": ModelShape("Mixtral-8x7B", 32, 8, 2, 4096, 14336, 1.60e9, 8, 128),
    "qwen3-30b-a3b": ModelShape("Qwen3-30B-A3B", 48, 128, 8, 2048, 768, 1.54e9, 4, 128),
    "olmoe-1b-7b": ModelShape("OLMoE-1B-7B", 16, 64, 8, 2048, 1024, 0.48e9, 16, 128),
}


def trace_from_stats(stats, decode_only: bool = True) -> list[dict[int, list[list[int]]]]:
    """RoutingStats (steps, decode) → [{layer: [[ids of token t]…]}] on the host."""
    return [{ly: ids.tolist() for ly, ids in step.items()}
            for step, dec in zip(stats.steps, stats.decode) if dec or not decode_only]


def slots_for(shape: ModelShape, profile: Profile, batch: int, ctx: int = 4096, fmt: str = "bf16") -> int:
    """Expert slots the profile's GPU holds after non-expert weights (bf16), KV and the reserve."""
    if profile.unified_memory or not profile.gpu_memory_gib:
        return shape.layers * shape.num_experts
    room = (profile.gpu_memory_gib - profile.reserve_gib) * GIB - 2 * shape.non_expert_params
    room -= shape.kv_bytes(batch, ctx) + shape.top_k * shape.expert_bytes(fmt)  # scratch
    return int(max(0, min(shape.layers * shape.num_experts, room // shape.expert_bytes(fmt))))


def _unique(E: int, K: int, B: int) -> float:
    """Expected distinct experts per layer-step under uniform routing: E·(1 − (1 − K/E)^B)."""
    return E * (1 - (1 - K / E) ** B)


def _replay(steps, t_layers, layers: int, E: int, cache: ExpertCache, cost: CostModel):
    """Run every decode step's layers through cache + cost → (fetches, CPU calls, unique experts,
    expert seconds, tokens), summed over steps."""
    fetched = cpu_calls = unique = tokens = 0
    step_s = 0.0
    for s in steps:
        cache.tick()
        for ly in range(layers):
            ids = s[t_layers[ly % len(t_layers)]]
            counts = [0] * E
            for row in ids:
                for e in row:
                    counts[e] += 1
            used = [e for e in range(E) if counts[e]]
            hits, misses = cache.access(ly, used, {row[0] for row in ids})  # rank-0 choices are critical
            fetch, on_cpu = cost.split(misses, counts)
            for e in fetch:
                cache.admit(ly, e)
            cache.release()
            fetched, cpu_calls, unique = fetched + len(fetch), cpu_calls + len(on_cpu), unique + len(used)
            step_s += cost.layer_s([counts[e] for e in hits], [counts[e] for e in fetch], [counts[e] for e in on_cpu])
        tokens += len(s[t_layers[0]])
    return fetched, cpu_calls, unique, step_s, tokens


def project(trace: list[dict], shape: ModelShape | str, profile: Profile | str, policy: str = "lru",
            slots: int | None = None, fmt: str = "bf16", cpu_compute: str = "auto", ctx: int = 4096,
            trace_experts: int | None = None) -> dict:
    """Replay `trace` (trace_from_stats; its model had trace_experts experts per layer, inferred
    from the ids when None) → projected bytes/step, hit rate, tok/s (see module doc)."""
    shape = MODEL_SHAPES[shape.lower()] if isinstance(shape, str) else shape
    prof = load_profile(profile) if isinstance(profile, str) else profile
    steps = [s for s in trace if s]
    if not steps:
        raise ValueError("the trace has no decode steps (record with EngineConfig(record_routing=True))")
    t_layers = sorted(steps[0])
    first = steps[0][t_layers[0]]
    E_t = trace_experts or 1 + max(e for s in steps for ids in s.values() for row in ids for e in row)
    K_t = len(first[0])
    batch = max(len(s[t_layers[0]]) for s in steps)
    direct = E_t == shape.num_experts and K_t == shape.top_k
    eb = shape.expert_bytes(fmt)
    total_slots = slots if slots is not None else slots_for(shape, prof, batch, ctx, fmt)
    frac = total_slots / (shape.layers * shape.num_experts)
    if direct:
        E, layers, cache_slots, scale = shape.num_experts, shape.layers, total_slots, 1.0
    else:  # replay at the trace's own size, same cache fraction; scale by expected unique experts
        E, layers = E_t, len(t_layers)
        cache_slots = round(frac * layers * E)
        scale = _unique(shape.num_experts, shape.top_k, batch) / _unique(E_t, K_t, batch) * shape.layers / layers
    cache = ExpertCache(cache_slots, policy)
    cost = CostModel(prof, eb, 6.0 * shape.hidden * shape.inter, pinned=True, cpu_mode=cpu_compute, fmt=fmt)
    fetched, cpu_calls, unique, step_s, tokens = _replay(steps, t_layers, layers, E, cache, cost)
    n = len(steps)
    step_s = step_s * scale / n + 2 * shape.non_expert_params / (prof.gpu_hbm_gbps * 1e9)
    looked = cache.hits + cache.misses
    bytes_step = fetched * eb * scale / n
    return {
        "label": "projected", "mode": "direct" if direct else f"scaled from E={E_t},K={K_t} trace",
        "shape": shape.name, "profile": prof.name, "policy": policy, "expert_format": fmt,
        "expert_bytes": eb, "expert_slots": total_slots, "cache_fraction": frac, "steps": n,
        "tokens_per_step": tokens / n, "unique_experts_per_layer_step": unique / (n * layers),
        "hit_rate": cache.hits / looked if looked else 0.0, "bytes_per_step": bytes_step,
        "bytes_per_token": bytes_step * n / tokens, "cpu_expert_calls_per_step": cpu_calls * scale / n,
        "step_ms": 1e3 * step_s, "tok_s": tokens / n / step_s,
    }


__all__ = ["MODEL_SHAPES", "ModelShape", "project", "slots_for", "trace_from_stats"]
