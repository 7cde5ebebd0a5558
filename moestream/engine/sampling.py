"""Next-token choice from one position's logits: greedy, or temperature + top-k + top-p sampling."""

from __future__ import annotations

import math

import torch

from moestream.errors import ModelFileError

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int | None) -> str | None:
    """What is wrong with these settings, naming the field (None: they are fine). The front-ends word
    it for their options (--temp) or request fields (temperature)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        return f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
    if top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {top_k}"
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        return f"top_p must be greater than 0 and at most 1, got {top_p}"
    if seed is not None and not 0 <= seed <= SEED_MAX:
        return f"seed must be between 0 and 2**64-1, got {seed}"
    return None


class Sampler:
    """Picks a token id from logits [V].

    temperature 0 means greedy (argmax). Otherwise the logits are divided by the temperature, cut to
    the top_k most likely (0 = no cut), then to the smallest set whose probability reaches top_p, and
    one token is drawn. The sampler owns its torch.Generator, so a seed fixes the whole sequence no
    matter what else uses torch's global RNG.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        problem = check_sampling(temperature, top_k, top_p, seed)
        if problem is not None:
            raise ValueError(problem)
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()  # nondeterministic
        else:
            self.generator.manual_seed(seed)

    @property
    def greedy(self) -> bool:
        # top_k=1 keeps only the argmax, so it is greedy at any temperature
        return self.temperature == 0.0 or self.top_k == 1

    def __call__(self, logits: torch.Tensor) -> int:
        logits = _as_vector(logits)
        if self.greedy:
            return int(torch.argmax(logits))
        ids, probs = self._candidates(logits)
        pick = torch.multinomial(probs, 1, generator=self.generator)
        return int(ids[pick])

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a token is drawn from, over the whole vocabulary (filtered ids are 0)."""
        logits = _as_vector(logits)
        out = torch.zeros_like(logits)
        if self.greedy:
            out[torch.argmax(logits)] = 1.0
            return out
        ids, probs = self._candidates(logits)
        out[ids] = probs / probs.sum()
        return out

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Surviving ids (most likely first) and their unnormalized probabilities."""
        scaled = _scale(logits, self.temperature)
        if 0 < self.top_k < scaled.numel():
            values, ids = torch.topk(scaled, self.top_k)  # sorted, largest first
        else:
            values, ids = torch.sort(scaled, descending=True)
        probs = torch.softmax(values, dim=0)
        if self.top_p < 1.0:
            # keep a token while the mass of the tokens before it is still short of top_p: the
            # smallest prefix that reaches top_p (the first token always survives)
            before = torch.cumsum(probs, dim=0) - probs
            n = max(1, int((before < self.top_p).sum()))
            ids, probs = ids[:n], probs[:n]
        return ids, probs


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, shifted so the largest is 0. Shifting first keeps a tiny temperature from
    overflowing to inf - inf = NaN; a temperature that underflows (a denormal, flushed to 0 by the engine)
    divides the others to -inf and leaves the maximum at 0, the greedy limit it stands for."""
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise ModelFileError("the model computed NaN or infinite logits; the model file is damaged")
    diff = logits - logits.max()
    return torch.where(diff == 0, torch.zeros_like(diff), diff / temperature)


def _as_vector(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 1:
        raise ValueError(f"Sampler takes the logits of one position, shape [V]; got {tuple(logits.shape)}")
    return logits.detach().to("cpu", torch.float32)
