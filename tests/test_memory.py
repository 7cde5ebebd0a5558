"""Memory accounting pinned: the KV bytes and the prompt's transient compute bytes of every tiny test
architecture and every synthetic shape, at a few (micro-batch, context, query chunk, ordered) points, are
the ones the per-architecture accounts gave before they became one module (tests/memory_pins.json), so the
plans made from them (expert slots, micro-batch, prompt span) stay the same.

The kernels' scratch is the machine's (which kernels the native library has), so it is pinned by the
arguments the account asks it with, and the rest by value.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moestream.compute import linear
from moestream.models import ARCHITECTURES
from moestream.models.routing import Routing

PINS = json.loads((Path(__file__).parent / "memory_pins.json").read_text())


def _arch_and_config(case: dict):
    arch = ARCHITECTURES[case["arch"]]
    fields = dict(case["config"])
    if "routing" in fields:
        fields["routing"] = Routing(**fields["routing"])
    return arch, arch.Config(**fields)


@pytest.mark.parametrize("case", PINS, ids=[c["case"] for c in PINS])
def test_compute_bytes_are_the_recorded_ones(case, monkeypatch):
    arch, cfg = _arch_and_config(case)
    asked = []
    monkeypatch.setattr(linear, "kernel_scratch_bytes", lambda *args: asked.append(list(args)) or 0)
    for ubatch, ctx, chunk, ordered, nbytes, scratch_args in case["compute"]:
        asked.clear()
        got = arch.memory(cfg).compute_nbytes(ubatch, ctx, chunk=chunk, ordered=ordered)
        assert (got, asked) == (nbytes, [scratch_args]), (ubatch, ctx, chunk, ordered)


@pytest.mark.parametrize("case", PINS, ids=[c["case"] for c in PINS])
def test_kv_bytes_are_the_recorded_ones(case):
    arch, cfg = _arch_and_config(case)
    for ctx, exact, nbytes in case["kv"]:
        assert arch.memory(cfg).kv_nbytes(ctx, exact) == nbytes, (ctx, exact)
