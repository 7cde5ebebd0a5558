"""How many expert slots a RAM budget buys.

The budget covers everything the process holds. Sizing happens after the dense weights are loaded and the
KV cache is allocated at the full context, so those are measured, not guessed: buffers that grew after the
cache is sized would push the process past its budget. What cannot be measured yet (prompt compute buffers
at the chosen micro-batch, from models/memory.py; the reader's buffers) is estimated from the shapes, and a
reserve covers the allocator's slack.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from moestream.errors import BudgetError

MB = 1 << 20
# Covers what no estimate names: the runtime's growth on the first forward (kernels, thread pools) and the
# allocator's slack. A design choice on the safe side (tests/test_budget.py checks peak RSS <= budget); shrink
# it only after measuring peak RSS on a real model with many threads.
DEFAULT_RESERVE_MB = 160
# Prompt micro-batches tried by choose_ubatch, largest first: their compute buffers grow with the micro-batch.
UBATCH_CHOICES = (128, 64, 32, 16)
# The share of the room beside the minimum expert slots that a prompt span's activations may take (choose_span):
# a longer span reads each expert once for more tokens, but what it holds is memory the cache does not get.
SPAN_SHARE = 0.25
# With no budget given, leave this much of the machine's available RAM to everyone else.
DEFAULT_KEEP_FREE_MB = 1024


def rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def reset_peak_rss() -> None:
    """Start the peak resident set over from the current one, so that peak_rss_bytes measures what came after
    (an engine's promise covers its own run, not what the process did before it, such as writing the demo's
    model or earlier tests in one pytest process). Where /proc does not allow it, the peak stays the
    process's lifetime peak, which can only overstate."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """This process's peak resident set. VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a
    process started from a large parent (a test runner) would report the parent's size as its own peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) of this process's cgroup memory limit (v2, else v1), or None where none is set."""
    for path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(path) as f:
                limit_s = f.read().strip()
            if limit_s == "max":
                continue
            with open(usage_path) as f:
                usage = int(f.read().strip())
            limit = int(limit_s)
            if limit < (1 << 60):  # v1 writes "no limit" as a huge number
                return limit, usage
        except (OSError, ValueError):
            continue
    return None


def available_bytes() -> int:
    """MemAvailable, capped by the cgroup limit when one is set."""
    avail = psutil.virtual_memory().available
    cgroup = _cgroup_memory()
    if cgroup is not None:
        avail = min(avail, max(0, cgroup[0] - cgroup[1]))
    return avail


def total_ram() -> tuple[int, str]:
    """The most RAM this process can have, and what sets it: the machine's total physical RAM, or the cgroup's
    memory limit where that is lower."""
    total = psutil.virtual_memory().total
    cgroup = _cgroup_memory()
    if cgroup is not None and cgroup[0] < total:
        return cgroup[0], "cgroup memory limit"
    return total, "total physical RAM"


def budget_bytes(budget_mb: int | None, resident: int) -> int:
    """The whole process's budget: the one given, or what it holds now plus what the machine can spare."""
    if budget_mb is None:
        return resident + max(0, available_bytes() - DEFAULT_KEEP_FREE_MB * MB)
    return budget_mb * MB


@dataclass
class BudgetPlan:
    budget: int  # bytes the whole process may hold
    resident: int  # RSS measured after dense weights + KV cache were in place
    compute: int  # prompt compute buffers at the prompt span (estimated)
    reader: int  # reader staging buffers
    reserve: int
    slot_nbytes: int
    n_slots: int
    min_slots: int
    explicit: bool  # the user gave the budget
    span: int = 0  # prompt tokens run through every layer at once (0: not chosen by this plan)

    def describe(self) -> str:
        span = f" (prompt span {self.span} tokens)" if self.span else ""
        return (
            f"budget {self.budget / MB:.0f} MiB = resident {self.resident / MB:.0f} (dense weights, KV, runtime)"
            f" + compute {self.compute / MB:.0f}{span} + reader {self.reader / MB:.0f}"
            f" + reserve {self.reserve / MB:.0f}"
            f" + {self.slots()}"
        )

    def slots(self) -> str:
        if not self.slot_nbytes:
            return "no expert slots (a dense model: nothing to stream)"
        return f"{self.n_slots} expert slots x {self.slot_nbytes / MB:.2f} MiB"


def plan_slots(
    *,
    budget_mb: int | None,
    resident: int,
    compute: int,
    reader: int,
    slot_nbytes: int,
    min_slots: int,
    max_slots: int,
    reserve_mb: int = DEFAULT_RESERVE_MB,
) -> BudgetPlan:
    reserve = reserve_mb * MB
    fixed = resident + compute + reader + reserve
    budget = budget_bytes(budget_mb, resident)
    if budget < fixed + min_slots * slot_nbytes:
        need_mb = (fixed + min_slots * slot_nbytes + MB - 1) // MB
        if budget_mb is None:
            raise BudgetError(
                f"not enough free RAM: one token needs {need_mb} MiB but about {budget // MB} MiB is available; "
                "close other programs or use a smaller context (--ctx)"
            )
        experts = f" and one layer's {min_slots} active experts {min_slots * slot_nbytes // MB + 1} MiB more"
        raise BudgetError(
            f"--ram-budget-mb {budget_mb} is too small: dense weights, KV cache and buffers take {fixed // MB} MiB"
            f"{experts if min_slots else ''}; use at least --ram-budget-mb {need_mb} (or a smaller --ctx)"
        )
    # a dense model has no expert to stream: slots of 0 bytes, none of them
    n_slots = min(max_slots, (budget - fixed) // slot_nbytes) if max_slots else 0
    return BudgetPlan(
        budget,
        resident,
        compute,
        reader,
        reserve,
        slot_nbytes,
        int(n_slots),
        min_slots,
        budget_mb is not None,
    )


def choose_ubatch(
    *,
    budget_mb: int | None,
    resident: int,
    compute_for: Callable[[int], int],
    reader: int,
    slot_nbytes: int,
    min_slots: int,
    reserve_mb: int = DEFAULT_RESERVE_MB,
    choices: tuple[int, ...] = UBATCH_CHOICES,
) -> int:
    """The largest prompt micro-batch whose compute buffers fit the budget beside the minimum expert slots.

    Prompt compute buffers grow linearly with the micro-batch, so a tight budget gets a smaller one instead
    of a refusal. When none fits this returns the smallest, and plan_slots then says how much budget it needs.
    """
    budget = budget_bytes(budget_mb, resident)
    fixed = resident + reader + reserve_mb * MB + min_slots * slot_nbytes
    for ub in sorted(choices, reverse=True):
        if fixed + compute_for(ub) <= budget:
            return ub
    return min(choices)


def choose_span(
    *,
    budget_mb: int | None,
    resident: int,
    compute_for: Callable[[int], int],
    reader: int,
    slot_nbytes: int,
    min_slots: int,
    ubatch: int,
    longest: int,
    reserve_mb: int = DEFAULT_RESERVE_MB,
) -> int:
    """The longest prompt span (the micro-batch doubled, up to `longest` tokens) that the engine runs through
    every layer at once: each layer's experts are then read once for all its tokens. Its activations beyond
    the micro-batch's may take SPAN_SHARE of what the budget leaves beside the micro-batch's buffers and the
    minimum expert slots; a budget with no room to spare keeps the micro-batch (the micro-batch-major path)."""
    budget = budget_bytes(budget_mb, resident)
    base = compute_for(ubatch)
    room = budget - (resident + reader + reserve_mb * MB + min_slots * slot_nbytes + base)
    span = ubatch
    while span < longest:
        longer = min(longest, 2 * span)
        if compute_for(longer) - base > SPAN_SHARE * room:
            break
        span = longer
    return span
