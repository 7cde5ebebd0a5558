"""Long GGUF fuzz run: thousands of seeded mutations of tiny model files, a table of outcomes per family.

    python tools/fuzz_gguf.py --cases 3000 --seed 1 --jobs 1
    python tools/fuzz_gguf.py --seed 1 --case 1234 --keep /tmp/case.gguf   # reproduce one case

Every case runs `moestream run -m FILE -p hi -n 2 --threads 1` in a forked worker (or, every --cli-every-th
case, as a real subprocess). Defects are listed with their reproducer (seed, case index, mutation) and the
moestream file the traceback ended in.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fuzz.gguf_cases import FAMILIES, load_seeds, make_case, materialize, write_seeds  # noqa: E402
from tests.fuzz.runner import DEFECTS, Worker, run_case  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--family", choices=FAMILIES, default=None, help="only this family")
    ap.add_argument("--cli-every", type=int, default=50, help="every Nth case as a real CLI subprocess (0: none)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--case", type=int, default=None, help="run only this case index")
    ap.add_argument("--keep", default=None, help="with --case: also write the case's file here")
    ap.add_argument("--seeds-dir", default=None, help="where the seed models live (default: a temp dir)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the outcomes per family as JSON")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="fuzz_gguf_")
    paths = write_seeds(args.seeds_dir or os.path.join(tmp, "seeds"))
    seeds = load_seeds(paths)
    indices = [args.case] if args.case is not None else list(range(args.cases))
    if args.case is not None and args.keep:
        c = make_case(seeds, args.seed, args.case, args.family)
        print(f"{c.family} {c.kind} on {c.seed_name}: {c.detail}")
        materialize(c, args.keep)
    workers = [Worker(paths["qwen3moe-q4_0"]) for _ in range(args.jobs)]
    results = []
    t0 = time.time()

    def run(slot: int, i: int):
        case = make_case(seeds, args.seed, i, args.family)
        cli = args.cli_every and i % args.cli_every == args.cli_every - 1
        workdir = os.path.join(tmp, f"w{slot}")
        os.makedirs(workdir, exist_ok=True)
        out = run_case(case, workdir, None if cli else workers[slot], args.timeout)
        return case, out, cli

    with ThreadPoolExecutor(args.jobs) as pool:
        chunks = [indices[j :: args.jobs] for j in range(args.jobs)]
        futures = [pool.submit(lambda j=j: [run(j, i) for i in chunks[j]]) for j in range(args.jobs)]
        for f in futures:
            results += f.result()
    for w in workers:
        w.stop()
    seconds = time.time() - t0
    report(results, args.seed, seconds)
    if args.json:
        write_json(args.json, results, args, seconds)
    return 1 if any(o.outcome in DEFECTS for _, o, _ in results) else 0


def tally(results) -> dict[str, Counter]:
    """Outcomes per family, and over all of them under "all"."""
    per_family: dict[str, Counter] = defaultdict(Counter)
    for case, out, _ in results:
        per_family[case.family][out.outcome] += 1
        per_family["all"][out.outcome] += 1
    return per_family


def write_json(path: str, results, args: argparse.Namespace, seconds: float) -> None:
    per_family = tally(results)
    doc = {
        "tool": "tools/fuzz_gguf.py",
        "seed": args.seed,
        "cases": len(results),
        "through_cli": sum(c for _, _, c in results),
        "seconds": round(seconds, 1),
        "outcomes": {fam: dict(row) for fam, row in per_family.items()},
        "defects": [
            {"case": c.index, "family": c.family, "kind": c.kind, "seed_model": c.seed_name, "outcome": o.outcome,
             "where": o.where, "detail": o.detail[:300]}
            for c, o, _ in results
            if o.outcome in DEFECTS
        ],
    }  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)


def report(results, seed: int, seconds: float) -> None:
    table = tally(results)
    cols = ["cases", "ok", "clean", *DEFECTS]
    print(f"\n{len(results)} cases, seed {seed}, {seconds:.0f} s ({sum(c for _, _, c in results)} through the CLI)")
    print(f"{'family':<14}" + "".join(f"{c:>10}" for c in cols))
    for fam in [*FAMILIES, "all"]:
        if fam in table:
            row = table[fam]
            print(f"{fam:<14}" + "".join(f"{(sum(row.values()) if c == 'cases' else row[c]):>10}" for c in cols))
    defects = [(c, o) for c, o, _ in results if o.outcome in DEFECTS]
    if not defects:
        return
    by_class: dict[tuple[str, str], list] = defaultdict(list)
    for c, o in defects:
        by_class[(o.where or o.outcome, o.detail.split(":")[0][:60])].append((c, o))
    print(f"\n{len(defects)} defects in {len(by_class)} classes (where, what): first reproducer of each")
    for (where, _what), items in sorted(by_class.items(), key=lambda kv: -len(kv[1])):
        c, o = items[0]
        print(f"  {len(items):4d}  {where:<34} {o.outcome}: {o.detail[:90]}")
        print(f"        --seed {seed} --case {c.index}: {c.family}/{c.kind} on {c.seed_name}: {c.detail[:90]}")


if __name__ == "__main__":
    sys.exit(main())
