"""Bad option values of every command end before anything is loaded: one line on stderr naming the option,
exit 2, no traceback. Most cases run `main()` in-process (milliseconds each) with the model loaders
forbidden; a set of them also runs as real `python -m moestream` processes, all at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import moestream.analysis.probe as probe_module
import moestream.cli.run as run_module
from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.formats.gguf_file import GGUFFile

HUGE = "9" * 30


@pytest.fixture(scope="session")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny model, a trace of it, an existing directory and paths that do not exist."""
    d = tmp_path_factory.mktemp("opts")
    model, trace = str(d / "tiny.gguf"), str(d / "tiny.trace.csv")
    cli = [sys.executable, "-m", "moestream"]
    subprocess.run([*cli, "synth", "--shape", "tiny", "-o", model], check=True, capture_output=True)
    run = [*cli, "run", "-m", model, "-p", "hello", "-n", "4", "--trace", trace, "--ram-budget-mb", "2000"]
    subprocess.run(run, check=True, capture_output=True)
    return {
        "M": model,
        "T": trace,
        "DIR": str(d),
        "MISSING": str(d / "missing.gguf"),
        "NODIR": str(d / "no" / "such" / "out.json"),
        "OUT": str(d / "out.json"),
    }


# ---- the cases -----------------------------------------------------------------------------------

# bad values by the kind of value an option takes
BAD = {
    "positive": ["0", "-1", "abc", "1.5", "nan", "", HUGE],
    "count": ["-1", "abc", "1.5", "inf", HUGE],
    "temp": ["-1", "nan", "inf", "-inf", "abc", "1e999", "-1e-45"],
    "top_p": ["0", "-1", "2", "1.0001", "nan", "inf", "abc"],
    "top_k": ["-1", "abc", "1.5", "nan", HUGE],
    "seed": ["-1", str(2**64), "abc", "1.5", "nan"],
    "port": ["-1", "65536", "abc"],
    "real_pos": ["0", "-1", "nan", "inf", "abc"],
    "real_nonneg": ["-1", "nan", "inf", "-inf", "abc"],
    "fraction": ["-0.1", "1.5", "nan", "abc"],
    "penalty": ["-2.01", "3", "nan", "inf", "abc"],
    "repeat": ["0", "-1", "11", "nan", "inf", "abc"],
    "output": ["{DIR}", "{NODIR}"],
    "input": ["{MISSING}", "{DIR}"],
    # a directory is a model too (the split model's parts it holds): test_split.py; hf: needs OWNER/NAME[:QUANT]
    "model": ["{MISSING}", "hf:nobody", "hf:a/b:Q4 K", "hf:a/../b"],
    "threads": ["0", "100000", "nan"],
}

ENGINE = {
    "--ram-budget-mb": "positive",
    "--ctx": "positive",
    "--threads": "threads",
    "--io-threads": "threads",
    "--ubatch": "threads",
    "--pin-mb": "positive",
    "--keep-free-mb": "positive",
    "--admit-min-hits": "count",
    "--trace": "output",
    "--pin-profile": "input",
    "--route-trace": "input",
    "-m": "model",
}
SAMPLING = {"--temp": "temp", "--top-k": "top_k", "--top-p": "top_p", "--seed": "seed"}
PENALTIES = {"--min-p": "fraction", "--presence-penalty": "penalty", "--frequency-penalty": "penalty",
             "--repeat-penalty": "repeat"}  # fmt: skip

COMMANDS: dict[str, tuple[list[str], dict[str, str]]] = {
    "run": (
        ["run", "-m", "{M}", "-p", "hi"],
        {**ENGINE, **SAMPLING, **PENALTIES, "-n": "positive", "--stats-json": "output"},
    ),
    "chat": (["chat", "-m", "{M}"], {**ENGINE, **SAMPLING, **PENALTIES, "-n": "positive"}),
    "serve": (
        ["serve", "-m", "{M}"],
        {**ENGINE, **SAMPLING, "--port": "port", "--max-tokens-default": "positive"},
    ),
    "serve-ray": (
        ["serve-ray", "-m", "{M}"],
        {**ENGINE, **SAMPLING, "--port": "port", "--replicas": "positive", "--max-replicas": "positive"},
    ),
    "demo": (
        ["demo"],
        {"--layers": "positive", "--tokens": "positive", "--ram-budget-mb": "positive", "--threads": "threads"},
    ),
    "synth": (["synth", "--shape", "tiny", "-o", "{OUT}"], {"--layers": "positive", "--seed": "seed", "-o": "output"}),
    "probe": (
        ["probe", "--file", "{M}"],
        {"--reads-per-row": "positive", "--seconds-per-row": "real_pos", "-o": "output", "--file": "model"},
    ),
    "replay": (
        ["replay", "{T}", "--no-plot"],
        {"--half-life": "real_pos", "--pin-fraction": "fraction", "--plot": "output", "--profile": "input"},
    ),
    "stats": (["stats", "{T}"], {"--window": "positive"}),
    "profile": (["profile", "{T}", "-o", "{OUT}"], {"-o": "output"}),
    "forecast": (
        ["forecast"],
        {
            "--layers": "positive",
            "--top-k": "positive",
            "--expert-bytes": "positive",
            "--slots": "positive",
            "--compute-ms": "real_nonneg",
            "--io-threads": "threads",
            "--pack-ms": "real_nonneg",
            "--probe": "input",
            "--model": "model",
            "--trace": "input",
            "--compute-from": "input",
        },
    ),
}

# values checked once the command runs (still before any model is loaded): (argv, words the line names)
CHECKED_IN_COMMAND = (
    [(["probe", "--file", "{M}", "--inflight", v], "--inflight") for v in ("0", "-1", "abc", "100000", ",")]
    + [(["probe", "--file", "{M}", "--sizes", v], "--sizes") for v in ("nan", "inf", "0", "abc", "-1", "2T", ",")]
    + [(["probe", "--dir", "{DIR}", "--size", v], "--size") for v in ("nan", "-1", "0", "inf")]
    + [(["stats", "{T}", "--k", v], "--k") for v in ("0", "abc", "nan", "-3", HUGE)]
    + [(["stats", "{T}", "--top", v], "--top") for v in ("0", "abc", "1e3")]
    + [
        (["replay", "{T}", "--no-plot", "--policy", "nope"], "policy"),
        (["replay", "{T}", "--plot", "{NODIR}"], "--plot"),
        (["probe"], "--file"),
        (["probe", "--file", "{M}", "--dir", "{DIR}"], "--file"),
        (["forecast", "--layers", "2"], "--layers"),
        (["forecast", "--layers", "2", "--top-k", "2", "--expert-bytes", "100"], "probe"),
        (["synth", "--shape", "nope", "-o", "{OUT}"], "shape"),
        (["run", "-m", "{M}"], "--prompt"),
        (["run", "-m", "{M}", "-p", "hi", "--bogus"], "--bogus"),
        (["run", "-m", "{M}", "-p", "caf\udce9"], "not valid UTF-8"),
        (["chat", "-m", "{M}", "--system", "\udcc3("], "not valid UTF-8"),
        (["demo", "--prompt", "\udcff"], "not valid UTF-8"),
        (["nothing"], "command"),
        ([], "command"),
    ]
)


def _cases() -> list[tuple[list[str], str]]:
    out = []
    for base, options in COMMANDS.values():
        for option, kind in options.items():
            for value in BAD[kind]:
                argv = list(base)
                if option in argv:  # replace the base's own value
                    argv[argv.index(option) + 1] = value
                else:
                    argv += [option, value]
                out.append((argv, option))
    return out + CHECKED_IN_COMMAND


CASES = _cases()


def _fill(argv: list[str], files: dict[str, str]) -> list[str]:
    return [a.format(**files) for a in argv]


def _check_line(rc: int, err: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert needle in lines[0], err


@pytest.fixture
def nothing_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a model, starting an engine, writing a model or probing a disk fails the test."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad option value got as far as loading or writing something")

    monkeypatch.setattr(GGUFFile, "__init__", forbidden)
    monkeypatch.setattr(Engine, "__init__", forbidden)
    monkeypatch.setattr(run_module, "write_synth", forbidden)
    monkeypatch.setattr(probe_module, "probe_file", forbidden)
    monkeypatch.setattr(probe_module, "probe_dir", forbidden)


def test_case_count() -> None:
    assert len(CASES) > 300
    assert {argv[0] for argv, _ in CASES if argv} == set(COMMANDS) | {"nothing"}


def test_bad_values_in_process(files, nothing_loads, capsys) -> None:
    failures = []
    for argv, needle in CASES:
        argv = _fill(argv, files)
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse's own exit
            rc = exc.code
        except Exception as exc:  # a traceback in the real command
            failures.append(f"{argv}: raised {type(exc).__name__}: {exc}")
            continue
        err = capsys.readouterr().err
        try:
            _check_line(rc, err, needle)
        except AssertionError as exc:
            failures.append(f"{argv}: rc={rc} {exc}")
    assert not failures, f"{len(failures)} of {len(CASES)} cases:\n" + "\n".join(failures[:20])


# a sample of the same cases as real processes, plus what only a process can show (argv bytes)
PROCESS_CASES = [
    (["run", "-m", "{M}", "-p", "hi", "--temp", "nan"], "--temp"),
    (["run", "-m", "{M}", "-p", "hi", "--stats-json", "{NODIR}"], "--stats-json"),
    (["synth", "--shape", "tiny", "-o", "{DIR}"], "--output"),
    (["serve", "-m", "{M}", "--top-p", "2"], "--top-p"),
    (["stats", "{T}", "--window", "0"], "--window"),
]


@pytest.mark.slow
def test_bad_values_as_processes(files) -> None:
    cli = [os.fsencode(sys.executable), b"-m", b"moestream"]
    runs = [([os.fsencode(a) for a in _fill(argv, files)], needle) for argv, needle in PROCESS_CASES]
    # a prompt that is not UTF-8 reaches Python as surrogate escapes
    runs.append(([b"run", b"-m", os.fsencode(files["M"]), b"-p", b"caf\xe9 \xff"], "not valid UTF-8"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        (subprocess.Popen(cli + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env), argv, needle)
        for argv, needle in runs
    ]
    failures = []
    for proc, argv, needle in procs:
        out, err = proc.communicate(timeout=120)
        text = err.decode("utf-8", "replace")
        try:
            _check_line(proc.returncode, text, needle)
            assert not out, out
        except AssertionError as exc:
            failures.append(f"{argv}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("temp", ["1e-45", "5e-324", "1e-300"])
def test_tiny_temperature_is_the_greedy_limit(files, capsys, temp: str) -> None:
    base = ["run", "-m", files["M"], "-p", "hello", "-n", "6", "--ignore-eos", "--ram-budget-mb", "2000"]
    assert main([*base, "--temp", "0"]) == 0
    greedy = capsys.readouterr().out
    assert main([*base, "--temp", temp, "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy


def test_stats_json_unwritable_after_generation(files, tmp_path, capsys) -> None:
    """A directory that disappears during the run: the error names the option, no traceback."""
    d = tmp_path / "gone"
    d.mkdir()
    path = str(d / "stats.json")
    argv = ["run", "-m", files["M"], "-p", "hi", "-n", "2", "--ram-budget-mb", "2000", "--stats-json", path]
    real_init = Engine.__init__

    def init_then_remove(self, *args, **kwargs):  # the directory goes away while the model loads
        real_init(self, *args, **kwargs)
        d.rmdir()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "__init__", init_then_remove)
        rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: cannot write --stats-json")
