"""When a prompt fetch reads the next layer's experts ahead: one rule, shared by the cache and the replay.

A prompt micro-batch that routes to nearly all of a layer's experts will route to nearly all of the next
layer's too, and reading that layer only once its routing is known leaves the disk idle through every
layer's attention and shared-expert compute (llama.cpp, streaming the file in order, does not). So such a
fetch also starts reading every uncached expert of the next layer, each admitted at once.
"""

AHEAD_COVERAGE = 0.9  # fraction of a layer's experts one fetch must ask for
AHEAD_MIN_LAYERS = 4  # and the cache must hold at least this many layers' worth of experts


def reads_ahead(n_ids: int, n_experts: int, lru_slots: int) -> bool:
    """Whether a prompt fetch of n_ids distinct experts reads the next layer ahead."""
    return n_ids >= AHEAD_COVERAGE * n_experts and lru_slots >= AHEAD_MIN_LAYERS * n_experts
