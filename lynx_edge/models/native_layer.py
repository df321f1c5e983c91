"""A decoder layer's CPU decode step in two native calls around the router.

The module path of one decode layer is ~40 Python and torch calls around five native kernels
(norms, fused q/k/v, attention, o_proj, router, experts, dtype casts, residual adds): on a small
model that is most of the step, and it is serial when the kernels use two threads. Here

    lynx_layer_attn   x → RMSNorm → q/k/v → attention (cache write) → o_proj → + x = x1,
                      RMSNorm(x1) = h2, router logits          (one call)
    ctx.route         the routing decision (exact / LYNX / offload routers)
    lynx_layer_moe    x1 + experts(h2)                         (one call)

and, where the router has a native plan (ExactRouter; LynxRouter at an all-decode CPU step) and
the experts are resident, all three in one call (lynx_layer: lynx_route between the two halves,
the same rule the router's own __call__ runs natively), the router told the result afterwards
(native_done, None where there is nothing to tell: LYNX's telemetry) and the stats fed as before.

with the same kernels and the same roundings as the module path: the result is bit-equal to it
(tests/test_native_layer.py), and, as the kernels sum each row the same way in any batch, a row's
result does not depend on the batch it runs in. The plan (pointers into the
layer's weights) is built on the first decode step and checked against the weights' storage each
step. OLMoE's attention (q/k RMSNorm over all heads, clip_qkv: Attention.native_qk_full) runs
inside the call too (lynx_qk_full), and so does a shared expert (Qwen2-MoE's sigmoid-gated one,
DeepSeek's plain one: lynx_shared_expert, which the module path calls too), and so does gpt-oss:
its sinks and a window layer's ring cache in the attention half (the kernel the module path's
decode attention runs), its biased router, and its experts (MXFP4 or 16-bit, biased, the clamped
SwiGLU: the call OssExperts makes) in the MoE half, and so does LFM2: a short convolution in the
attention half's place (in_proj, the conv over the row's state, out_proj: ShortConv.native_conv),
its scorer (sigmoid scores with an expert bias) applied in torch between the two calls, as
MoEBlock.forward applies it. Layers of another shape — a family's own attention or norm, an
offloaded expert backend — and batches past the kernels' row limits run the module path.
Glossary: B rows, D hidden, E experts, K top-k.
"""
from __future__ import annotations

import ctypes
import os

import torch

from ..kernels import native
from .layers import NATIVE_ROWS, NATIVE_SLOTS, Attention, AttnBatch, MoEBlock, RMSNorm, StackedExperts

# LYNX_EDGE_NATIVE_LAYER=0: every layer runs the module path (the kernels still run inside it)
NATIVE_LAYERS = os.environ.get("LYNX_EDGE_NATIVE_LAYER", "1") != "0"


def _lin(m):
    """(native.Lin, tensors it points into, max rows) from a projection's own `native_lin` (Linear,
    quant/linear.Int4Linear), or None for any other module."""
    f = getattr(m, "native_lin", None)
    return None if f is None else f()


class NativeLayer:
    """The two layer calls' plans for one DecoderLayer, and what they point into."""

    def __init__(self, layer, attn_plan, moe_plan, keep: list, key: tuple, max_rows: int, max_slots: int):
        self.layer, self.attn_plan, self.moe_plan, self.keep, self.key = layer, attn_plan, moe_plan, keep, key
        self.max_rows, self.max_slots = max_rows, max_slots
        self.mlp = layer.mlp  # read once: nn.Module attribute lookups cost microseconds per step
        self.n_experts = self.mlp.gate.weight.shape[0]
        self.top_k = self.mlp.ctx.spec.top_k

    @classmethod
    def make(cls, layer) -> "NativeLayer | None":
        if native.lib() is None or not layer.is_moe:
            return None
        n1, n2, attn, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp
        dt = n1.weight.dtype
        if type(n1) is not RMSNorm or type(n2) is not RMSNorm or dt not in NATIVE_ROWS or n2.weight.dtype != dt:
            return None
        if not (native.dense_ok(n1.weight) and native.dense_ok(n2.weight)) or n1.weight.shape[0] > 4096:
            return None
        # a token mixer that describes its decode step as a short convolution (LFM2), or the base's
        # attention, or one that differs only in a project native_qk_full describes (OLMoE's norm over all
        # heads and clip) or in learned sinks (gpt-oss); the base's forward, which this call replaces
        if hasattr(attn, "native_conv"):
            conv = attn.native_conv(dt)
            return None if conv is None else cls._make_conv(layer, conv, dt)
        form = attn.native_form() if isinstance(attn, Attention) else None
        if form is None or type(attn).forward is not Attention.forward:
            return None
        sinks, full = form
        if type(attn) is not Attention and full is None and not sinks:
            return None
        if not _moe_block(mlp):
            return None
        shared = None
        if mlp.shared_expert is not None:  # Qwen2-MoE, Qwen3-Next, DeepSeek: inside the call, or not at all
            shared = mlp.native_shared()
            if shared is None:
                return None
        if full is not None and (full[0].dtype != dt or full[1].dtype != dt or attn.H * attn.hd > 4096
                                 or not (native.dense_ok(full[0]) and native.dense_ok(full[1]))):
            return None
        head = attn.qk_norm == "head"  # plain RMSNorm per head (native_form)
        fused = attn._fused()
        got = [None if fused is None else _lin(fused), _lin(attn.o_proj), _lin(mlp.gate)]
        if any(g is None for g in got) or mlp.gate.weight.dtype != dt:
            return None
        lins = [g[0] for g in got]
        keep: list = [t for g in got for t in g[1] if t is not None]
        max_rows = min(g[2] for g in got)  # where the module path's projections all run natively too
        if shared is not None:
            max_rows = min(max_rows, shared[2])
            keep += [shared[0], *shared[1]]
        qn = kn = None
        if head:
            qn, kn = attn.q_norm.weight.detach().float().contiguous(), attn.k_norm.weight.detach().float().contiguous()
            keep += [qn, kn]
        plan = native.AttnLayer(native._FMT[dt], n1.weight.shape[0], attn.H, attn.Hkv, attn.hd, 0, attn.window or 0,
                                n1.eps, n2.eps, attn.q_norm.eps if head else 0.0, attn.hd ** -0.5,
                                n1.weight.data_ptr(), n2.weight.data_ptr(),
                                None if qn is None else qn.data_ptr(), None if kn is None else kn.data_ptr(), *lins)
        if sinks:  # fp32 [H] (a copy made again when the sinks are written: _key follows them)
            s32 = attn.native_sinks()
            plan.sinks = s32.data_ptr()
            keep.append(s32)
        if full is not None:
            plan.qfw, plan.kfw = full[0].data_ptr(), full[1].data_ptr()
            keep += [full[0], full[1]]
            plan.eps_qk, plan.clip = full[2], full[3] or 0.0
        moe, slots = _moe_plan(mlp.experts, keep, dt)
        if moe is not None and shared is not None:
            moe.shared = ctypes.addressof(shared[0])  # kept alive in keep
        key = _key(layer)
        return cls(layer, plan, moe, keep, key, max_rows, slots)

    @classmethod
    def _make_conv(cls, layer, conv: tuple, dt) -> "NativeLayer | None":
        """The plans of a layer whose token mixer is LFM2's short convolution (conv: its native_conv,
        (weight [D, 1, L], bias [D] or None), contiguous in the model dtype dt): the attention half runs
        its in_proj, the convolution over the row's state and its out_proj (lynx_layer_attn's conv branch)."""
        n1, n2, attn, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, layer.mlp
        if not _moe_block(mlp) or mlp.shared_expert is not None:
            return None
        w, b = conv
        got = [_lin(attn.in_proj), _lin(attn.out_proj), _lin(mlp.gate)]
        if any(g is None for g in got) or mlp.gate.weight.dtype != dt:
            return None
        keep = [t for g in got for t in g[1] if t is not None]
        # no heads (H = Hkv = hd = 0): lynx_layer_attn's conv branch reads conv_w / conv_b / conv_L instead
        plan = native.AttnLayer(native._FMT[dt], n1.weight.shape[0], 0, 0, 0, 0, 0, n1.eps, n2.eps, 0.0, 1.0,
                                n1.weight.data_ptr(), n2.weight.data_ptr(), None, None, *[g[0] for g in got])
        plan.conv_w, plan.conv_b, plan.conv_L = w.data_ptr(), None if b is None else b.data_ptr(), w.shape[-1]
        moe, slots = _moe_plan(mlp.experts, keep, dt)
        return cls(layer, plan, moe, keep, _key(layer), min(g[2] for g in got), slots)

    def valid(self) -> bool:
        return _key(self.layer) == self.key

    def takes(self, x: torch.Tensor, ab: AttnBatch, kv) -> bool:
        """Whether the layer calls take this step: x [B, 1, D], its batch and this layer's cache (a
        sliding-window layer's ring too: its period goes into the plan here)."""
        if x.shape[0] > self.max_rows or (ab.cos is None and ab.rope is None) or not x.is_contiguous():
            return False
        if self.attn_plan.conv_w:  # the conv state [Bmax, D, L - 1] in the model dtype
            state = kv[0]
            return state.dtype == x.dtype and state.is_contiguous()
        k_cache, v_cache = kv
        if (k_cache.dtype != v_cache.dtype or k_cache.dtype not in NATIVE_ROWS
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            return False
        self.attn_plan.ring = getattr(kv, "period", 0)  # a window layer's ring (kv_cache.RingKV), this cache's
        return True

    def route_plan(self, B: int):
        """The router's native plan for B tokens when the whole layer can run as one call (resident
        experts within the kernel's slots, a router with a native plan for this step), else None."""
        plan_of = getattr(self.mlp.ctx.route, "native_plan", None)  # ExactRouter, LynxRouter
        if plan_of is None or self.moe_plan is None or B * self.top_k > self.max_slots or self.mlp.scorer is not None:
            return None  # (a scorer, LFM2's: routed in torch between the two calls)
        return plan_of(self.mlp.layer, B)

    def forward(self, x: torch.Tensor, ab: AttnBatch, kv, is_decode: torch.Tensor) -> torch.Tensor | None:
        """x [B, 1, D] → the layer's output, or None (the module path runs: nothing was written)."""
        B = x.shape[0]
        mlp = self.mlp
        if not self.takes(x, ab, kv):
            return None
        k_cache, v_cache = (kv[0], kv[0]) if self.attn_plan.conv_w else kv  # a conv layer: its state
        step = ab.native_step()
        self.attn_plan.rd = step[2].shape[-1]  # RoPE dims per head (partial rotary: < hd)
        plan = self.route_plan(B)
        if plan is not None:
            got = native.layer(self.attn_plan, self.moe_plan, plan, x.view(B, -1), step[2], step[3], step[1],
                               step[0], k_cache, v_cache)
            if got is None:
                return None
            out, ids, weights, vec = got
            _report(mlp.ctx, (mlp.layer,), ids[None], weights[None], vec[None])
            return out.view(x.shape)
        got = native.layer_attn(self.attn_plan, x.view(B, -1), step[2], step[3], step[1], step[0], k_cache, v_cache,
                                self.n_experts)
        if got is None:
            return None
        x1, h2, logits = got
        if mlp.scorer is None:
            ids, weights = mlp.ctx.route(logits, is_decode, mlp.layer)
        else:  # as MoEBlock.forward: the family's scores and probabilities
            scores, probs = mlp.scorer(logits)
            ids, weights = mlp.ctx.route(scores, is_decode, mlp.layer, probs=probs)
        mlp.ctx.stats.add(mlp.layer, ids)
        if self.moe_plan is not None and ids.numel() <= self.max_slots:
            out = native.layer_moe(self.moe_plan, h2, ids, weights, x1)
        else:  # another expert backend (offload), or past the native slots: the backend's own call
            h = h2.to(x1.dtype)
            out = x1 + mlp.with_shared(mlp.experts(h, ids, weights), h)  # the module path's own sum
        return out.view(x.shape)


def _moe_block(mlp) -> bool:
    """Whether mlp is an MoEBlock whose forward is the base's (a family's scorer, LFM2's, is applied
    between the two calls as that forward applies it)."""
    return isinstance(mlp, MoEBlock) and type(mlp).forward is MoEBlock.forward


def native_of(layer) -> "NativeLayer | None":
    """layer's NativeLayer (built on first use, rebuilt when its weights were replaced), or None."""
    nl = layer._native
    if nl is None or (nl is not False and not nl.valid()):
        nl = layer._native = NativeLayer.make(layer) or False
    return nl or None


def head_plan(model, x: torch.Tensor) -> tuple | None:
    """(final norm weight, eps, native.Lin of the head) when the module path would run the model's
    last RMSNorm and head natively for x [B, 1, D] (the same kernels, so the same logits), else None.
    Decided once per norm, head weight and dtype (kept on the model): a replaced weight decides again."""
    norm, q8 = model.norm, model.head_int8
    W = q8[0] if q8 is not None else model.head_weight()
    key = (norm, W.data_ptr(), norm.weight.data_ptr(), norm.eps, x.dtype, model.head_act)
    got = model.__dict__.get("_native_head")
    if got is None or got[0] != key:  # first use, or a weight replaced
        ok = (type(norm) is RMSNorm and norm.weight.dtype is x.dtype and native.dense_ok(norm.weight)
              and (q8 is not None or (W.dtype in NATIVE_ROWS and native.dense_ok(W))))
        lin = native.int8_lin(*q8, None, model.head_act) if q8 is not None else native.dense_lin(W, None, model.head_act)
        got = model.__dict__["_native_head"] = (key, (norm.weight, norm.eps, lin) if ok else None)
    if got[1] is None:
        return None
    lo, hi = NATIVE_ROWS[x.dtype if q8 is not None else W.dtype]
    return got[1] if lo <= x.shape[0] <= hi else None


class _Stack:
    """decode_stack's call for B rows, kept across steps: which layers join, their route plans and
    cache storages, and the native.Stack holding all of them as the call's pointer arrays. A step
    rebuilds it only when one of those changed (a replaced weight, another router or phase, a new
    cache)."""

    def __init__(self, nls: list, plans: list, kv: list, ptrs: list):
        self.nls, self.plans, self.ptrs = nls, plans, ptrs
        self.call = native.Stack([nl.attn_plan for nl in nls], [nl.moe_plan for nl in nls], plans, kv)
        self.rd = None  # RoPE dims last written into the attention plans

    def set_rd(self, rd: int) -> None:
        """RoPE dims per head (partial rotary: < hd), as the step's cos/sin rows have them."""
        if self.rd != rd:
            for nl in self.nls:
                nl.attn_plan.rd = rd
            self.rd = rd


def _stack(layers, x: torch.Tensor, ab: AttnBatch, kv_cache) -> _Stack | None:
    """The kept _Stack of the leading layers that can run in one call for x [B, 1, D] (checked this
    step: plans valid, shapes taken, a native route plan), or None when fewer than two can."""
    if not NATIVE_LAYERS or x.shape[1] != 1 or x.device.type != "cpu" or len(layers) < 2:
        return None
    B = x.shape[0]
    plans, nls = [], []
    for layer, kv in zip(layers, kv_cache):
        if layer._native is False:
            break
        nl = native_of(layer)
        if nl is None or not nl.takes(x, ab, kv):
            break
        plan = nl.route_plan(B)
        if plan is None:
            break
        plans.append(plan)
        nls.append(nl)
    n = len(nls)
    if n < 2:  # one layer: its own call is as good
        return None
    kv = kv_cache[:n]
    ptrs = [t.data_ptr() for c in kv for t in c[:2]]  # a new cache (another batch or context) rebuilds
    stacks = layers.__dict__.setdefault("_native_stacks", {})
    st = stacks.get(B)
    if st is None or st.nls != nls or st.plans != plans or st.ptrs != ptrs:  # lists of the same objects
        st = stacks[B] = _Stack(nls, plans, kv, ptrs)
    return st


def greedy_burst(model, kv, ab: AttnBatch, tokens: list[int], steps: int, stops) -> list[list[int]] | None:
    """Up to `steps` greedy decode steps of the B rows of ab in one native call (lynx_decode: the
    embedding, every layer, the head and the argmax, step after step), when the whole model runs in
    the stack call; the router's phase is set (begin_step) for the first step. Each step's routing
    is reported as decode_stack reports it, after its own begin_step. → the tokens chosen per step
    (ends after a step where a row chose one of `stops`), or None: the caller runs this step itself.
    The logits are those of the one-step path (the same calls), so the tokens are too."""
    E = model.embed_tokens
    if (E.device.type != "cpu" or E.dtype not in NATIVE_ROWS or not native.dense_ok(E)
            or "forward" in model.__dict__):
        return None  # a forward set on the instance (a wrapper's, a test's) runs as it says
    B = len(tokens)
    x = torch.empty(B, 1, E.shape[1], dtype=E.dtype)  # what the stack checks take: shape and dtype
    ab.rope = (model.rope, E.dtype)
    st = _stack(model.layers, x, ab, kv.layers)
    head = None if st is None or st.call.n != len(model.layers) else head_plan(model, x)
    if head is None:
        return None
    tab = model.rope.table(E.dtype, ab.kv_len + steps)
    st.set_rd(tab[2].shape[-1])
    rows = ab.native_rows()
    pos = ab.positions.view(-1).tolist()
    ran, out, ids, w, vec, rc = st.call.greedy(E, tokens, tab[2], tab[3], pos, rows, head, steps, stops)
    ctx, layers = st.nls[0].mlp.ctx, tuple(nl.mlp.layer for nl in st.nls)
    burst = getattr(ctx.route, "native_done_burst", None)
    if burst is not None and ran and not ctx.stats.record:  # LYNX: the steps told in one call
        burst(layers, ids[:ran], w[:ran], vec[:ran])
        return out[:ran].tolist()
    for s in range(ran):
        if s:
            model.routing.begin_step(True)
        _report(ctx, layers, ids[s], w[s], vec[s])
    return out[:ran].tolist() if ran else None


def decode_stack(layers, x: torch.Tensor, ab: AttnBatch, kv_cache, head_of=None) -> tuple[int, torch.Tensor | None]:
    """The leading decoder layers that run whole-layer calls with a native route, all in one native
    call (lynx_layers): x [B, 1, D] becomes their output in place. → (how many ran: 0 for none, the
    caller runs the rest; logits [B, V] fp32 when every layer ran and head_of() — the model's
    head_plan — gave the last norm and head, else None). One call per step instead of one per layer:
    the Python between layers (plan checks, output allocations, the ctypes call) was a third of a
    small model's decode step. The call's arguments that do not change between steps are kept on
    `layers` per batch size (_Stack); a step checks them and calls."""
    st = _stack(layers, x, ab, kv_cache)
    if st is None:
        return 0, None
    B, n, nls = x.shape[0], st.call.n, st.nls
    step = ab.native_step()
    st.set_rd(step[2].shape[-1])
    head = head_of() if head_of is not None and n == len(layers) else None
    done, ids, w, vec, logits = st.call(x.view(B, -1), step[2], step[3], step[1], step[0], head)
    if done:
        cut = done < n
        _report(nls[0].mlp.ctx, tuple(nl.mlp.layer for nl in nls[:done]), ids[:done] if cut else ids,
                w[:done] if cut else w, vec[:done] if cut else vec)
    return done, logits


def _report(ctx, layers: tuple, ids: torch.Tensor, w: torch.Tensor, vec: torch.Tensor) -> None:
    """What a native call routed — ids, w [n, B, K], vec [n, 7] for these MoE layers — to the router
    (native_done; None where there is nothing to record: exact) and to the routing stats."""
    tell = getattr(ctx.route, "native_done", None)
    if tell is not None:
        tell(layers, ids, w, vec)
    if ctx.stats.record:
        for layer, layer_ids in zip(layers, ids.unbind(0)):
            ctx.stats.add(layer, layer_ids)


def _moe_plan(experts, keep: list, dt) -> tuple[native.MoeLayer | None, int]:
    """(the MoE call's plan, max token-expert slots) for resident experts on a CPU; (None, 0) else."""
    own = getattr(experts, "native_moe", None)  # a backend that describes itself (FP8)
    if own is not None:
        return own()
    if type(experts) is StackedExperts and native.dense_ok(experts.gate_up, experts.down):
        E, two_i, D = experts.gate_up.shape
        plan = native.MoeLayer(native._FMT[experts.gate_up.dtype], None, E, experts.gate_up.element_size(), None, None,
                               experts.gate_up.data_ptr(), experts.down.data_ptr(), 0, 0, D, two_i // 2,
                               native.bf16_code(experts.act, experts.gate_up.dtype),
                               stream=int(experts.streamed) | (native.MOE_GU_PACKED if experts.packed_rows[0] else 0)
                               | (native.MOE_DN_PACKED if experts.packed_rows[1] else 0))
        return plan, (NATIVE_SLOTS if experts.gate_up.dtype == torch.float32 else 1 << 30)
    packed = getattr(experts, "packed", None)
    layout = getattr(packed, "layout", None)
    if layout is None or packed.data.device.type != "cpu" or not packed.data.is_contiguous():
        return None, 0
    offs = layout.part_offsets
    perm = experts.x_perm
    if perm is not None:
        perm = perm.to(torch.int32).contiguous()
        keep.append(perm)
    keep.append(offs)
    act = native.act_code(getattr(experts, "act", None))
    plan = native.MoeLayer(native.FMT_INT4, packed.data.data_ptr(), packed.data.shape[0], packed.data.shape[1],
                           offs.ctypes.data, None if perm is None else perm.data_ptr(), None, None, int(layout.sym),
                           layout.group_size, layout.hidden, layout.inter, act)
    return plan, 1 << 30


def _key(layer) -> tuple:
    """The modules and storages the plan points into, and the activations they run: a module or
    weight replaced (not written in place), or its activations changed, rebuilds the plan. Plain
    attribute reads: this runs every layer of every decode step."""
    m = layer._modules
    attn, mlp = m["self_attn"], m["mlp"]
    am, mm = attn._modules, mlp._modules
    ex = mm["experts"]
    p = ex.__dict__.get("_parameters", {})
    if type(ex) is StackedExperts:
        exp, dn = p["gate_up"], p["down"]
    else:  # INT4: its block buffer; FP8: its gate_up and down codes (plain tensor attributes); gpt-oss: parameters
        packed = ex.__dict__.get("packed")
        exp, dn = (packed.data, None) if packed is not None else \
            (ex.__dict__.get("gate_up", p.get("gate_up")), ex.__dict__.get("down", p.get("down")))
    eb = p.get("gate_up_b")  # gpt-oss's expert biases (copied to fp32 for the plan)
    eb = None if eb is None else (_written(eb), _written(p["down_b"]), _written(p.get("gate_up_scales")),
                                  _written(p.get("down_scales")))
    qn, kn = am.get("q_norm"), am.get("k_norm")  # per-head norms (copied to fp32) or OLMoE's (pointed into)
    cv = am.get("conv")  # LFM2's short convolution: in_proj / out_proj in q_proj / o_proj's place
    qp, op = (am["in_proj"], am["out_proj"]) if cv is not None else (am["q_proj"], am["o_proj"])
    # biases (copied to fp32 by native_lin): each module's own, as load_state_dict writes them (q/k/v's are
    # views of the fused one, but a write through one view does not count on the others' version)
    qb, ob = qp._parameters.get("bias"), op._parameters.get("bias")
    if qb is None:
        qkv_b = None
    elif cv is not None:  # the in_proj's one bias
        qkv_b = (_written(qb),)
    else:
        qkv_b = (_written(qb), _written(am["k_proj"]._parameters.get("bias")),
                 _written(am["v_proj"]._parameters.get("bias")))
    conv = None if cv is None else (_written(cv._parameters["weight"]), _written(cv._parameters.get("bias")))
    bs = (qkv_b, None if ob is None else _written(ob), conv)
    sh = mm.get("shared_expert")
    if sh is not None:  # its projections' storage (MoEBlock.native_shared points into them)
        sm, sg = sh._modules, mm.get("shared_expert_gate")
        sh = (sm["gate_proj"].storage(), sm["up_proj"].storage(), sm["down_proj"].storage(),
              None if sg is None else sg.storage())
    rb, sk = mm["gate"]._parameters.get("bias"), attn._parameters.get("sinks")  # gpt-oss's (copied to fp32)
    return (qp, qp.storage(), op, op.storage(), mm["gate"],
            mm["gate"]._parameters["weight"].data_ptr(), _written(rb), _written(sk), eb,
            m["input_layernorm"]._parameters["weight"].data_ptr(),
            m["post_attention_layernorm"]._parameters["weight"].data_ptr(), ex,
            None if exp is None else exp.data_ptr(), None if dn is None else dn.data_ptr(),
            None if qn is None else _written(qn._parameters["weight"]),
            None if kn is None else _written(kn._parameters["weight"]), sh, bs,
            getattr(qp, "act", None), getattr(op, "act", None), getattr(ex, "act", None))  # activations (bf16: build._bf16_activations)


def _written(w: torch.Tensor | None) -> tuple | None:
    """(storage, in-place writes so far) of a weight the plan copies or points into: a new storage
    would leave the plan's pointer dangling, an in-place write its copy stale. None for None."""
    if w is None:
        return None
    try:  # (a fused q/k/v built under inference mode still counts writes through its parameters)
        return w.data_ptr(), w._version
    except RuntimeError:  # a plain inference tensor keeps no count
        return w.data_ptr(), 0


__all__ = ["NativeLayer", "decode_stack", "head_plan", "native_of"]
