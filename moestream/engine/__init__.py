"""The engine: a model file, its resident weights, the expert cache behind a budget, and generation."""

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.stats import EngineSnapshot, Generation, GenerationStats, GenerationStep

__all__ = ["Engine", "EngineOptions", "EngineSnapshot", "Generation", "GenerationStats", "GenerationStep"]
