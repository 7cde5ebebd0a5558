"""Digests of what every architecture's tiny models compute, for refactors that must not change a bit.

    python tools/output_digest.py OUT.json            # record
    python tools/output_digest.py OUT.json --against BEFORE.json   # record and compare, exit 1 on a change

For each architecture of the parametrized tests, in a float and a quantized file: the prompt's logits at every
position and each decode step's (the model's forward), greedy tokens and the logits they were chosen from
under a budget that streams and with every expert cached (micro-batch-major and as one span), and three
sequences decoded together by a batch; with the cache's hit and miss counts. Digests are sha256 of the
float32 bytes, so any change of any bit shows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moestream.engine.engine import Engine  # noqa: E402
from moestream.engine.options import EngineOptions  # noqa: E402
from tests.hf_gguf import n_experts, random_tokens  # noqa: E402
from tests.test_models import ARCH_CASES  # noqa: E402


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


class KeepLogits:
    def __init__(self) -> None:
        self.digests: list[str] = []

    def __call__(self, logits: torch.Tensor) -> int:
        self.digests.append(digest(logits))
        return int(logits.argmax())


def generate(path: str, prompt: list[int], **options) -> dict:
    eng = Engine(path, EngineOptions(**options))
    keep = KeepLogits()
    try:
        gen = eng.generate(prompt, 8, keep)
        return {"tokens": gen.tokens, "logits": keep.digests, "hits": gen.stats.hits, "misses": gen.stats.misses}
    finally:
        eng.close()


def forward(path: str, toks: list[int], slots: int) -> dict:
    eng = Engine(path, EngineOptions(n_slots=slots))
    try:
        with torch.inference_mode():
            whole = eng.forward(toks[:40], 0, all_logits=True)
            steps = [digest(eng.forward([t], 40 + j)) for j, t in enumerate(toks[40:48])]
        return {"prompt": digest(whole), "steps": steps}
    finally:
        eng.close()


def batched(path: str, vocab: int, slots: int) -> dict:
    eng = Engine(path, EngineOptions(n_slots=slots, max_batch=3, ubatch=8, ctx=128))
    try:
        b = eng.scheduler()
        seqs = [b.add(random_tokens(n, vocab, seed=n), 6, KeepLogits()) for n in (3, 9, 17)]
        tokens: dict[int, list[int]] = {id(s): [] for s in seqs}
        while len(b):
            for ev in b.step():
                tokens[id(ev.sequence)].append(ev.token)
        return {"tokens": [tokens[id(s)] for s in seqs], "logits": [s.sampler.digests for s in seqs]}
    finally:
        eng.close()


def record() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCH_CASES:
            for which, (dense_type, expert_type) in enumerate(arch.stream_types):
                model = arch.hf_model(seed=2)
                cfg = model.config
                path = str(Path(tmp) / f"{arch.id}-{which}.gguf")
                arch.write(model, path, dense_type=dense_type, expert_type=expert_type)
                toks = random_tokens(48, cfg.vocab_size, seed=3)
                tight, every = cfg.num_experts_per_tok + 3, cfg.num_hidden_layers * n_experts(cfg)
                key = f"{arch.id}/{which}"
                out[key] = {
                    "forward": forward(path, toks, every),
                    "tight": generate(path, toks[:40], n_slots=tight, ubatch=8),
                    "tight_span": generate(path, toks[:40], n_slots=tight, ubatch=8, prefill_span=16),
                    "cached_mb": generate(path, toks[:40], n_slots=every, ubatch=8, prefill_span=8),
                    "cached_span": generate(path, toks[:40], n_slots=every, ubatch=8),
                    "batched_tight": batched(path, cfg.vocab_size, tight),
                    "batched_cached": batched(path, cfg.vocab_size, every),
                }
                print(key, "done", file=sys.stderr, flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--against", help="a digest file recorded before: report every difference")
    args = ap.parse_args()
    torch.set_num_threads(1)
    got = record()
    Path(args.out).write_text(json.dumps(got, indent=1))
    if args.against is None:
        return 0
    want = json.loads(Path(args.against).read_text())
    diffs = [(k, case) for k in want for case in want[k] if got.get(k, {}).get(case) != want[k][case]]
    for k, case in diffs:
        print(f"DIFFERS {k} {case}: {want[k][case]} -> {got.get(k, {}).get(case)}")
    print(f"{len(diffs)} of {sum(len(v) for v in want.values())} cases differ")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
