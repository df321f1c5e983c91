"""Device expert cache: S slots shared by all MoE layers, an expert→slot table, two policies.

Keys are (layer, expert). One layer-step calls access() with the experts the step uses (they are
locked until release(): never evicted mid-step), then admit() for each miss it fetches.

Demand. Every use of (layer, e) updates d ← d·γ^(forwards since its last update) + v, with
v = 1 when e is in the step's critical set and v = 0.25 otherwise; γ = 0.95 per forward (tick()).
The runtime's critical set: experts with a decisive vote, i.e. some token gives e a gate weight
≥ (K/E)^(1/4) × its top weight (LYNX bin 0 with β = 4; rank-0 choices always qualify) — those
are what residency-aware LYNX can never remap away. Demand is kept for non-resident experts too.

Policies.
  lru : every miss is admitted; the victim is the least recently used unlocked slot.
  lynx: the victim is the unlocked slot with the lowest current demand (ties → least recently
        used); a miss is admitted iff a slot is free or its demand is strictly greater than the
        victim's, otherwise it is bypassed (used once from a scratch slot or on the CPU, the
        cache unchanged). A one-off, low-affinity choice never displaces an expert the batch keeps
        needing, and when the working set is larger than the cache, a stable subset stays
        resident instead of LRU's cyclic thrash (zero hits).

Counters: hits, misses, evictions, admissions, bypasses (bytes are counted by the transfer).
"""
from __future__ import annotations

import heapq
import math

POLICIES = ("lru", "lynx")


class ExpertCache:
    def __init__(self, num_slots: int, policy: str = "lru", decay: float = 0.95, minor: float = 0.25):
        if policy not in POLICIES:
            raise ValueError(f"cache policy {policy!r} is unknown (use {' or '.join(POLICIES)})")
        self.num_slots, self.policy = num_slots, policy
        self.decay, self.minor = decay, minor
        self._c = math.log(1.0 / decay)  # d·γ^(s−t) ordered as ln d + t·ln(1/γ): static between uses
        self.key_of: list[tuple[int, int] | None] = [None] * num_slots
        self.slot_of: dict[tuple[int, int], int] = {}
        self.free = list(range(num_slots - 1, -1, -1))  # pop() → lowest slot first
        self.locked: set[int] = set()
        self.step = 0  # forwards seen (tick)
        self._seq = 0  # recency order of touches
        self._ver = [0] * num_slots
        self._last_use = [0] * num_slots
        self._heap: list[tuple[tuple, int, int]] = []  # (priority, slot, version), lazily invalidated
        self.demand: dict[tuple[int, int], tuple[float, int]] = {}  # key → (d, step of last update)
        self.layer_version: dict[int, int] = {}  # bumps when a layer's residency changes
        self.hits = self.misses = self.evictions = self.admissions = self.bypasses = 0

    # -- queries ---------------------------------------------------------------------------
    def slot(self, layer: int, e: int) -> int:
        return self.slot_of.get((layer, e), -1)

    def resident(self, layer: int, num_experts: int) -> list[bool]:
        return [(layer, e) in self.slot_of for e in range(num_experts)]

    def resident_count(self) -> int:
        return len(self.slot_of)

    def demand_of(self, layer: int, e: int) -> float:
        d, t = self.demand.get((layer, e), (0.0, self.step))
        return d * self.decay ** (self.step - t)

    # -- verbs -----------------------------------------------------------------------------
    def tick(self) -> None:
        """A new forward (decay clock)."""
        self.step += 1

    def access(self, layer: int, used: list[int], critical=()) -> tuple[dict[int, int], list[int]]:
        """One layer-step uses `used` → ({expert: slot} hits, [missed experts]); locks the hits."""
        crit = set(critical)
        hits, misses = {}, []
        for e in used:
            key = (layer, e)
            d, t = self.demand.get(key, (0.0, self.step))
            self.demand[key] = (d * self.decay ** (self.step - t) + (1.0 if e in crit else self.minor), self.step)
            s = self.slot_of.get(key)
            if s is None:
                misses.append(e)
                continue
            hits[e] = s
            self.locked.add(s)
            self._touch(s)
        self.hits += len(hits)
        self.misses += len(misses)
        return hits, misses

    def admit(self, layer: int, e: int, lock: bool = True) -> int | None:
        """Give (layer, e) a slot (evicting per policy) → slot, or None when bypassed."""
        key = (layer, e)
        if key in self.slot_of:
            return self.slot_of[key]
        if self.free:
            s = self.free.pop()
        else:
            s = self._victim()
            if s is None or (self.policy == "lynx" and self._prio_of_key(key) <= self._prio(s)):
                if s is not None:
                    self._push(s)  # the victim stays
                self.bypasses += 1
                return None
            old = self.key_of[s]
            del self.slot_of[old]
            self._bump(old[0])
            self.evictions += 1
        self.key_of[s] = key
        self.slot_of[key] = s
        self._bump(layer)
        self.admissions += 1
        if lock:
            self.locked.add(s)
        self._touch(s)
        return s

    def release(self) -> None:
        """The layer-step is done: its experts may be evicted again."""
        self.locked.clear()

    def clear(self) -> None:
        """Empty every slot (counters and demand history are kept)."""
        for key in self.slot_of:
            self._bump(key[0])
        self.key_of = [None] * self.num_slots
        self.slot_of.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.locked.clear()
        self._heap.clear()

    # -- internals -------------------------------------------------------------------------
    def _bump(self, layer: int) -> None:
        self.layer_version[layer] = self.layer_version.get(layer, 0) + 1

    def _prio_of_key(self, key) -> tuple:
        if self.policy == "lru":
            return (0.0,)
        d, t = self.demand.get(key, (0.0, self.step))
        return (math.log(d) + t * self._c if d > 0 else -math.inf,)

    def _prio(self, s: int) -> tuple:
        return self._prio_of_key(self.key_of[s])

    def _touch(self, s: int) -> None:
        self._seq += 1
        self._last_use[s] = self._seq
        self._ver[s] += 1
        self._push(s)

    def _push(self, s: int) -> None:
        heapq.heappush(self._heap, (self._prio(s) + (self._last_use[s],), s, self._ver[s]))
        if len(self._heap) > 4 * self.num_slots + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if e[2] == self._ver[e[1]] and self.key_of[e[1]] is not None]
            heapq.heapify(self._heap)

    def _victim(self) -> int | None:
        """Pop the lowest-priority unlocked resident slot (None if every slot is locked)."""
        held, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            s = entry[1]
            if entry[2] != self._ver[s] or self.key_of[s] is None:
                continue  # stale
            if entry[0][:-1] != self._prio(s):  # demand changed since the push (lynx): re-file it
                held.append(s)
                continue
            if s in self.locked:
                held.append(s)
                continue
            found = s
            break
        for s in held:
            self._ver[s] += 1
            self._push(s)
        if found is not None:
            self._ver[found] += 1  # its entry is consumed
        return found


__all__ = ["ExpertCache", "POLICIES"]
