"""lynx-edge: fast Mixture-of-Experts inference on one edge GPU or CPU.

Public API: Engine, EngineConfig, SamplingParams, Chunk.
"""
from .engine import Chunk, Engine, EngineConfig
from .sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["Chunk", "Engine", "EngineConfig", "SamplingParams", "__version__"]
