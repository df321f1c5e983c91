"""lynx-edge: fast Mixture-of-Experts inference on one edge GPU or CPU.

Public API: Engine, EngineConfig, SamplingParams, Chunk. Imported lazily so `lynx-edge --help`
does not pay for importing torch.
"""
__version__ = "0.1.0"
__all__ = ["Chunk", "Engine", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name):
    if name in ("Chunk", "Engine", "EngineConfig"):
        from . import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'lynx_edge' has no attribute {name!r}")
