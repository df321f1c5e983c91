"""OffloadedExperts: the experts interface of one MoE layer, served from the host store.

    __call__(x [N, D], ids [N, K], weights [N, K]) → [N, D]      (replaces block.experts)

Per layer-step: one host sync reads how many tokens use each expert and which are critical;
the cache splits the used experts into hits and misses; the cost model splits misses into
fetches (async copies into cache or scratch slots) and CPU experts; then, in this order so each
part overlaps the next: copies are issued (and the next layer's likely experts prefetched),
the CPU rows are read back, resident experts are launched on the device, the CPU computes its
experts, fetched experts run as their copies land, and bypassed experts run in waves through the
scratch slots. Per-expert results are summed in fp32 in ascending expert id, as moe_ref does, so
the output does not depend on where an expert ran. Glossary: N tokens, D hidden, E experts, K top-k.
"""
from __future__ import annotations

import torch
from torch import nn



class OffloadedExperts(nn.Module):
    def __init__(self, runtime, layer: int):
        super().__init__()
        self.rt, self.layer = runtime, layer  # plain attributes: no parameters, nothing for .to()

    @staticmethod
    def make(runtime, layer: int) -> "OffloadedExperts":
        """The layer's backend: one that also reads the family's own checkpoint tensors when the
        store format carries a reader (e.g. gpt-oss: stacked, interleaved, MXFP4, biases)."""
        if getattr(runtime.fmt, "reader", None) is not None:
            return ReadingOffloadedExperts(runtime, layer)
        return OffloadedExperts(runtime, layer)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, offloaded"

    def _groups(self, ids: torch.Tensor, weights: torch.Tensor, counts: list[int]):
        """expert → (token rows [n_e], weights [n_e]) in the stable expert-major order of moe_ref."""
        K = ids.shape[1]
        order = torch.argsort(ids.reshape(-1), stable=True)
        tok, w = order // K, weights.reshape(-1)[order]
        groups, start = {}, 0
        for e, n in enumerate(counts):
            if n:
                groups[e] = (tok[start : start + n], w[start : start + n])
                start += n
        return groups

    # -- load sink: experts stream from the checkpoint straight into the host store ----------
    num_experts = property(lambda self: self.rt.num_experts)
    hidden = property(lambda self: self.rt.cfg.hidden_size)
    inter = property(lambda self: self.rt.cfg.moe_intermediate_size)

    def load_part(self, e: int, part: str, w: torch.Tensor) -> None:
        self.rt.store.write_part(self.layer, e, part, w)

    def load_quant_part(self, e: int, part: str, ql) -> None:
        self.rt.store.write_quant_part(self.layer, e, part, ql)

    def load_fp8_part(self, e: int, part: str, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
        self.rt.store.write_fp8_part(self.layer, e, part, w, scale, block)

    def load_mx_part(self, e: int, part: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        self.rt.store.write_mx_part(self.layer, e, part, blocks, scales)

    def load_bias(self, e: int, part: str, b: torch.Tensor) -> None:
        self.rt.store.write_bias(self.layer, e, part, b)

    def finish_load(self) -> None:
        self.rt.store.finish_load()

    def _mlp(self, x: torch.Tensor, e: int, slot: int) -> torch.Tensor:
        return self.rt.fmt.compute(self.rt.slot_block(self.layer, e, slot), x)  # the format's own math

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rt, layer, E = self.rt, self.layer, self.rt.num_experts
        if layer == rt.first_layer:
            rt.begin_forward(x.shape[0])
        flat = ids.reshape(-1)
        crit = weights >= rt.crit_ratio * weights.amax(dim=1, keepdim=True)  # [N, K] critical votes
        votes = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, crit.reshape(-1).long())
        counts, votes = torch.stack([torch.bincount(flat, minlength=E), votes]).tolist()  # the host sync
        used = [e for e in range(E) if counts[e]]
        hits, misses = rt.cache.access(layer, used, [e for e in used if votes[e]])
        rt.count_prefetch_hits(layer, hits)
        fetch, on_cpu = rt.cost.split(misses, counts)
        slots, bypass = dict(hits), []
        for e in fetch:  # 1. copies into cache slots (admission per policy) start now
            s = rt.cache.admit(layer, e)
            if s is None:
                bypass.append(e)
            else:
                rt.fetch(layer, e, s)
                slots[e] = s
        if not rt.scratch and bypass:  # no scratch slot at all: run them on the CPU instead
            on_cpu, bypass = sorted(on_cpu + bypass), []
        if rt.prefetch:
            rt.prefetch_next(layer, x)
        groups = self._groups(ids, weights, counts)
        ys: dict[int, torch.Tensor] = {}
        cpu_jobs = [(e, groups[e][0]) for e in on_cpu]
        xh = rt.cpu.gather(x, cpu_jobs)  # before any expert kernel, so the read-back does not wait on them
        for e in sorted(hits):  # 2. resident experts: launched before the CPU work so they overlap
            rt.transfer.wait(slots[e])  # a prefetched expert may still be in flight
            ys[e] = self._mlp(x[groups[e][0]], e, slots[e])
        ys.update(rt.cpu.compute(layer, xh, cpu_jobs, x.device))  # 3. host experts (blocks the host only)
        for e in sorted(set(slots) - set(hits)):  # 4. fetched experts, each when its copy lands
            rt.transfer.wait(slots[e])
            ys[e] = self._mlp(x[groups[e][0]], e, slots[e])
        self._waves(x, bypass, groups, ys)  # 5. bypassed experts through the scratch slots
        rt.transfer.mark_used(slots.values())
        rt.cache.release()
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in used:  # fixed order: results independent of hit / fetch / CPU
            t, w = groups[e]
            out.index_add_(0, t, ys[e].float() * w[:, None])
        return out.to(x.dtype)

    def _waves(self, x, bypass: list[int], groups, ys) -> None:
        rt, R = self.rt, len(self.rt.scratch)
        for w0 in range(0, len(bypass), R):
            wave = list(zip(bypass[w0 : w0 + R], rt.scratch))
            for e, s in wave:
                rt.fetch(self.layer, e, s)
            for e, s in wave:
                rt.transfer.wait(s)
                ys[e] = self._mlp(x[groups[e][0]], e, s)
            rt.transfer.mark_used([s for _, s in wave])


class ReadingOffloadedExperts(OffloadedExperts):
    """OffloadedExperts whose loader hook `load_tensor` hands a family's stacked expert tensors to
    the format's reader, which calls load_part / load_mx_part / load_bias on this sink: experts
    land in the store as read (MXFP4 bytes stay MXFP4; no 16-bit layer is materialised)."""

    def __init__(self, runtime, layer: int):
        super().__init__(runtime, layer)
        self.reader = runtime.fmt.reader()

    def load_tensor(self, name: str, w: torch.Tensor) -> set[tuple[int, str]]:
        return self.reader.load_tensor(self, name, w)

    def finish_load(self) -> None:
        self.reader.finish()
        super().finish_load()


__all__ = ["OffloadedExperts", "ReadingOffloadedExperts"]
