"""moestream: run Mixture-of-Experts LLMs bigger than RAM by streaming routed experts from disk."""

import os

# torch's OpenMP threads run only the few wide ops (a prompt's attention); between them the engine's own lane
# pool computes on the same cores. With libgomp's default policy a thread that finished a parallel region spins
# for a while first and takes the core the lane pool's next call needs (a GPT-OSS decode step at half speed,
# bench/RESULTS.md). Set before torch loads libgomp; a value the user set stands.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
