"""attach_offload: turn a loaded model into an offloaded one, and the runtime that serves it.

    rt = attach_offload(engine.model, OffloadOptions(expert_slots=64, policy="lynx", lynx="lynx"))
    ... engine.generate(...) ...
    rt.stats()  # hits, misses, hit_rate, bytes_h2d, bytes_per_token, cpu_expert_calls, …

Every MoEBlock's StackedExperts moves into the host store (layer by layer, freed as it goes) and
is replaced by OffloadedExperts; attention, embeddings, routers and KV stay on the device. With
residency-aware LYNX, the routing hook becomes ResidencyRoute: lynx_select with resident= the
cache's residency, so resident experts are free remap targets and only the critical set minus
what is resident crosses the link (at B = 1 too). Glossary: N tokens, E experts, K top-k.
"""
from __future__ import annotations

import warnings

import psutil
import torch

from ..models.layers import StackedExperts
from ..routing import ExactRouter
from .cache import ExpertCache
from .cost import CostModel
from .cpu_experts import CpuExperts
from .experts import OffloadedExperts
from .options import OffloadOptions
from .plan import Plan, make_plan
from .profile import detect_profile, load_profile
from .store import HostExpertStore, store_format
from .transfer import Transfer


class ResidencyRoute:
    """route(logits [N, E], is_decode [N], layer) → (ids, weights) via lynx_select(resident=…).

    Counts, on the device (no sync), token-slots moved off their exact choice and, of those, the
    ones moved onto a resident expert. Records into a LynxTelemetry when given one."""

    def __init__(self, spec, cfg, runtime, telemetry=None):
        from ..lynx import LynxConfig

        self.spec, self.cfg, self.rt = spec, LynxConfig.parse(cfg), runtime
        self.telemetry = telemetry

    def __call__(self, logits, is_decode, layer, probs=None):
        from ..lynx import lynx_select

        res = self.rt.resident_mask(layer)
        r = lynx_select(logits, is_decode, self.spec, self.cfg, layer, resident=res, probs=probs)
        if self.telemetry is not None:
            self.telemetry.record(layer, r)
        ids0 = torch.topk(logits, self.spec.top_k, dim=-1).indices  # the exact choices (as a set)
        moved = (r.ids.unsqueeze(-1) != ids0.unsqueeze(1)).all(-1)  # [N, K]
        self.rt.count_remap(moved, moved & res[r.ids])
        return r.ids, r.weights


class OffloadRuntime:
    """Owns the store, cache, device slot pool, transfer, CPU experts and cost model; counters."""

    def __init__(self, cfg, device: torch.device, plan: Plan, opts: OffloadOptions, store: HostExpertStore, profile):
        self.cfg, self.plan, self.opts, self.store, self.profile = cfg, plan, opts, store, profile
        self.device, self.fmt = torch.device(device), store.fmt
        self.model = None  # bind() once the model is built
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.moe_layers = cfg.moe_layer_ids
        self.first_layer = self.moe_layers[0]
        self.prefetch = opts.prefetch
        S, R = plan.expert_slots, plan.scratch_slots
        self.cache = ExpertCache(S, plan.policy)
        # On a CPU device the experts are computed in place from the host store: the "slots" are
        # bookkeeping only, never a second copy. pin="on" keeps the copy path on CPU (it stands in
        # for the device in tests of pinned/staged transfers).
        self.in_place = self.device.type == "cpu" and opts.pin != "on"
        n_pool = 0 if self.in_place else S + R
        self.pool = torch.empty(n_pool, store.nbytes, dtype=torch.uint8, device=self.device)  # [S + R, nbytes]
        self.scratch = list(range(S, S + R))
        self.transfer = Transfer(store, self.pool, copy=not self.in_place)
        self.cpu = CpuExperts(store)
        self.cost = CostModel(profile, store.nbytes, 6.0 * cfg.hidden_size * cfg.moe_intermediate_size,
                              pinned=not store.pin_failed and store.pin_limit is None, cpu_mode=opts.cpu_compute,
                              fmt=store.fmt.name)
        # critical vote: weight ≥ (K/E)^(1/β)·top weight ⇔ LYNX bin 0 (gap < ln(E/K)/β, β = 4), a
        # decisive vote: always critical whatever B, so it predicts what residency-aware LYNX fetches
        E, K = cfg.num_experts, cfg.top_k
        self.crit_ratio = (K / E) ** 0.25 if E > K else 0.0
        self._gates: dict = {}
        self._mask: dict[int, tuple[int, torch.Tensor]] = {}
        self._prefetched: set[tuple[int, int]] = set()
        self.route: ResidencyRoute | None = None
        self._saved_route = None
        self.reset_stats()

    def bind(self, model) -> None:
        """Attach to the built model: its routers (for prefetch) and routing context."""
        self.model = model
        self._gates = {a: model.layers[b].mlp.gate for a, b in zip(self.moe_layers, self.moe_layers[1:])}
        self._saved_route = model.routing.route
        model.offload = self

    def slot_block(self, layer: int, e: int, slot: int) -> torch.Tensor:
        """The bytes expert (layer, e) is computed from: its device slot, or in place on a CPU device."""
        return self.store.block(layer, e) if self.in_place else self.pool[slot]

    # -- counters --------------------------------------------------------------------------
    def reset_stats(self) -> None:
        c = self.cache
        c.hits = c.misses = c.evictions = c.admissions = c.bypasses = 0
        self.transfer.bytes_h2d = self.transfer.copies = self.transfer.staged = 0
        self.cpu.calls = self.cpu.tokens = 0
        self.cpu.seconds = 0.0
        self.n = dict(forwards=0, tokens=0, decode_steps=0, decode_tokens=0, decode_bytes=0, prefetch_bytes=0,
                      prefetch_hits=0)
        self._remap = torch.zeros(2, dtype=torch.int64, device=self.device)

    def begin_forward(self, tokens: int) -> None:
        self.cache.tick()
        self.n["forwards"] += 1
        self.n["tokens"] += tokens
        if self.model.routing.is_decode:
            self.n["decode_steps"] += 1
            self.n["decode_tokens"] += tokens

    def fetch(self, layer: int, e: int, slot: int, prefetch: bool = False) -> None:
        nbytes = self.transfer.fetch(layer, e, slot)
        if self.model.routing.is_decode:
            self.n["decode_bytes"] += nbytes
        if prefetch:
            self.n["prefetch_bytes"] += nbytes
            self._prefetched.add((layer, e))

    def count_remap(self, moved: torch.Tensor, to_resident: torch.Tensor) -> None:
        self._remap += torch.stack([moved.sum(), to_resident.sum()])

    def count_prefetch_hits(self, layer: int, hits: dict) -> None:
        if self._prefetched:
            for e in hits:
                if (layer, e) in self._prefetched:
                    self.n["prefetch_hits"] += 1
            self._prefetched = {k for k in self._prefetched if k[0] != layer}

    def stats(self) -> dict:
        """Counters since attach / reset_stats (one host sync)."""
        c, n = self.cache, self.n
        moved, to_res = self._remap.tolist()
        looked = c.hits + c.misses
        return {
            "hits": c.hits, "misses": c.misses, "hit_rate": c.hits / looked if looked else 0.0,
            "bytes_h2d": self.transfer.bytes_h2d,
            "bytes_per_token": self.transfer.bytes_h2d / n["tokens"] if n["tokens"] else 0.0,
            "decode_bytes_h2d": n["decode_bytes"],
            "bytes_per_decode_step": n["decode_bytes"] / n["decode_steps"] if n["decode_steps"] else 0.0,
            "bytes_per_decode_token": n["decode_bytes"] / n["decode_tokens"] if n["decode_tokens"] else 0.0,
            "cpu_expert_calls": self.cpu.calls, "evictions": c.evictions, "admissions": c.admissions,
            "bypasses": c.bypasses, "remapped_slots": moved, "remapped_to_resident": to_res,
            "prefetch_bytes": n["prefetch_bytes"], "prefetch_hits": n["prefetch_hits"],
            "copies": self.transfer.copies, "staged_copies": self.transfer.staged,
            "forwards": n["forwards"], "tokens": n["tokens"], "decode_steps": n["decode_steps"],
            "decode_tokens": n["decode_tokens"], "resident_experts": c.resident_count(),
            "expert_slots": c.num_slots, "policy": c.policy,
            "pinned_host_bytes": self.store.pinned_bytes, "host_bytes": self.store.host_bytes(),
        }

    # -- residency and prefetch ------------------------------------------------------------
    def resident_mask(self, layer: int) -> torch.Tensor:
        """bool [E] on the device: experts of `layer` in the cache (prefetched ones included)."""
        ver = self.cache.layer_version.get(layer, 0)
        got = self._mask.get(layer)
        if got is None or got[0] != ver:
            mask = torch.tensor(self.cache.resident(layer, self.num_experts), dtype=torch.bool)
            got = self._mask[layer] = (ver, mask.to(self.device, non_blocking=True))
        return got[1]

    def prefetch_next(self, layer: int, x: torch.Tensor) -> None:
        """Next MoE layer's router on this layer's input x [N, D] → fetch its likely experts now."""
        gate = self._gates.get(layer)
        if gate is None:
            return
        nxt = self.moe_layers[self.moe_layers.index(layer) + 1]
        likely = torch.topk(gate(x).float(), self.top_k, dim=-1).indices.unique().tolist()
        for e in likely:
            if self.cache.slot(nxt, e) < 0:
                s = self.cache.admit(nxt, e, lock=False)
                if s is not None:
                    self.fetch(nxt, e, s, prefetch=True)

    # -- routing ---------------------------------------------------------------------------
    def set_lynx(self, mode) -> None:
        """mode None: keep the model's router (made residency-aware if it is a LYNX router);
        "off": exact routing; "lynx", "budget:m", … or a LynxConfig: residency-aware LYNX."""
        routing = self.model.routing
        cur = routing.route
        if mode is None:
            if isinstance(cur, ResidencyRoute) or not hasattr(cur, "resident") or not hasattr(cur, "cfg"):
                return
            mode, telemetry = cur.cfg, getattr(cur, "telemetry", None)  # an installed LynxRouter
        elif mode == "off":
            routing.route, self.route = ExactRouter(routing.spec), None
            return
        else:
            telemetry = getattr(cur, "telemetry", None)
        self.route = routing.route = ResidencyRoute(routing.spec, mode, self, telemetry)

    def detach(self) -> None:
        """Put resident experts (from the store) and the original router back; offloading ends."""
        self.transfer.synchronize()  # no copy may still be writing into the pool
        for layer in self.moe_layers:
            self.model.layers[layer].mlp.experts = self._resident(layer)
        self.model.routing.route = self._saved_route
        self.model.offload = None

    def _resident(self, layer: int):
        """Layer's experts as a resident backend: StackedExperts for plain SwiGLU formats; the
        family's own backend, fed by the format's export (as held: MXFP4 stays MXFP4), otherwise."""
        from ..models.transformer import family_of

        cfg, dt = self.model.cfg, self.model.dtype
        if hasattr(self.fmt, "export"):
            be = family_of(cfg).experts(cfg, layer, dt, self.device, four_bit=self.fmt.name == "mxfp4")
            for e in range(cfg.num_experts):
                self.fmt.export(self.store.block(layer, e), e, be)
            return be
        se = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dt, self.device)
        for e in range(cfg.num_experts):
            gu, dn = self.store.weights(layer, e, dt)
            se.gate_up.data[e].copy_(gu)
            se.down.data[e].copy_(dn)
        return se


def make_runtime(cfg, opts: OffloadOptions, dtype: torch.dtype, device, profile=None, fmt=None,
                 device_bytes_in_use: int = 0, host_extra: int = 0) -> OffloadRuntime:
    """Plan placement and allocate the (pinned) host store and device slots — before any weight
    is read; the builder then streams experts into `rt.store` and calls `rt.bind(model)`."""
    dev = torch.device(device)
    prof = profile or (load_profile(opts.profile) if opts.profile else detect_profile(dev))
    fmt = fmt or store_format(cfg, opts.expert_format, dtype, opts.int4_group)
    plan = make_plan(cfg, opts, dtype, dev, prof, host_available=psutil.virtual_memory().available + host_extra,
                     device_bytes_in_use=device_bytes_in_use, fmt=fmt)
    want_pin = opts.pin == "on" or (opts.pin == "auto" and dev.type == "cuda")
    store = HostExpertStore(fmt, cfg.num_experts, want_pin, plan.pin_limit_bytes, opts.staging_slots)
    for i in cfg.moe_layer_ids:
        store.ensure_layer(i)  # exact-size (pinned) buffers now, filled as the checkpoint streams
    return OffloadRuntime(cfg, dev, plan, opts, store, prof)


def attach_offload(model, options: OffloadOptions | None = None, profile=None) -> OffloadRuntime:
    """Offload an already loaded model's experts (see module doc) → the runtime (also kept as
    model.offload). Engine.from_pretrained(offload=True) streams into the store instead."""
    opts = options or OffloadOptions()
    if getattr(model, "offload", None) is not None:
        raise RuntimeError("offload is already attached to this model")
    dev = torch.device(opts.device) if opts.device else model.device
    cfg = model.cfg
    blocks = [model.layers[i].mlp for i in cfg.moe_layer_ids]
    on_host = sum(p.numel() * p.element_size() for b in blocks for p in b.experts.parameters() if p.device.type == "cpu")
    on_dev = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "cuda")
    # a backend that exports itself (a family's own experts) keeps its form: 4-bit stays 4-bit
    own = hasattr(blocks[0].experts, "export_to")
    four = opts.expert_format == "int4" or (own and getattr(blocks[0].experts, "four_bit", False))
    fmt = store_format(cfg, "int4" if four else opts.expert_format, model.dtype, opts.int4_group)
    rt = make_runtime(cfg, opts, model.dtype, dev, profile, fmt=fmt, device_bytes_in_use=on_dev, host_extra=on_host)
    for i, block in zip(cfg.moe_layer_ids, blocks):
        if own:
            block.experts.export_to(OffloadedExperts(rt, i))  # every expert through the store sink
        else:
            rt.store.put(i, *block.experts.weights())  # row-major (resident CPU experts may be packed)
        block.experts = torch.nn.Identity()  # frees this layer's resident experts before the next one
    if dev != model.device:
        model.to(dev)
        model.device = dev
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    for i, block in zip(cfg.moe_layer_ids, blocks):
        block.experts = OffloadedExperts(rt, i)
    rt.bind(model)
    _install_route(rt, opts)
    return rt


def _install_route(rt: OffloadRuntime, opts: OffloadOptions) -> None:
    try:
        rt.set_lynx(opts.lynx)
    except ImportError as exc:
        if opts.lynx is not None:
            raise
        warnings.warn(f"residency-aware LYNX unavailable ({exc}); routing left as it was", RuntimeWarning)


__all__ = ["OffloadRuntime", "ResidencyRoute", "attach_offload", "make_runtime"]
