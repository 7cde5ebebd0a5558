"""Synthetic GGUF models at real shapes with random weights, written as llama.cpp's converter lays them out:
the demo's model, the tests' and the benchmarks' (shapes.py: the shapes and the writer; arches.py and
gqa_arches.py: the architectures beyond Qwen; blocks.py: the tensors of one block)."""
