"""The remote expert tier on a real local Ray instance (127.0.0.1): experts held and computed by 2 and 3 Ray
actors give the single process's tokens bit for bit, under a local budget that also streams; a worker killed
mid-generation leaves the tokens unchanged (its experts come from the disk); bad addresses, counts and a
missing Ray are one line and exit code 2."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.synth.shapes import write_synth

PROMPT = list(range(5, 45))
N = 10
LOCAL_SLOTS = 12  # of the tiny model's 64 experts: the local cache streams


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("ray_experts")
    out = {q: write_synth("tiny", q, str(d / f"tiny-{q}.gguf"), progress=False) for q in ("Q4_0", "F32")}
    out["gpt-oss"] = write_synth("tiny-gpt-oss", "Q4_0", str(d / "tiny-gpt-oss.gguf"), progress=False)
    return out


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    # the raylet's memory monitor kills workers when the machine (shared with other jobs) is nearly full; the
    # workers here hold a few MB
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray.init(address="local", num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _single(path: str) -> tuple[list[int], torch.Tensor]:
    eng = Engine(path, EngineOptions(n_slots=LOCAL_SLOTS))
    try:
        logits = eng.forward(PROMPT, 0, all_logits=True)
        eng.reset()
        return eng.generate(PROMPT, N, Sampler()).tokens, logits
    finally:
        eng.close()


def _remote(path: str, workers: int, worker_mb: int | None) -> Engine:
    return Engine(path, EngineOptions(n_slots=LOCAL_SLOTS, ray_address="local", expert_workers=workers,
                                      expert_worker_mb=worker_mb))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("quant,workers,worker_mb", [("Q4_0", 2, 2), ("Q4_0", 3, 1), ("F32", 2, 1)])
def test_remote_experts_give_the_single_process_output(ray_local, models, quant, workers, worker_mb):
    tokens, logits = _single(models[quant])
    eng = _remote(models[quant], workers, worker_mb)
    try:
        held = len(eng.remote.owner)
        assert 0 < held < eng.cfg.n_layers * eng.cfg.n_experts  # some experts remote, the others streamed
        assert torch.equal(eng.forward(PROMPT, 0, all_logits=True), logits)  # the prompt path, every position
        eng.reset()
        misses = eng.cache.stats.misses
        assert eng.generate(PROMPT, N, Sampler()).tokens == tokens  # and the one-token decode path
        assert eng.remote.remote_calls > 0 and eng.cache.stats.misses > misses
        assert eng.remote.lost_experts == 0
    finally:
        eng.close()


@pytest.mark.slow
def test_a_worker_killed_mid_generation_falls_back_to_the_disk(ray_local, models):
    tokens, _ = _single(models["Q4_0"])
    eng = _remote(models["Q4_0"], 2, None)  # every expert remote: the lost worker's must come from the disk
    try:
        got = []
        for i, step in enumerate(eng.stream(PROMPT, N, Sampler())):
            got.append(step.token)
            if i == 2:
                ray_local.kill(eng.remote.actors[0], no_restart=True)
        assert got == tokens
        assert eng.remote.lost_experts > 0 and eng.remote.alive == [False, True]
    finally:
        eng.close()


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--ray", "127.0.0.1:1", "--expert-workers", "2"], "no Ray cluster answers at 127.0.0.1:1"),
        (["--ray", "ray://h:1", "--expert-workers", "2"], "is not a Ray address"),
        (["--ray", "127.0.0.1:70000", "--expert-workers", "2"], "the port must be"),
        (["--ray", "local"], "--ray and --expert-workers go together"),
        (["--expert-workers", "0", "--ray", "local"], "--expert-workers"),
        (["--expert-workers", "257", "--ray", "local"], "at most 256"),
    ],
)
def test_bad_ray_options_are_one_line(models, capsys, extra, needle):
    assert main(["run", "-m", models["Q4_0"], "-p", "hi", "-n", "1", *extra]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_experts_with_their_own_activation_are_refused(models, capsys):
    argv = ["run", "-m", models["gpt-oss"], "-p", "hi", "-n", "1", "--ray", "local", "--expert-workers", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not take experts with their own activation" in err and "Traceback" not in err, err


def test_without_ray_installed_the_option_says_how_to_get_it(models, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # an environment without Ray: `import ray` fails
    assert main(["run", "-m", models["Q4_0"], "-p", "hi", "-n", "1", "--ray", "local", "--expert-workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "Ray is not installed" in err and "Traceback" not in err, err


def _batch_logits(eng: Engine) -> list[torch.Tensor]:
    """Two sequences' prompts in one step, then their next tokens in one decode step (serve's batches)."""
    a, b = PROMPT, list(range(300, 317))
    kvs = [eng.kv, eng.batch_kvs[0]]
    first = eng.step([a, b], kvs, [0, 0], prompt=True)
    nxt = [[int(t)] for t in first.argmax(-1)]
    return [first, eng.step(nxt, kvs, [len(a), len(b)], prompt=False)]


@pytest.mark.slow
def test_remote_experts_in_a_batch_of_sequences(ray_local, models):
    single = Engine(models["Q4_0"], EngineOptions(n_slots=LOCAL_SLOTS, max_batch=2))
    try:
        want = _batch_logits(single)
    finally:
        single.close()
    eng = Engine(models["Q4_0"], EngineOptions(n_slots=LOCAL_SLOTS, max_batch=2, ray_address="local",
                                               expert_workers=2, expert_worker_mb=2))  # fmt: skip
    try:
        got = _batch_logits(eng)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        eng.close()


@pytest.mark.slow
def test_a_worker_that_stops_answering_is_dropped_after_the_timeout(ray_local, models):
    tokens, _ = _single(models["Q4_0"])
    eng = Engine(models["Q4_0"], EngineOptions(n_slots=LOCAL_SLOTS, ray_address="local", expert_workers=2,
                                               expert_timeout_s=3.0))  # fmt: skip
    try:
        pid = ray_local.get(eng.remote.actors[1].pid.remote())
        os.kill(pid, signal.SIGSTOP)  # alive but silent: a hung machine, not a dead one
        try:
            assert eng.generate(PROMPT, N, Sampler()).tokens == tokens
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # the tier killed it
        assert eng.remote.alive == [True, False]
    finally:
        eng.close()
