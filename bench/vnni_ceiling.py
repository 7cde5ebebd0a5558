"""The AVX-512 VNNI ceiling of this CPU's cores: what the lane kernels' inner loop could reach at best.

    python bench/vnni_ceiling.py --rounds 5

Compiles (gcc -O3 -march=native) and runs, on one thread, a loop of 8 independent zmm `vpdpbusd` chains
(64 multiply-adds each), alone and with F float multiplies or fused multiply-adds on 512-bit registers beside
every 8 of them: the float steps a lane kernel takes per (row, token, group of 16 lanes) next to its 8
`vpdpbusd` (Q4_K: 3, one multiply of the scales and two fused multiply-adds; Q6_K: 4). Where a CPU runs both
kinds on the same pipes (Zen 4 splits each 512-bit operation into two 256-bit halves), the float steps take
the integer work's issue slots, and the F = 3 rate is the most a Q4_K kernel with these steps can reach.
The cases with I > 0 add I integer multiplies (`vpmulld`) beside the float steps: what applying sub-block
scales in integers costs (llama.cpp's way; with one activation scale per 256 values a Q4_K step still needs
the float scaling of each (row, token) pair's sum, so at least F = 3 remains beside them).
Reports each case's best GMAC/s over --rounds runs, one core.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from harness import add_results_args, log, save_rows

ITERS = 100_000_000
SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
int main(int argc, char **argv) {
    (void)argv;
    __m512i a[8], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    __m512 f[6], m = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-9f);
    __m512i g[2], sc = _mm512_set1_epi32(3);
    for (int i = 0; i < 2; i++) g[i] = _mm512_set1_epi32(argc + 9 + i);
    for (int i = 0; i < 8; i++) a[i] = _mm512_set1_epi32(argc + i); /* distinct: no chain folds into another */
    for (int i = 0; i < 6; i++) f[i] = _mm512_set1_ps((float)(argc + i));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long n = 0; n < ITERS; n++) {
        __asm__ volatile("" : "+v"(w), "+v"(x)); /* the inputs are not loop constants */
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
#pragma GCC unroll 6
        for (int i = 0; i < FLOATS; i++) f[i] = (i % 3 == 2) ? _mm512_mul_ps(f[i], m) : _mm512_fmadd_ps(f[i], m, c);
#pragma GCC unroll 2
        for (int i = 0; i < INTMULS; i++) g[i] = _mm512_mullo_epi32(g[i], sc);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    __m512i s = a[0];
    for (int i = 1; i < 8; i++) s = _mm512_add_epi32(s, a[i]);
    __m512 fs = f[0];
    for (int i = 1; i < 6; i++) fs = _mm512_add_ps(fs, f[i]);
    double sec = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    for (int i = 0; i < 2; i++) s = _mm512_add_epi32(s, g[i]);
    printf("%.6f %d %g\n", sec, _mm512_reduce_add_epi32(s), _mm512_reduce_add_ps(fs));
    return 0;
}
"""
# (float steps, integer multiplies) per 8 vpdpbusd
CASES = ((0, 0), (3, 0), (4, 0), (6, 0), (3, 1), (3, 2))


def build(cc: str, floats: int, intmuls: int, out_dir: Path) -> Path:
    src, exe = out_dir / f"ceiling{floats}-{intmuls}.c", out_dir / f"ceiling{floats}-{intmuls}"
    src.write_text(SOURCE)
    cmd = [cc, "-O3", "-march=native", f"-DITERS={ITERS}L", f"-DFLOATS={floats}", f"-DINTMULS={intmuls}"]
    cmd += [str(src), "-o", str(exe)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"vnni_ceiling: {cc} failed (does this CPU have AVX-512 VNNI?): {res.stderr[-300:]}")
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    add_results_args(ap, "vnni-ceiling")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("vnni_ceiling: --rounds must be at least 1")
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise SystemExit("vnni_ceiling: no C compiler (set CC)")
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        raise SystemExit("vnni_ceiling: this CPU has no AVX-512 VNNI")
    out_dir = Path(tempfile.mkdtemp(prefix="vnni-ceiling-"))
    rows, lines = (
        [],
        [
            f"one thread, 8 zmm vpdpbusd chains, {ITERS:,} iterations a run, best of {args.rounds} runs",
            "",
            "| float steps per 8 vpdpbusd | integer multiplies | best GMAC/s | of the integer loop alone |",
            "|---|---|---|---|",
        ],
    )
    alone = None
    for floats, intmuls in CASES:
        exe = build(cc, floats, intmuls, out_dir)
        secs = [float(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()[0])
                for _ in range(args.rounds)]  # fmt: skip
        gmacs = ITERS * 8 * 64 / min(secs) / 1e9
        alone = alone or gmacs
        rows.append({"float_steps": floats, "int_multiplies": intmuls, "seconds": secs, "best_gmac_s": gmacs})
        lines.append(f"| {floats} | {intmuls} | {gmacs:.1f} | {gmacs / alone:.2f} |")
        log(f"{floats} float steps, {intmuls} integer multiplies: {gmacs:.1f} GMAC/s")
    args.model = os.devnull
    save_rows(args, rows, lines)


if __name__ == "__main__":
    main()
