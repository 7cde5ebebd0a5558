"""The first hour of a new user (issue 45): what the commands say when an option is off, a port is taken, a
file is missing, and what they print along the way. Each case runs the real command on a tiny model."""

from __future__ import annotations

import argparse
import os
import re
import select
import socket
import subprocess
import sys
import termios
from pathlib import Path

import pytest

import moestream
from moestream.analysis import probe
from moestream.cli.main import build_parser, main
from moestream.compute import native
from moestream.serving.app import DEFAULT_MAX_TOKENS
from moestream.serving.chat import quiet_keys
from moestream.streaming.budget import total_ram


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("first_hour") / "tiny.gguf")
    assert main(["synth", "--shape", "tiny", "--layers", "2", "-o", path]) == 0
    return path


def test_serve_on_a_taken_port_fails_before_loading(model, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        rc = main(["serve", "-m", model, "--port", str(port), "--ram-budget-mb", "2000"])
    out, err = capsys.readouterr()
    assert rc == 2
    assert "serving" not in out and "budget" not in out  # nothing was loaded
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"port {port} is already in use" in lines[0] and "--port" in lines[0]


def test_run_says_sizes_in_binary_units_named_as_such(model, capsys):
    assert main(["run", "-m", model, "-p", "hello", "-n", "3", "--ram-budget-mb", "2000"]) == 0
    err = capsys.readouterr().err
    assert "MiB/tok" in err and re.search(r"peak RSS \d+ MiB", err) and re.search(r"budget \d+ MiB", err)
    assert not re.search(r"\d ?(MB|GB|kB)\b", err), err


def test_compiling_the_kernels_says_so_once(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text("int ms_abi_version(void) { return 0; }\n")
    flags = ("-O1", "-shared", "-fPIC")
    native.build_library(flags, tmp_path / "out", source_dir=src)
    assert "compiling the native kernels" in capsys.readouterr().err
    native.build_library(flags, tmp_path / "out", source_dir=src)  # the cached build: nothing to say
    assert capsys.readouterr().err == ""


def test_probe_names_this_machines_ram_not_twice_it(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(8 << 20))
    r = probe.probe_file(str(path), inflight=(1,), reads_per_row=2, seconds_per_row=0.2, progress=False)
    (warning,) = [w for w in r.warnings if "not representative" in w]
    with open("/proc/meminfo") as f:
        mem_total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    ram, kind = total_ram()
    assert ram <= mem_total and kind in ("total physical RAM", "cgroup memory limit")
    assert f"RAM ({ram / 2**30:.1f} GiB, {kind})" in warning


def _moestream(*argv: str, stdin: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moestream", *argv]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv", [["-p", ""], ["-p", "  \n"], ["-p", "-"], ["-f", "{EMPTY}"]])
def test_an_empty_prompt_fails_before_loading(model, tmp_path, argv):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = [a.replace("{EMPTY}", str(empty)) for a in argv]
    r = _moestream("run", "-m", model, *argv, stdin="")
    assert r.returncode == 2 and r.stderr.splitlines() == [r.stderr.strip()]
    assert "the prompt is empty" in r.stderr and "mlock" not in r.stderr  # the model was never loaded


@pytest.mark.slow
def test_the_prompt_from_stdin_or_a_file_is_the_same_as_from_p(model, tmp_path):
    text = "hello there"
    (tmp_path / "prompt.txt").write_text(text)
    base = ["run", "-m", model, "-n", "4", "--ram-budget-mb", "2000", "--seed", "1"]
    outs = [
        _moestream(*base, "-p", text).stdout,
        _moestream(*base, "-p", "-", stdin=text).stdout,
        _moestream(*base, "--prompt-file", str(tmp_path / "prompt.txt")).stdout,
    ]
    assert outs[0] and outs == [outs[0]] * 3


@pytest.mark.parametrize("content", [None, b"caf\xe9"])
def test_an_unreadable_prompt_file_is_one_line(model, tmp_path, content, capsys):
    path = tmp_path / "p.txt"
    if content is None:
        path.write_text("hi")
        path.chmod(0)
        if os.access(path, os.R_OK):
            pytest.skip("running as root: every file is readable")
    else:
        path.write_bytes(content)
    assert main(["run", "-m", model, "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "mlock" not in err


def test_a_context_over_the_models_is_capped_and_said(model, capsys):
    assert main(["run", "-m", model, "-p", "hi", "-n", "2", "--ctx", "100000000", "--ram-budget-mb", "2000"]) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "--ctx" in x]
    assert re.fullmatch(r"note: --ctx 100000000 is more than the model's context; capped at \d+", line)


def test_a_budget_over_this_machines_ram_is_warned(model, capsys):
    ram_mb = total_ram()[0] >> 20
    # the model is tiny: a budget beyond RAM only sizes the cache to the model
    assert main(["run", "-m", model, "-p", "hi", "-n", "2", "--ram-budget-mb", str(2 * ram_mb)]) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("warning: --ram-budget-mb")]
    assert f"more than this machine's RAM ({ram_mb} MiB" in line


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"moestream {moestream.__version__}"
    assert _moestream("--version").stdout.strip() == f"moestream {moestream.__version__}"


def test_every_option_of_every_command_has_help():
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [
        f"{name} {'/'.join(action.option_strings) or action.dest}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if not action.help
    ]
    assert not missing, missing


@pytest.mark.parametrize("command", ["run", "serve", "chat", "demo", "synth", "probe"])
def test_an_unknown_option_points_at_the_commands_help(model, command, capsys):
    argv = {"run": ["-m", model, "-p", "hi"], "serve": ["-m", model], "chat": ["-m", model]}.get(command, [])
    argv += {"synth": ["--shape", "tiny", "-o", os.devnull], "probe": ["--file", model]}.get(command, [])
    assert main([command, *argv, "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: unrecognized arguments: --bogus (see moestream {command} --help)\n"


def test_keys_typed_during_an_answer_are_not_echoed_nor_kept():
    master, slave = os.openpty()
    try:
        with quiet_keys(slave):
            assert not termios.tcgetattr(slave)[3] & termios.ECHO
            os.write(master, b"typed during the answer\n")
            assert not select.select([master], [], [], 0.3)[0], "the terminal echoed the keys"
        assert termios.tcgetattr(slave)[3] & termios.ECHO
        os.set_blocking(slave, False)
        with pytest.raises(BlockingIOError):  # dropped, not left to become the next question
            os.read(slave, 100)
        with pytest.raises(KeyboardInterrupt), quiet_keys(slave):
            raise KeyboardInterrupt
        assert termios.tcgetattr(slave)[3] & termios.ECHO  # restored however the answer ends
    finally:
        os.close(master)
        os.close(slave)


@pytest.mark.slow
def test_chat_answers_have_a_default_limit(model):
    args = build_parser("chat").parse_args(["chat", "-m", model])
    assert args.n == DEFAULT_MAX_TOKENS
    assert f"default {DEFAULT_MAX_TOKENS}" in " ".join(_moestream("chat", "--help").stdout.split())


@pytest.mark.slow
def test_moestream_home_holds_the_demo_model_as_the_readme_says(tmp_path):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "**`MOESTREAM_HOME`**" in readme and "`$MOESTREAM_HOME/models`" in readme
    env = {**os.environ, "MOESTREAM_HOME": str(tmp_path), "MOESTREAM_NATIVE_LIB": native.lib()._name}
    cmd = [sys.executable, "-m", "moestream", "demo", "--shape", "tiny", "--layers", "1", "--tokens", "2"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-Q4_0-L1.gguf"]
