"""`moestream demo` end to end on the tiny shape, and `synth` from the command line."""

from __future__ import annotations

import os
import re

from moestream.cli.main import main


def test_demo_runs_end_to_end_on_tiny(tmp_path, capsys):
    rc = main(["demo", "--shape", "tiny", "--layers", "2", "--tokens", "6", "--data-dir", str(tmp_path)])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "What happened" in err and "expert hit rate" in err
    # the text the closing paragraph talks about is printed, and said to come from random weights
    assert out.strip() and "random weights, so it is not meaningful text" in err
    # the bar names the prompt phase before it counts decoded tokens
    assert "prompt (" in err and "decoding" in err
    assert not re.search(r"\d (MB|GB|kB)\b", err), "sizes are in MiB/GiB, named as such"
    models = os.listdir(tmp_path)
    assert models == ["tiny-Q4_0-L2.gguf"]
    # the second run reuses the model instead of writing it again
    rc = main(["demo", "--shape", "tiny", "--layers", "2", "--tokens", "3", "--data-dir", str(tmp_path)])
    assert rc == 0
    assert "writing a synthetic" not in capsys.readouterr().err


def test_synth_command_writes_a_loadable_model(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["synth", "--shape", "tiny", "--quant", "Q4_K", "--layers", "1", "-o", str(out)]) == 0
    assert main(["run", "-m", str(out), "-p", "hello", "-n", "3"]) == 0
    assert "decode 3 tok" in capsys.readouterr().err


def test_synth_refuses_unknown_shape(tmp_path, capsys):
    assert main(["synth", "--shape", "nope", "-o", str(tmp_path / "x.gguf")]) == 2
    assert "unknown shape" in capsys.readouterr().err


def test_demo_bar_rate_is_the_decode_rate(tmp_path, capsys):
    """The bar counts decoded tokens from the prompt's end, as the stats line does: a long prompt, whose time
    would drag the bar's rate down if it counted, leaves the two rates alike."""
    prompt = " ".join(["streaming experts from disk"] * 60)
    argv = ["demo", "--shape", "tiny", "--layers", "2", "--tokens", "24", "--prompt", prompt]
    assert main([*argv, "--data-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    bar = float(re.findall(r"decoding: 100%.*? ([\d.]+)tok/s", err)[-1])
    stats = float(re.search(r"decode 24 tok @ ([\d.]+) tok/s", err).group(1))
    assert abs(bar - stats) < 0.2 * stats, (bar, stats)
