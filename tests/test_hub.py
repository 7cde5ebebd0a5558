"""Models from the Hugging Face Hub (`moestream pull`, `-m hf:REPO[:QUANT]`, `moestream list`): the real
huggingface_hub client, in a moestream process of its own, against a real HTTP server on 127.0.0.1 that
answers as the Hub does (tests/hub_server.py). No network: HF_ENDPOINT points at that server."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from moestream.formats.gguf_model import GGUFModel
from moestream.synth.shapes import write_synth, write_synth_parts
from tests.hub_server import FakeHub, Repo

pytestmark = pytest.mark.slow  # a local Hub server and real downloads: .ci/run

BIG = 12 << 20  # over the client's 10 MiB read chunk, so that a cut transfer has something to resume from


def _read(path) -> bytes:
    return Path(path).read_bytes()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    tiny = _read(write_synth("tiny", "Q4_0", d / "tiny.gguf", layers=1, progress=False))
    parts = write_synth_parts("tiny", "Q4_0", d / "split.gguf", layers=1, progress=False, split_max_size=400_000)
    split = {f"Q4_K_M/Split-Q4_K_M-{i + 1:05d}-of-{len(parts):05d}.gguf": _read(p) for i, p in enumerate(parts)}
    hub = FakeHub()
    hub.repos["org/Tiny-GGUF"] = Repo({"tiny-Q4_0.gguf": tiny, "README.md": b"# tiny\n", "mmproj-F16.gguf": b"x"})
    hub.repos["org/Split-GGUF"] = Repo({**split, "Split-Q8_0.gguf": tiny, "Split-Q2_K.gguf": tiny})
    hub.repos["org/Big-GGUF"] = Repo({"big-Q4_K_M.gguf": random.Random(0).randbytes(BIG)})
    hub.repos["org/Text"] = Repo({"model.safetensors": b"{}", "README.md": b"# text\n"})
    hub.repos["org/Gated-GGUF"] = Repo({"tiny-Q4_0.gguf": tiny}, gated=True)
    hub.repos["org/Private-GGUF"] = Repo({"tiny-Q4_0.gguf": tiny}, token="hf_secret")
    yield hub
    hub.close()


def moestream(hub: FakeHub, home: Path, *args: str, endpoint: str | None = None, **env: str):
    """`moestream ARGS` in a process of its own (the client reads its settings from the environment once)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    e.update(HF_ENDPOINT=endpoint or hub.url, HF_HOME=str(home), NO_PROXY="127.0.0.1", HF_HUB_DISABLE_TELEMETRY="1")
    e.update(env)
    return subprocess.run([sys.executable, "-m", "moestream", *args], env=e, capture_output=True, text=True)


def _one_line_error(r) -> str:
    """The error of a failed command: exit 2, and one `error:` line, no traceback."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


def test_run_a_hub_model_by_quant_then_list_it(hub, tmp_path):
    r = moestream(
        hub, tmp_path, "run", "-m", "hf:org/Tiny-GGUF:q4_0", "-p", "hello", "-n", "2", "--ram-budget-mb", "2000"
    )
    assert r.returncode == 0, r.stderr
    assert "decode" in r.stdout + r.stderr
    cached = list((tmp_path / "hub" / "models--org--Tiny-GGUF" / "snapshots").glob("*/tiny-Q4_0.gguf"))
    assert len(cached) == 1 and _read(cached[0]) == hub.repos["org/Tiny-GGUF"].files["tiny-Q4_0.gguf"]
    assert not list(tmp_path.rglob("mmproj*")), "only the model's file is fetched"
    r = moestream(hub, tmp_path, "list")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if "org/Tiny-GGUF" in line)
    assert row.split()[0] == "hf:org/Tiny-GGUF:Q4_0" and "tiny-Q4_0.gguf" in row and "MiB" in row


def test_a_split_model_in_a_quant_folder_comes_whole(hub, tmp_path):
    r = moestream(hub, tmp_path, "pull", "org/Split-GGUF")  # no quant: Q4_K_M first, as llama.cpp
    assert r.returncode == 0, r.stderr
    names = sorted(p for p in hub.repos["org/Split-GGUF"].files if p.startswith("Q4_K_M/"))
    assert len(names) > 2
    first = Path(r.stdout.splitlines()[0].split(" (")[0])
    assert first.name == Path(names[0]).name and first.parent.name == "Q4_K_M"
    model = GGUFModel(first)
    try:
        assert [Path(p).name for p in model.paths] == [Path(n).name for n in names]
    finally:
        model.close()
    assert not hub.gets("Split-Q8_0.gguf") and not hub.gets("Split-Q2_K.gguf")
    r = moestream(hub, tmp_path, "list")
    assert f"(+{len(names) - 1} parts)" in r.stdout and "hf:org/Split-GGUF:Q4_K_M" in r.stdout


def test_a_cut_connection_resumes_with_a_range_request(hub, tmp_path):
    hub.cut["big-Q4_K_M.gguf"] = BIG - 1000
    r = moestream(hub, tmp_path, "pull", "org/Big-GGUF:Q4_K_M")
    assert r.returncode == 0, r.stderr
    assert hub.gets("big-Q4_K_M.gguf") == [None, f"bytes={10 << 20}-"]
    assert _read(r.stdout.split()[0]) == hub.repos["org/Big-GGUF"].files["big-Q4_K_M.gguf"]


def test_a_truncated_cached_file_is_fetched_again(hub, tmp_path):
    path = moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0").stdout.split()[0]
    with open(os.path.realpath(path), "r+b") as f:
        f.truncate(1000)
    r = moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0")
    assert r.returncode == 0, r.stderr
    assert "not the size the Hub reports" in r.stderr
    assert _read(path) == hub.repos["org/Tiny-GGUF"].files["tiny-Q4_0.gguf"]


def test_a_download_with_the_wrong_bytes_is_refused(hub, tmp_path):
    hub.corrupt.add("tiny-Q4_0.gguf")
    try:
        line = _one_line_error(moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0"))
    finally:
        hub.corrupt.clear()
    assert "sha256" in line
    assert not list((tmp_path / "hub").rglob("tiny-Q4_0.gguf")), "the bad file is not left in the cache"


def test_offline_uses_the_cache_and_says_when_it_cannot(hub, tmp_path):
    line = _one_line_error(moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0", HF_HUB_OFFLINE="1"))
    assert "not in the Hub cache" in line and "HF_HUB_OFFLINE=1" in line and "moestream pull" in line
    assert moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0").returncode == 0
    asked = len(hub.log)
    r = moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0", HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr
    assert len(hub.log) == asked, "offline asks the server nothing"
    line = _one_line_error(moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q8_0", HF_HUB_OFFLINE="1"))
    assert "no Q8_0" in line and "Q4_0" in line


def test_an_unreachable_hub_falls_back_to_the_cache(hub, tmp_path):
    down = "http://127.0.0.1:9"  # the discard port: nothing listens
    line = _one_line_error(moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0", endpoint=down))
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line
    assert moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0").returncode == 0
    r = moestream(hub, tmp_path, "pull", "org/Tiny-GGUF:Q4_0", endpoint=down)
    assert r.returncode == 0 and "using the cached" in r.stderr, r.stderr


@pytest.mark.parametrize(
    "spec, says",
    [
        ("org/Tiny-GGUF:Q5_K_M", ["no Q5_K_M GGUF", "it has: Q4_0"]),
        ("org/Nothing-GGUF", ["no such model repository", "HF_TOKEN"]),
        ("org/Text", ["holds no GGUF"]),
        ("org/Gated-GGUF", ["gated", "HF_TOKEN"]),
        ("org/Private-GGUF", ["no such model repository", "private one needs HF_TOKEN"]),
    ],
)
def test_hub_errors_are_one_line(hub, tmp_path, spec, says):
    line = _one_line_error(moestream(hub, tmp_path, "pull", spec))
    assert all(s in line for s in says), line


def test_a_private_repo_with_its_token(hub, tmp_path):
    assert moestream(hub, tmp_path, "pull", "org/Private-GGUF", HF_TOKEN="hf_secret").returncode == 0


def test_a_wrong_quant_on_run_is_one_line_before_anything_loads(hub, tmp_path):
    line = _one_line_error(moestream(hub, tmp_path, "probe", "--file", "hf:org/Split-GGUF:IQ4_XS"))
    assert "no IQ4_XS" in line and "Q2_K, Q4_K_M, Q8_0" in line


def test_quant_names_pick_files_as_llama_cpp_does():
    from moestream.hub import quant

    files = [
        "Q4_K_M/M-Q4_K_M-00002-of-00002.gguf",
        "Q4_K_M/M-Q4_K_M-00001-of-00002.gguf",
        "M-IQ4_XS.gguf",
        "M-Q8_0.gguf",
        "M-Q4_K_S.gguf",
        "mmproj-M-F16.gguf",
        "README.md",
    ]
    assert quant.find_model(files, None) == "Q4_K_M/M-Q4_K_M-00001-of-00002.gguf"
    assert quant.model_files(files, "Q4_K_M/M-Q4_K_M-00001-of-00002.gguf") == sorted(files[:2])
    assert quant.find_model(files, "q8_0") == "M-Q8_0.gguf"
    assert quant.find_model(files, "Q4_K") is None  # Q4_K_M and Q4_K_S are other quants
    assert quant.find_model(files, "Q4_XS") is None  # not IQ4_XS
    assert quant.find_model(files, "F16") is None  # the projector is not a model
    assert quant.find_model(files[2:], None) == "M-Q8_0.gguf"  # Q4_K_M, then Q8_0
    assert quant.find_model(["b-Q2_K.gguf", "a-Q3_K.gguf"], None) == "a-Q3_K.gguf"  # then the first
    assert quant.quants(files) == ["IQ4_XS", "Q4_K_M", "Q4_K_S", "Q8_0"]
