"""LYNX inside vLLM: a `vllm.general_plugins` entry point (`register`) that hands the expert
selection of vLLM's MoE layers to lynx-edge's LYNX when the user asks for it with
`additional_config={"lynx": "on"}` (any LynxConfig string; "off" attaches exact routing with
telemetry). Without the setting nothing changes.

After a model is loaded (weights processed, experts backend fixed) each plain softmax top-k MoE
layer gets vLLM's own `custom_routing_function` hook, behind a torch custom op so torch.compile
treats it as opaque and it runs every step. A token is a decode token iff its request's query
length is 1 in this step (forward context → attention metadata → query_start_loc); steps without
metadata (profile / warm-up runs) route exactly. Glossary: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import atexit
import copy
import functools
import importlib.abc
import importlib.util
import itertools
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..lynx import LynxConfig, LynxTelemetry, lynx_select
from ..routing import RouterSpec, exact_route

# Under vLLM's logger tree so lines show up in its format, without importing vLLM here.
log = logging.getLogger("vllm.lynx_edge")
TESTED = ("0.32.0", "0.33.0")  # [low, high): vLLM releases this adapter is tested with
KEY = "lynx"
FORCE_KEY = "lynx_test_force_experts"  # test-only: route every token to these experts

# native(hidden [T, D], logits [T, E]) → (weights [T, K] fp32, ids [T, K] int32): vLLM's own routing
Native = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def decode_mask(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """query_start_loc [R+1] (cumulative token offsets of R requests) → bool [num_tokens]: True
    for the tokens of requests whose query length is 1 in this step. Rows past the last request
    (padding) are False. Sync-free on the tensor's device."""
    qsl = query_start_loc.reshape(-1).long()
    t = torch.arange(num_tokens, device=qsl.device)
    if qsl.numel() < 2:
        return torch.zeros(num_tokens, dtype=torch.bool, device=qsl.device)
    # token t belongs to request r with qsl[r] ≤ t < qsl[r+1] = the count of request ends ≤ t
    req = torch.searchsorted(qsl[1:], t, right=True).clamp_max(qsl.numel() - 2)
    one = (qsl[1:] - qsl[:-1]) == 1
    return one[req] & (t < qsl[-1])


def step_phase(ctx, num_tokens: int) -> Optional[tuple[torch.Tensor, int]]:
    """Forward context → (is_decode bool [T] on the CPU, N real tokens), or None (route exactly)
    when the step has no usable attention metadata: profile / warm-up / dummy runs, micro-batched
    (DBO) steps, or more real tokens than rows."""
    md = getattr(ctx, "attn_metadata", None)
    if isinstance(md, dict):  # layer name → metadata; every attention layer sees the same batch
        md = next(iter(md.values()), None)
    qsl = getattr(md, "query_start_loc_cpu", None)
    qsl = getattr(md, "query_start_loc", None) if qsl is None else qsl
    if not isinstance(qsl, torch.Tensor) or qsl.numel() < 2:
        return None
    qsl = qsl.cpu()  # already on the CPU on vLLM's CPU backend; one small copy elsewhere
    n = int(qsl[-1])
    return (decode_mask(qsl, num_tokens), n) if n <= num_tokens else None


@dataclass
class LayerRoute:
    """One MoE layer: LYNX over the step's real tokens, vLLM's own routing for every row LYNX
    leaves alone (prefill, padding, untouched decode tokens), so those stay bit-identical."""

    spec: RouterSpec
    cfg: LynxConfig
    layer: int
    telemetry: LynxTelemetry
    native: Optional[Native] = None
    force: Optional[tuple[int, ...]] = None

    def exact(self, hidden: torch.Tensor, logits: torch.Tensor):
        if self.native is not None:
            w, ids = self.native(hidden, logits)
            return w.float(), ids.int()
        ids, w = exact_route(logits.float(), self.spec)
        return w, ids.int()

    def __call__(self, hidden, logits, is_decode: Optional[torch.Tensor], num_real: int = 0):
        """logits [T, E], is_decode [T] bool or None (no metadata: exact) → weights [T, K] fp32,
        ids [T, K] int32. Only the first num_real rows are tokens; the rest is padding."""
        if self.force is not None:
            return self._forced(logits)
        w, ids = self.exact(hidden, logits)
        n = min(num_real, logits.shape[0])
        if is_decode is None or n == 0:
            return w, ids
        r = lynx_select(logits[:n].float(), is_decode[:n], self.spec, self.cfg, self.layer)
        self.telemetry.record(self.layer, r)
        # Fewer decode tokens than min_batch: lynx_select routed exactly, skip the merge (is_decode
        # lives on the CPU, so the count costs no device sync).
        if self.cfg.kind == "off" or int(is_decode[:n].sum()) < max(self.cfg.min_batch, 2):
            return w, ids
        new = r.ids.to(ids.dtype)
        # A row changed iff its expert *set* changed (vLLM's top-k order may differ from ours).
        changed = (new.sort(1).values != ids[:n].sort(1).values).any(1, keepdim=True)  # [N, 1]
        w = torch.cat([torch.where(changed, r.weights, w[:n]), w[n:]])
        ids = torch.cat([torch.where(changed, new, ids[:n]), ids[n:]])
        return w, ids

    def _forced(self, logits: torch.Tensor):
        """Test-only: every token → the forced experts, weighted by their softmax probability
        (renormalised like the layer's router), so a reference can replay it exactly."""
        ids = torch.tensor(self.force, device=logits.device).expand(logits.shape[0], -1)
        w = torch.softmax(logits.float(), dim=-1).gather(1, ids)
        if self.spec.norm_topk_prob:
            w = w / w.sum(1, keepdim=True)
        return w.contiguous(), ids.int().contiguous()


class WorkerState:
    """Per process: the attached layers and this worker's telemetry. The custom op finds its
    layer here by an int key because torch ops cannot carry Python objects."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerRoute] = {}
        self.telemetry = LynxTelemetry()
        self.skipped: list[str] = []
        self.setting: Optional[str] = None
        self.decode_steps = 0
        self._keys = itertools.count()
        self._step: tuple = (None, -1, None)  # (forward context, T, phase) of the current step

    def add(self, route: LayerRoute) -> int:
        key = next(self._keys)
        self.layers[key] = route
        return key

    def phase(self, num_tokens: int) -> Optional[tuple[torch.Tensor, int]]:
        """This step's phase, computed once per forward (each forward has a new context)."""
        try:
            from vllm.forward_context import get_forward_context, is_forward_context_available
        except ImportError:  # unit tests without vLLM: no context, exact routing
            return None
        ctx = get_forward_context() if is_forward_context_available() else None
        if ctx is None:
            return None
        if self._step[0] is not ctx or self._step[1] != num_tokens:
            ph = step_phase(ctx, num_tokens)
            if ph is not None and self._step[0] is not ctx:
                self.telemetry.begin_step()
                self.decode_steps += int(ph[1] > 0 and bool(ph[0][: ph[1]].all()))
            self._step = (ctx, num_tokens, ph)
        return self._step[2]

    def route(self, key: int, hidden: torch.Tensor, logits: torch.Tensor):
        ph = self.phase(logits.shape[0])
        return self.layers[key](hidden, logits, *(ph if ph is not None else (None, 0)))

    def summary(self) -> dict:
        """lynx-edge's telemetry summary (the same numbers its own engine reports), plus
        decode_steps (forwards whose tokens were all decode), layers and skipped layers."""
        s = self.telemetry.summary()
        s["per_layer"] = {str(k): v for k, v in s["per_layer"].items()}
        layers = sorted({r.layer for r in self.layers.values()})
        return s | {"decode_steps": self.decode_steps, "setting": self.setting, "pid": os.getpid(),
                    "layers": layers, "skipped": list(self.skipped)}

    def clear(self) -> None:
        self.telemetry.clear()
        self.decode_steps = 0


_STATE = WorkerState()  # one per process: vLLM runs one worker per process


@torch.library.custom_op("lynx_edge::vllm_route", mutates_args=())
def _route_op(hidden_states: torch.Tensor, gating_output: torch.Tensor, key: int,
              topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = _STATE.route(key, hidden_states, gating_output)
    return w.contiguous(), ids.contiguous()


@_route_op.register_fake
def _route_fake(hidden_states, gating_output, key, topk):
    T = gating_output.shape[0]
    return (gating_output.new_empty((T, topk), dtype=torch.float32),
            gating_output.new_empty((T, topk), dtype=torch.int32))


def _custom_routing(hidden_states, gating_output, topk, renormalize, *, key):
    """vLLM's custom_routing_function contract → (topk_weights fp32, topk_ids int32) [T, K]."""
    return torch.ops.lynx_edge.vllm_route(hidden_states, gating_output, key, topk)


def collect_stats(worker=None) -> dict:
    """This worker's LYNX telemetry; `llm.collective_rpc(collect_stats)` returns one per worker."""
    return _STATE.summary()


def reset_stats(worker=None) -> None:
    _STATE.clear()


class LynxWorkerExtension:
    """`worker_extension_cls="lynx_edge.integrations.vllm.LynxWorkerExtension"` lets any
    executor (multi-process too, where callables are not shipped) call
    `llm.collective_rpc("lynx_stats")` / `collective_rpc("lynx_reset_stats")`."""

    def lynx_stats(self) -> dict:
        return _STATE.summary()

    def lynx_reset_stats(self) -> None:
        _STATE.clear()


def parse_setting(extra) -> Optional[tuple[LynxConfig, Optional[tuple[int, ...]]]]:
    """additional_config → (LynxConfig, forced experts or None); None when LYNX was not asked
    for. Raises ValueError with one line naming the field."""
    if not isinstance(extra, dict) or (KEY not in extra and FORCE_KEY not in extra):
        return None
    text = extra.get(KEY, "off")
    if not isinstance(text, str):
        raise ValueError(f"additional_config[{KEY!r}] must be a string such as \"on\", got {text!r}")
    try:
        cfg = LynxConfig.parse(text)
    except ValueError as e:
        raise ValueError(f"additional_config[{KEY!r}]: {e}") from None
    force = extra.get(FORCE_KEY)
    if force is not None:
        ok = isinstance(force, (list, tuple)) and force and all(type(x) is int and x >= 0 for x in force)
        if not ok or len(set(force)) != len(force):
            raise ValueError(f"additional_config[{FORCE_KEY!r}] must be a list of distinct expert ids")
        force = tuple(force)
    return cfg, force


def _plain_softmax_topk(router) -> Optional[str]:
    """None when the router is plain softmax top-k (what LYNX implements), else why not."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import FusedTopKRouter

    name = type(router).__name__
    if type(router) not in (CPURouter, FusedTopKRouter):
        return f"router {name} is not plain softmax top-k"
    if getattr(router, "scoring_func", "softmax") != "softmax":
        return f"router {name} scores with {router.scoring_func}, not softmax"
    if isinstance(router, CPURouter):
        if router.use_grouped_topk or router.e_score_correction_bias is not None:
            return "router uses grouped top-k or a score bias (not implemented by the adapter)"
        if router.custom_routing_function is not None:
            return "the model already sets its own custom_routing_function"
    return None


def _attach_layer(runner, cfg: LynxConfig, force, layer: int) -> Optional[str]:
    """Hook one MoE layer; returns why it was skipped, or None."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    from vllm.model_executor.layers.fused_moe.router.custom_routing_router import (
        CustomRoutingRouter,
    )

    if getattr(runner, "is_monolithic", False):
        return "monolithic experts kernel (routes inside the kernel)"
    router = runner.router
    why = _plain_softmax_topk(router)
    if why is not None:
        return why
    spec = RouterSpec(router.global_num_experts, router.top_k, bool(router.renormalize))
    if force is not None and (len(force) != spec.top_k or max(force) >= spec.num_experts):
        return f"{FORCE_KEY} needs {spec.top_k} expert ids below {spec.num_experts}"
    exact = copy.copy(router)  # vLLM's own routing, for the rows LYNX leaves alone
    if isinstance(exact, CPURouter):
        exact.custom_routing_function = None
    native = functools.partial(_native, exact)
    key = _STATE.add(LayerRoute(spec, cfg, layer, _STATE.telemetry, native, force))
    fn = functools.partial(_custom_routing, key=key)
    if isinstance(router, CPURouter):  # CPU: the attribute is read on every call
        router.custom_routing_function = fn
    else:  # GPU: vLLM's custom-routing router; the modular experts backend stays as it is
        new = CustomRoutingRouter(spec.top_k, spec.num_experts, fn, eplb_state=router.eplb_state,
                                  renormalize=spec.norm_topk_prob)
        new.set_capture_fn(router.capture_fn)
        runner.router = new
    runner._lynx_key = key
    return None


def _native(router, hidden, logits):
    return router._compute_routing(hidden, logits, None)


def attach(model: torch.nn.Module, vllm_config) -> int:
    """Attach LYNX to every supported MoE layer of a loaded model if `additional_config` asks
    for it. Returns the number of layers hooked; logs one line per skipped layer kind."""
    try:
        setting = parse_setting(getattr(vllm_config, "additional_config", None))
    except ValueError as e:
        log.error("lynx-edge: %s; LYNX not attached, routing stays exact", e)
        return 0
    if setting is None:
        return 0
    cfg, force = setting
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import (
        MoERunnerInterface,
    )

    pc = getattr(vllm_config, "parallel_config", None)
    if getattr(pc, "data_parallel_size", 1) > 1:  # a step's rows then come from several ranks
        log.warning("lynx-edge: data parallel MoE is not supported; LYNX not attached")
        return 0
    done, skipped = 0, {}
    for name, mod in model.named_modules():
        if not isinstance(mod, MoERunnerInterface) or hasattr(mod, "_lynx_key"):
            continue
        try:
            layer = int(mod.layer_id)
        except Exception:  # names without a layer index
            layer = 10_000 + done
        why = _attach_layer(mod, cfg, force, layer)
        if why is None:
            done += 1
        else:
            skipped.setdefault(why, []).append(name)
    text = str(vllm_config.additional_config.get(KEY, "off"))
    _STATE.setting = "force:" + "+".join(map(str, force)) if force else text
    for why, names in skipped.items():
        _STATE.skipped += names
        log.warning("lynx-edge: %d MoE layer(s) skipped (%s), e.g. %s", len(names), why, names[0])
    if done:
        log.info("lynx-edge: LYNX %s attached to %d MoE layer(s)", _STATE.setting, done)
        atexit.register(_log_summary)
    return done


def _log_summary() -> None:
    s = _STATE.summary()
    if s["decode_layer_steps"]:
        log.info("lynx-edge: LYNX %s over %d decode steps: unique experts/layer %.2f -> %.2f "
                 "(%.1f%% fewer), remap rate %.1f%%", s["setting"], s["decode_steps"],
                 s["unique_before"], s["unique_after"], s["reduction_pct"], s["remap_rate_pct"])


def _wrap_load_model(fn):
    @functools.wraps(fn)
    def load_model(self, *args, **kwargs):
        model = fn(self, *args, **kwargs)
        attach(model, kwargs.get("vllm_config", args[0] if args else None))
        return model

    load_model._lynx_wrapped = True
    return load_model


def _wrap_class(cls) -> None:
    fn = vars(cls).get("load_model")
    if fn is not None and not getattr(fn, "_lynx_wrapped", False):
        cls.load_model = _wrap_load_model(fn)


def _patch_loaders(module) -> None:
    """Wrap BaseModelLoader.load_model, and that of every subclass defined later (tensorizer, …)."""
    base = module.BaseModelLoader
    _wrap_class(base)
    todo = list(base.__subclasses__())
    while todo:
        _wrap_class(cls := todo.pop())
        todo += cls.__subclasses__()

    def init_subclass(cls, **kw):
        super(base, cls).__init_subclass__(**kw)
        _wrap_class(cls)

    base.__init_subclass__ = classmethod(init_subclass)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's loader module right after it is first imported, so register() itself
    imports nothing heavy (importing vLLM's model loader costs seconds in an API server)."""

    def find_spec(self, name, path, target=None):
        if name != _LOADER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch_loaders(module)

            spec.loader.exec_module = exec_module
        return spec


_LOADER = "vllm.model_executor.model_loader.base_loader"


def register() -> None:
    """vLLM general plugin entry point (runs in every vLLM process, maybe several times).

    Checks the vLLM version against the tested range (outside it: one log line, nothing done),
    then arranges for vLLM's model loaders to call attach() on each model they load; without
    `additional_config["lynx"]` attach() returns at once and the model is untouched."""
    try:
        import vllm
        from packaging.version import Version
    except ImportError:
        return
    v = Version(Version(vllm.__version__).base_version)
    if not Version(TESTED[0]) <= v < Version(TESTED[1]):
        log.warning("lynx-edge: vLLM %s is outside the tested range [%s, %s); plugin inactive",
                    vllm.__version__, *TESTED)
        return
    if _LOADER in sys.modules:
        _patch_loaders(sys.modules[_LOADER])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
