"""Next-token choice from one position's logits: penalties, then greedy, or temperature + top-k + top-p + min-p
sampling; and the log-probabilities a client may ask for beside each token."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moestream.errors import ModelFileError

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed
PENALTY_MAX = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty (either sign)
REPETITION_MAX = 10.0  # beyond this every repeated token is gone anyway; a bigger value is a typo


def check_sampling(
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
) -> str | None:
    """What is wrong with these settings, naming the field (None: they are fine). The front-ends word
    it for their options (--temp) or request fields (temperature)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        return f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}"
    if top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {top_k}"
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        return f"top_p must be greater than 0 and at most 1, got {top_p}"
    if not (math.isfinite(min_p) and 0.0 <= min_p <= 1.0):
        return f"min_p must be between 0 and 1 (0 = off), got {min_p}"
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (math.isfinite(value) and -PENALTY_MAX <= value <= PENALTY_MAX):
            return f"{name} must be between -{PENALTY_MAX:g} and {PENALTY_MAX:g} (0 = off), got {value}"
    if not (math.isfinite(repetition_penalty) and 0.0 < repetition_penalty <= REPETITION_MAX):
        value = repetition_penalty
        return f"repetition_penalty must be greater than 0 and at most {REPETITION_MAX:g} (1 = off), got {value}"
    if seed is not None and not 0 <= seed <= SEED_MAX:
        return f"seed must be between 0 and 2**64-1, got {seed}"
    return None


class TokenHistory:
    """What the penalties look at for one sequence: its prompt's distinct tokens and how often it generated
    each token so far."""

    def __init__(self, prompt: Iterable[int] = ()):
        self.prompt = set(prompt)
        self.counts: Counter[int] = Counter()

    def add(self, token: int) -> None:
        self.counts[token] += 1


@dataclass
class TokenLogprobs:
    """A picked token's log-probability and the `top` most likely tokens' (id, logprob), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class Sampler:
    """Picks a token id from logits [V].

    First the penalties, on the raw logits: repetition_penalty (llama.cpp's and HF's) divides the positive
    logits and multiplies the negative ones of every token in the prompt or generated so far; then OpenAI's
    logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty over the generated tokens.
    temperature 0 means greedy (argmax). Otherwise the logits are divided by the temperature, cut to
    the top_k most likely (0 = no cut), then to the smallest set whose probability reaches top_p, then to
    the tokens at least min_p times as likely as the most likely one, and one token is drawn. The sampler
    owns its torch.Generator, so a seed fixes the whole sequence no matter what else uses torch's global RNG.

    Log-probabilities (pick(..., top=N)) are those of softmax(penalized logits / temperature), the
    distribution the draw is made from before the top_k / top_p / min_p cuts (which renormalize what they
    keep, and leave the rest at -inf); greedy reports temperature 1's, whose most likely token is the pick.
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        *,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
    ):
        problem = check_sampling(
            temperature, top_k, top_p, seed, min_p, presence_penalty, frequency_penalty, repetition_penalty
        )
        if problem is not None:
            raise ValueError(problem)
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.min_p = min_p
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty
        self.seed = seed
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()  # nondeterministic
        else:
            self.generator.manual_seed(seed)

    def with_seed(self, seed: int | None) -> Sampler:
        """A sampler with these settings and its own generator (one per choice of a request with n > 1)."""
        return Sampler(
            self.temperature, self.top_k, self.top_p, seed, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )  # fmt: skip

    @property
    def greedy(self) -> bool:
        # top_k=1 keeps only the argmax, so it is greedy at any temperature
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def __call__(self, logits: torch.Tensor, history: TokenHistory | None = None) -> int:
        return self.pick(logits, history)[0]

    def pick(
        self, logits: torch.Tensor, history: TokenHistory | None = None, top: int | None = None
    ) -> tuple[int, TokenLogprobs | None]:
        """The token, and with `top` (0 or more) its log-probability and the `top` most likely tokens'."""
        logits = self.penalize(_as_vector(logits), history)
        if self.greedy:
            token = int(torch.argmax(logits))
        else:
            ids, probs = self._candidates(logits)
            token = int(ids[torch.multinomial(probs, 1, generator=self.generator)])
        if top is None:
            return token, None
        logp = torch.log_softmax(_scale(logits, self.temperature or 1.0), dim=0)
        values, ids = torch.topk(logp, min(top, logp.numel()))
        pairs = list(zip(ids.tolist(), values.tolist(), strict=True))
        return token, TokenLogprobs(token, float(logp[token]), pairs)

    def probs(self, logits: torch.Tensor, history: TokenHistory | None = None) -> torch.Tensor:
        """The distribution a token is drawn from, over the whole vocabulary (filtered ids are 0)."""
        logits = self.penalize(_as_vector(logits), history)
        out = torch.zeros_like(logits)
        if self.greedy:
            out[torch.argmax(logits)] = 1.0
            return out
        ids, probs = self._candidates(logits)
        out[ids] = probs / probs.sum()
        return out

    def penalize(self, logits: torch.Tensor, history: TokenHistory | None) -> torch.Tensor:
        """The logits after the penalties (a new tensor; `logits` itself is left alone)."""
        if history is None or not self.penalized:
            return logits
        out = logits.clone()
        seen = sorted(i for i in history.prompt | history.counts.keys() if i < out.numel())
        if self.repetition_penalty != 1.0 and seen:
            ids = torch.tensor(seen)
            x = out[ids]
            out[ids] = torch.where(x > 0, x / self.repetition_penalty, x * self.repetition_penalty)
        made = [(i, c) for i, c in history.counts.items() if i < out.numel()]
        if made:
            ids = torch.tensor([i for i, _ in made])
            counts = torch.tensor([c for _, c in made], dtype=out.dtype)
            out[ids] -= counts * self.frequency_penalty + self.presence_penalty
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
        if self.min_p > 0.0:
            # sorted, so the kept ones are a prefix; the most likely token always survives
            n = max(1, int((probs >= self.min_p * probs[0]).sum()))
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
