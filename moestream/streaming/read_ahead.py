"""When a prompt fetch reads the next layer's experts ahead: one rule, shared by the cache and the replay.

A prompt micro-batch that routes to nearly all of a layer's experts will route to nearly all of the next
layer's too, and reading that layer only once its routing is known leaves the disk idle through every
layer's attention and shared-expert compute (llama.cpp, streaming the file in order, does not). So such a
fetch also starts reading the next layer's first uncached experts, each admitted at once.

Half a layer's experts: enough to keep the disk busy through that compute and the layer's own packing,
not more, since the next layer may not ask for all of them and the reader holds what it read ahead until
the next layer packs it, in buffers the budget counts. Under pressure, 3 pairs each: half a layer prefilled
at 1.18x (1.11-1.27) of a quarter, and the whole layer at 0.87x (0.81-1.07) of half
(bench/results/2026-11-30-ahead-half-ab-qwen36.json, -ahead-whole-); before the cache's memory commit was
taken out of the prompt, half a layer measured no better than a quarter (14.5 vs 14.7 s).
"""

# fraction of a layer's experts one fetch must ask for. At 0.5 a 30-token Qwen3.6 prompt (61% of each layer's
# experts) read ahead too and prefilled slower: 13.3 vs 11.4 s (medians of 4), 41% of its read-ahead unused.
AHEAD_COVERAGE = 0.75
AHEAD_MIN_LAYERS = 4  # and the cache must hold at least this many layers' worth of experts


def ahead_experts(n_experts: int) -> int:
    """At most this many experts of the next layer are read ahead (half a layer: see the module's note)."""
    return max(1, n_experts // 2)


def prompt_slots(n_experts: int) -> int:
    """LRU entries a prompt micro-batch may add to the expert cache while a generation runs: enough for the
    read-ahead rule and what it reads ahead, 1152 slots (2.0 GB) for Qwen3.6-35B (SlotPolicy.begin_step).

    A fresh process's first prompt otherwise spreads over the whole cache, and committing that much fresh
    memory while the model runs is what slowed it most in a VM (the host backs each page on first touch): a
    98-token Qwen3.6 prompt under a balloon ran at 7.7 tok/s with a 3500 MB budget against 5.4 with 7168
    (bench/results/2026-11-30-prefill-budget-ab-qwen36.json). The prefault commits the rest while idle."""
    return AHEAD_MIN_LAYERS * n_experts + ahead_experts(n_experts)


def decode_slots(top_k: int) -> int:
    """LRU entries a decoded token may add while a generation runs: the cache keeps growing at a pace whose
    first touches cost a decode step little (56 MB a token for Qwen3.6-35B), instead of the prefault
    committing the rest at once under it (decode at 0.56x while it did,
    bench/results/2026-11-30-prompt-slots-ab-qwen36.json)."""
    return 4 * top_k


def reads_ahead(n_ids: int, n_experts: int, lru_slots: int) -> bool:
    """Whether a prompt fetch of n_ids distinct experts reads the next layer ahead."""
    return n_ids >= AHEAD_COVERAGE * n_experts and lru_slots >= AHEAD_MIN_LAYERS * n_experts


def ahead_reads(n_experts: int, run_len: int) -> int:
    """Reads the read-ahead may hold at once: three matrices per run of up to run_len adjacent experts. The
    reader keeps that many buffers for it on top of those the prompt's own reads cycle through."""
    return 3 * -(-ahead_experts(n_experts) // run_len)


def consecutive_runs(items: list, max_len: int, key=lambda x: x) -> list[list]:
    """items split, in order, into runs whose keys are consecutive integers, at most max_len long: what one run
    read takes (the cache splits (expert, slot) pairs, the read-ahead expert ids)."""
    runs: list[list] = []
    for item in items:
        if runs and key(item) == key(runs[-1][-1]) + 1 and len(runs[-1]) < max_len:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def ahead_choice(fresh: list[int], n_experts: int, run_len: int) -> list[int]:
    """Which of the next layer's uncached experts (ascending ids) are read ahead: the first ahead_experts of
    them, fewer where they are scattered, so that their runs of adjacent ids (at most run_len long, three
    reads each) take at most ahead_reads reads."""
    runs = consecutive_runs(fresh[: ahead_experts(n_experts)], run_len)
    return [e for run in runs[: ahead_reads(n_experts, run_len) // 3] for e in run]
