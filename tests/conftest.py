"""Shared test hygiene."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_subnormals():
    """The engine flushes denormals for speed (process-wide); tests that check float edge cases need them back."""
    yield
    torch.set_flush_denormal(False)
