"""How many expert slots a RAM budget buys.

The budget covers everything the process holds. Sizing happens after the dense weights are loaded and the
KV cache is allocated at the full context, so those are measured, not guessed (the SDQ seed, section 5.2:
buffers that grow after the cache is sized push the process past its budget). What cannot be measured yet
(prompt compute buffers at the chosen micro-batch, the reader's buffers) is estimated from the shapes and a
reserve covers the allocator's slack.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import psutil

from moestream.errors import BudgetError

MB = 1 << 20
DEFAULT_RESERVE_MB = 160
# With no budget given, leave this much of the machine's available RAM to everyone else.
DEFAULT_KEEP_FREE_MB = 1024


def rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_bytes() -> int:
    """MemAvailable, capped by the cgroup limit when one is set."""
    avail = psutil.virtual_memory().available
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
            if limit < (1 << 60):
                avail = min(avail, max(0, limit - usage))
        except (OSError, ValueError):
            continue
    return avail


@dataclass
class BudgetPlan:
    budget: int  # bytes the whole process may hold
    resident: int  # RSS measured after dense weights + KV cache were in place
    compute: int  # prompt compute buffers at the micro-batch (estimated)
    reader: int  # reader staging buffers
    reserve: int
    slot_nbytes: int
    n_slots: int
    min_slots: int
    explicit: bool  # the user gave the budget

    def describe(self) -> str:
        return (
            f"budget {self.budget / MB:.0f} MB = resident {self.resident / MB:.0f} (dense weights, KV, runtime)"
            f" + compute {self.compute / MB:.0f} + reader {self.reader / MB:.0f} + reserve {self.reserve / MB:.0f}"
            f" + {self.n_slots} expert slots x {self.slot_nbytes / MB:.2f} MB"
        )


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
    if budget_mb is None:
        budget = resident + max(0, available_bytes() - DEFAULT_KEEP_FREE_MB * MB)
    else:
        budget = budget_mb * MB
    n_slots = min(max_slots, max(0, (budget - fixed) // slot_nbytes))
    if n_slots < min_slots:
        need_mb = (fixed + min_slots * slot_nbytes + MB - 1) // MB
        if budget_mb is None:
            raise BudgetError(
                f"not enough free RAM: one token needs {need_mb} MB but about {budget // MB} MB is available; "
                "close other programs or use a smaller context (--ctx)"
            )
        raise BudgetError(
            f"--ram-budget-mb {budget_mb} is too small: dense weights, KV cache and buffers take {fixed // MB} MB "
            f"and one layer's {min_slots} active experts {min_slots * slot_nbytes // MB + 1} MB more; "
            f"use at least --ram-budget-mb {need_mb} (or a smaller --ctx)"
        )
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
