"""moestream: run Mixture-of-Experts LLMs bigger than RAM by streaming routed experts from disk."""

__version__ = "0.1.0"
