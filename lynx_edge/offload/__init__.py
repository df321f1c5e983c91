"""Expert offloading: experts in host memory, a device expert cache, async copies, CPU experts.

    from lynx_edge.offload import OffloadOptions, attach_offload, make_plan, load_profile
    plan = make_plan(model_cfg, OffloadOptions(gpu_budget_gib=8, profile="laptop-rtx4060-8gb"))
    print(plan.to_text())                       # dry run: no weights loaded
    rt = attach_offload(engine.model, OffloadOptions(expert_slots=64, lynx="lynx"))
    rt.stats()

Modules: options (OffloadOptions), profile (hardware profiles, calibrate), plan (placement),
store (host expert blocks), biased (the block format of experts with biases and a family
activation, dense or MXFP4: gpt-oss), cache (device slots + policies), transfer (streams/events),
cpu_experts (Fiddler-style), cost (per-step choices), experts (OffloadedExperts), runtime
(attach_offload, OffloadRuntime, ResidencyRoute), projection (replay recorded routing).
"""
from .options import OffloadOptions
from .plan import Plan, PlanError, make_plan
from .profile import Profile, ProfileError, calibrate, detect_profile, list_profiles, load_profile
from .runtime import OffloadRuntime, attach_offload

__all__ = [
    "OffloadOptions", "OffloadRuntime", "Plan", "PlanError", "Profile", "ProfileError", "attach_offload",
    "calibrate", "detect_profile", "list_profiles", "load_profile", "make_plan",
]
