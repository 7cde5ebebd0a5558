"""The engine: a model file, its resident weights, the expert cache behind a budget, and generation."""

from moestream.engine.engine import Engine, Generation, GenerationStats

__all__ = ["Engine", "Generation", "GenerationStats"]
