"""`moestream serve-ray` on a real local Ray cluster (head plus two worker nodes, each with its own CPU and
memory resources, all on this machine), driven with the official `openai` client: two replicas answer 8
concurrent clients with the greedy answers of a single `serve`; a conversation's second turn goes to the replica
holding its prefix; a replica killed mid-answer fails its requests with a retryable error and is replaced while
the next requests succeed; bad options are one line and exit code 2."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest

from moestream.cli.main import main
from moestream.distributed.prefix_router import prefix_keys
from moestream.distributed.replica_metrics import combined_text
from moestream.distributed.serve_app import REPLICA_HEADER
from moestream.synth.shapes import write_synth
from tests.test_server import CTX, MODEL, _free_port, _get, serve_process

NODE_MEMORY = 2 << 30  # each worker node's memory resource: one replica's 1500 MiB budget fits, two do not
BUDGET_MB = "1500"
WORDS = "cache disk route layer slot gate top load".split()
PROMPTS = [f"Client {i} asks about the {w} of experts" for i, w in enumerate(WORDS)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", progress=False)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    pytest.importorskip("ray.serve")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # a shared machine: no worker killed for its RAM
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "object_store_memory": 100 << 20})  # fmt: skip
    for _ in range(2):
        c.add_node(num_cpus=1, memory=NODE_MEMORY, object_store_memory=100 << 20)
    yield c
    c.shutdown()


@contextmanager
def serve_ray(cluster: Any, log_dir: Any, *args: str, replicas: int = 2) -> Iterator[str]:
    """`moestream serve-ray` on the cluster in a child process until the block ends; yields its URL."""
    port = _free_port()
    log = open(log_dir / "serve-ray.log", "w+")  # closed below
    cmd = [sys.executable, "-m", "moestream", "serve-ray", "--address", cluster.address, "--port", str(port),
           "--ctx", str(CTX), "--model-name", MODEL, "--log-level", "warning", *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not _replicas_up(url, replicas):
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"serve-ray exited with {proc.returncode}:\n{log.read()}")
            if time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"serve-ray did not come up in time:\n{log.read()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _replicas_up(url: str, n: int) -> bool:
    try:
        status, _, body = _get(url, "/health")
    except OSError:
        return False
    return status == 200 and json.loads(body)["replicas"] >= n


@pytest.fixture(scope="module")
def endpoint(cluster: Any, model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_ray(cluster, tmp_path_factory.mktemp("serve-ray"), "-m", model_path, "--replicas", "2",
                   "--ram-budget-mb", BUDGET_MB, "--prompt-cache-mb", "16") as url:  # fmt: skip
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int = 24) -> tuple[str, str, Any]:
    """(answer, the replica that gave it, usage)"""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    r = raw.parse()
    return r.choices[0].message.content, raw.headers.get(REPLICA_HEADER, ""), r.usage


def _stream(client: openai.OpenAI, prompt: str) -> tuple[str, str]:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                      stream=True)  # fmt: skip
    return "".join(c.choices[0].text for c in raw.parse() if c.choices), raw.headers.get(REPLICA_HEADER, "")


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in _get(url, "/metrics")[2].decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.slow
def test_two_replicas_answer_eight_clients_as_one_serve(endpoint, model_path, tmp_path_factory):
    with serve_process(model_path, tmp_path_factory.mktemp("one"), "--ram-budget-mb", BUDGET_MB, "--threads",
                       "1") as url:  # fmt: skip
        one = _client(url)
        want_chat = [_chat(one, [{"role": "user", "content": p}])[0] for p in PROMPTS]
        want_text = [_stream(one, p)[0] for p in PROMPTS]
    client = _client(endpoint)
    got: dict[int, tuple[str, str, str, str]] = {}
    go = threading.Barrier(len(PROMPTS))

    def run(i: int) -> None:
        go.wait()
        chat, rep_chat, _ = _chat(client, [{"role": "user", "content": PROMPTS[i]}])
        text, rep_text = _stream(client, PROMPTS[i])
        got[i] = (chat, text, rep_chat, rep_text)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [got[i][0] for i in range(len(PROMPTS))] == want_chat
    assert [got[i][1] for i in range(len(PROMPTS))] == want_text
    replicas = {r for v in got.values() for r in v[2:]}
    assert len(replicas) == 2  # both replicas answered
    time.sleep(2)  # the replicas report their metrics every second
    m = _metrics(endpoint)
    per = {r: m[f'moestream_requests_total{{replica="{r}"}}'] for r in replicas}
    assert m["moestream_replicas"] == 2 and m["moestream_requests_total"] == sum(per.values()) >= 2 * len(PROMPTS)
    assert all(v > 0 for v in per.values())


@pytest.mark.slow
def test_a_conversations_next_turn_goes_to_the_replica_holding_its_prefix(endpoint):
    client = _client(endpoint)
    firsts = [[{"role": "user", "content": f"Conversation {i}: tell me about expert {i}"}] for i in range(4)]
    answers: dict[int, tuple[str, str, Any]] = {}

    def turn(i: int, messages: list[dict]) -> None:
        answers[i] = _chat(client, messages)

    for batch in (firsts, None):
        if batch is None:  # the second turns, which repeat the first turn and its answer
            batch = [[*firsts[i], {"role": "assistant", "content": answers[i][0]},
                      {"role": "user", "content": "and then?"}] for i in range(4)]  # fmt: skip
            first_replicas = {i: answers[i][1] for i in range(4)}
        threads = [threading.Thread(target=turn, args=(i, m)) for i, m in enumerate(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert len(set(first_replicas.values())) == 2  # the new conversations were spread over both replicas
    for i in range(4):
        _, replica, usage = answers[i]
        assert replica == first_replicas[i]
        assert usage.prompt_tokens_details.cached_tokens > 0, usage


@pytest.mark.slow
def test_a_replica_killed_mid_answer_fails_its_requests_retryably_and_is_replaced(endpoint, cluster):
    import ray

    client = _client(endpoint)
    conv = [{"role": "user", "content": "A long answer, please"}]
    _, victim, _ = _chat(client, conv, max_tokens=4)  # the conversation now lives on `victim`
    nxt = [*conv, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go on at length."}]
    errors: dict[str, Any] = {}
    streamed: list[str] = []

    def whole() -> None:
        try:
            _chat(client, nxt, max_tokens=CTX // 2)
        except openai.APIStatusError as exc:
            errors["whole"] = exc

    def stream() -> None:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=nxt, max_tokens=CTX // 2,
                                                               temperature=0, stream=True)  # fmt: skip
        errors["stream_replica"] = raw.headers.get(REPLICA_HEADER, "")
        try:
            for chunk in raw.parse():
                streamed.extend(c.delta.content or "" for c in chunk.choices)
        except openai.APIError as exc:
            errors["stream"] = exc

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(streamed) < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert errors["stream_replica"] == victim and len(streamed) >= 10
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        ray.kill(ray.get_actor(f"SERVE_REPLICA::moestream#EngineReplica#{victim}", namespace="serve"))
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)  # never a hang
        whole_err, stream_err = errors["whole"], errors["stream"]
        assert whole_err.status_code == 503 and whole_err.response.headers["retry-after"] == "1"
        assert whole_err.body["code"] == "replica_lost" and "retry" in whole_err.body["message"]
        assert "was lost" in stream_err.message and "retry" in stream_err.message
        # the next requests succeed at once, on the live replica, and Ray Serve replaces the dead one
        for i in range(3):
            _, replica, _ = _chat(client, [{"role": "user", "content": f"after {i}"}], max_tokens=4)
            assert replica != victim
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not _replaced(ray, victim):
            time.sleep(1)
        assert _replaced(ray, victim)
    finally:
        ray.shutdown()


def _replaced(ray: Any, victim: str) -> bool:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    engines = [n for n in names if n.startswith("SERVE_REPLICA::moestream#EngineReplica#")]
    return len(engines) == 2 and not any(n.endswith(victim) for n in engines)


@pytest.mark.slow
def test_replicas_the_cluster_cannot_hold_are_one_line(cluster, model_path, capsys):
    # each worker node holds one 1500 MiB replica: three do not fit, nor two of 3000 MiB
    for extra in (["--replicas", "3"], ["--replicas", "2", "--ram-budget-mb", "3000"]):
        argv = ["serve-ray", "-m", model_path, "--address", cluster.address, "--ram-budget-mb", BUDGET_MB, *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and "do not fit the Ray cluster's nodes" in lines[0] and "Traceback" not in err, err


@pytest.mark.slow
def test_replicas_this_machine_cannot_hold_are_one_line(model_path, capsys):
    from moestream.streaming.budget import MB, total_ram

    ram_mb = total_ram()[0] // MB  # two replicas of this budget each cannot fit the local Ray instance
    assert main(["serve-ray", "-m", model_path, "--replicas", "2", "--ram-budget-mb", str(ram_mb)]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "do not fit this machine" in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--replicas", "0"], "--replicas: must be a positive number"),
        (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is more than --max-replicas 2"),
        (["--replicas", "4", "--max-replicas", "2"], "outside --min-replicas/--max-replicas"),
        (["--ray", "local", "--expert-workers", "2"], "serve-ray does not take --ray/--expert-workers"),
        (["--replicas", "2", "--trace", "t.csv"], "--trace writes one file"),
        (["--address", "127.0.0.1:1"], "no Ray cluster answers at 127.0.0.1:1"),
        (["--address", "ray://h:1"], "is not a Ray address"),
    ],
)
def test_bad_options_are_one_line(model_path, tmp_path, capsys, monkeypatch, extra, needle):
    monkeypatch.chdir(tmp_path)
    assert main(["serve-ray", "-m", model_path, *extra]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_prefix_keys_share_a_conversations_earlier_turns():
    first = [{"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    a, b = prefix_keys("/v1/chat/completions", {"messages": first}), prefix_keys("/v1/chat/completions",
                                                                                  {"messages": second})  # fmt: skip
    assert len(a) == 1 and len(b) == 3 and b[0] == a[0]
    # other tools make another prompt: no shared key
    assert prefix_keys("/v1/chat/completions", {"messages": first, "tools": [{"type": "function"}]})[0] != a[0]
    long = "x" * 200
    assert prefix_keys("/v1/completions", {"prompt": long})[:3] == prefix_keys("/v1/completions",
                                                                               {"prompt": long + "y"})[:3]  # fmt: skip
    assert prefix_keys("/v1/models", {}) == [] and prefix_keys("/v1/chat/completions", ["not", "a", "dict"]) == []


def test_metrics_sum_over_replicas_and_keep_each():
    def text(requests: int, hits: int, misses: int) -> str:
        return (f"# HELP moestream_requests_total r\n# TYPE moestream_requests_total counter\n"
                f"moestream_requests_total {requests}\n# HELP moestream_expert_cache_hits_total h\n"
                f"# TYPE moestream_expert_cache_hits_total counter\nmoestream_expert_cache_hits_total {hits}\n"
                f"# HELP moestream_expert_cache_misses_total m\n# TYPE moestream_expert_cache_misses_total counter\n"
                f"moestream_expert_cache_misses_total {misses}\n# HELP moestream_expert_cache_hit_rate r\n"
                f"# TYPE moestream_expert_cache_hit_rate gauge\nmoestream_expert_cache_hit_rate "
                f"{hits / (hits + misses)}\n# HELP moestream_b b\n# TYPE moestream_b histogram\n"
                f'moestream_b_bucket{{le="1"}} {requests}\nmoestream_b_sum 3\n'
                f"moestream_b_count {requests}\n")  # fmt: skip

    out = combined_text({"a": text(3, 30, 10), "b": text(5, 10, 30)})
    rows = dict(line.rsplit(" ", 1) for line in out.splitlines() if not line.startswith("#"))
    assert rows["moestream_replicas"] == "2" and rows["moestream_requests_total"] == "8"
    assert rows['moestream_requests_total{replica="a"}'] == "3" and rows['moestream_requests_total{replica="b"}'] == "5"
    assert float(rows["moestream_expert_cache_hit_rate"]) == 0.5  # from the summed counters, not the mean
    assert rows['moestream_b_bucket{le="1"}'] == "8" and rows['moestream_b_bucket{le="1",replica="b"}'] == "5"
    assert out.count("# TYPE moestream_requests_total counter") == 1
