"""How far each engine's logits lie from the model's: transformers (float32) against moestream exact, moestream
default and llama.cpp, all on the same GGUF, at every decode step of a greedy continuation.

    python bench/logit_error.py --seeds 5
    python bench/logit_error.py --tree /tmp/before --name logit-error-before   # another checkout's moestream

Each case is a tiny random model built by transformers and written as llama.cpp's converter writes it (the
tests' writers, tests/hf_gguf*.py): GPT-OSS in two shapes with its experts in MXFP4 (the model then holds
exactly the file's values, so an exact engine is off by rounding only), and every other architecture with its
experts in Q8_0 (a quantized file, as users run them: the weights' own rounding is in every column alike).
The reference's greedy continuation of a random prompt is fed to every engine (teacher forcing), so each
step's logits compare over the same tokens. Reported per case: the largest and the median over decode steps
of the largest absolute logit difference, and the steps whose top token agrees with the reference's.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT, DECODE = 89, 12


def _import_tree(tree: str) -> None:
    """moestream from `tree` (this checkout by default), the tests' model writers from this checkout: once the
    package is imported, its submodules come from where it was found."""
    sys.path.insert(0, os.path.abspath(tree))
    import moestream  # noqa: F401

    sys.path[0] = os.path.dirname(HERE)


def cases(seeds: int) -> list[tuple[str, int, Any]]:
    """(label, seed, build) where build(seed, path) writes the GGUF and returns the transformers model."""
    from gguf import GGMLQuantizationType as T

    import tests.hf_gguf_gpt_oss as gpt_oss
    from tests.test_models import MOE_CASES

    def mxfp4(make):
        def build(seed: int, path: str):
            model = make(seed)
            gpt_oss.write_gpt_oss_from_hf(model, path, mxfp4=gpt_oss.quantize_gpt_oss_experts(model))
            return model

        return build

    def q8(arch):
        def build(seed: int, path: str):
            model = arch.hf_model(seed=seed)
            arch.write(model, path, expert_type=T.Q8_0)
            return model

        return build

    out = [("gpt-oss sharp heads, MXFP4", s, mxfp4(gpt_oss.sharp_gpt_oss)) for s in range(seeds)]
    out += [("gpt-oss tiny, MXFP4", s, mxfp4(lambda seed: gpt_oss.GPT_OSS.hf_model(seed=seed))) for s in range(seeds)]
    out += [(f"{a.id}, Q8_0 experts", s, q8(a)) for a in MOE_CASES if a.name != "gpt-oss" for s in range(min(2, seeds))]
    return out


def moestream_logits(path: str, seq: list[int], exact: bool | None):
    import torch

    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    eng = Engine(path, EngineOptions(n_slots=256, exact=exact))
    try:
        with torch.inference_mode():
            rows = [eng.forward(seq[:PROMPT], 0)] + [eng.forward([t], PROMPT + j) for j, t in enumerate(seq[PROMPT:-1])]
    finally:
        eng.close()
    return torch.stack(rows).float()


def llama_cpp_logits(path: str, seq: list[int]):
    import llama_cpp
    import torch

    llm = llama_cpp.Llama(model_path=path, n_ctx=256, logits_all=True, verbose=False, n_threads=os.cpu_count())
    try:
        llm.eval(seq[:-1])
        return torch.tensor(np.array(llm.scores[PROMPT - 1 : len(seq) - 1]))
    finally:
        llm.close()


def measure(label: str, seed: int, build, workdir: str, with_llama: bool) -> dict[str, Any]:
    import torch

    from tests.hf_gguf import random_tokens

    path = os.path.join(workdir, "case.gguf")
    model = build(seed, path)
    prompt = random_tokens(PROMPT, model.config.vocab_size, seed=seed)
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), max_new_tokens=DECODE, do_sample=False)[0].tolist()
        ref = model(torch.tensor([seq[:-1]])).logits[0, PROMPT - 1 :].float()
    engines = {"exact": lambda: moestream_logits(path, seq, True), "default": lambda: moestream_logits(path, seq, None)}
    if with_llama:
        engines["llama.cpp"] = lambda: llama_cpp_logits(path, seq)
    row: dict[str, Any] = {"case": label, "seed": seed, "steps": len(ref)}
    for name, run in engines.items():
        try:
            logits = run()
        except ValueError as exc:  # llama.cpp refuses the file (an architecture variant it does not load)
            row[name] = {"refused": str(exc)}
            continue
        err = (logits - ref).abs().amax(-1)
        agree = int((logits.argmax(-1) == ref.argmax(-1)).sum())
        row[name] = {"max": float(err.max()), "median": float(err.median()), "top1_agree": agree}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--tree", default=os.path.dirname(HERE), help="the checkout whose moestream runs")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp (llama-cpp-python) even if installed")
    ap.add_argument("--workdir", default="/tmp/logit-error")
    ap.add_argument("--name", default="logit-error")
    ap.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    _import_tree(args.tree)
    sys.path.insert(1, HERE)
    import torch
    from harness import log, run_meta, save_results

    torch.set_num_threads(1)
    with_llama = not args.no_llama
    if with_llama:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            log("llama_cpp not importable: its column is left out")
            with_llama = False
    os.makedirs(args.workdir, exist_ok=True)
    args.model = os.path.join(args.workdir, "case.gguf")  # each case in turn: run_meta reads its disk
    rows = []
    for label, seed, build in cases(args.seeds):
        rows.append(measure(label, seed, build, args.workdir, with_llama))
        done = {k: v["max"] for k, v in rows[-1].items() if isinstance(v, dict) and "max" in v}
        log(f"{label} seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in done.items()))
    table = report(rows)
    save_results({"meta": run_meta(args), "rows": rows, "markdown": table}, table, args, args.name)


def report(rows: list[dict[str, Any]]) -> str:
    names = [n for n in ("exact", "default", "llama.cpp") if n in rows[0]]
    head = "| case | seeds | " + " | ".join(f"{n}: max (median), top-1 agree" for n in names) + " |"
    lines = [head, "|" + "---|" * (2 + len(names))]
    for label in dict.fromkeys(r["case"] for r in rows):
        group = [r for r in rows if r["case"] == label]
        cells = []
        for n in names:
            ran = [r[n] for r in group if "max" in r[n]]
            if not ran:
                cells.append("refused the file")
                continue
            worst = max(r["max"] for r in ran)
            med = float(np.median([r["median"] for r in ran]))
            agree = sum(r["top1_agree"] for r in ran)
            cells.append(f"{worst:.4f} ({med:.4f}), {agree}/{sum(g['steps'] for g in group if 'max' in g[n])}")
        lines.append(f"| {label} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
