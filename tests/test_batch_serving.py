"""Several requests generating together: engine batches and `serve` with concurrent clients.

What a request generates must not depend on what else shares its steps: every answer equals the same request
sent alone, streamed or not, with a client leaving mid-stream, and under an expert budget that streams.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest

from moestream.analysis.trace import DECODE, read_trace
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import MoestreamError
from moestream.serving.text import TextStream
from moestream.serving.worker import Admission, DoneEvent, Job, TextEvent, Worker
from moestream.synth.shapes import write_synth
from tests.test_server import MODEL, _metrics, _post, serve_process

PROMPTS = [
    "Experts live on disk and",
    "The cache is full, so",
    "Hello there, how are",
    "A long time ago",
    "Reads go in file order because",
    "Every layer fetches",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", progress=False)


def _run_batch(engine: Engine, prompts: list[list[int]], max_new: int, join_at: int = 0) -> list[list[int]]:
    """Greedy tokens of each prompt generated together; prompts after the first `join_at` join two steps in."""
    batch = engine.scheduler()
    seqs = [batch.add(p, max_new) for p in prompts[: join_at or len(prompts)]]
    out: dict[int, list[int]] = {}
    steps = 0
    while len(batch) or len(seqs) < len(prompts):
        if steps == 2 and len(seqs) < len(prompts):
            seqs += [batch.add(p, max_new) for p in prompts[len(seqs) :]]
        for ev in batch.step():
            out.setdefault(id(ev.sequence), []).append(ev.token)
        steps += 1
    return [out[id(s)] for s in seqs]


@pytest.mark.parametrize("n_slots", [None, 12])  # every expert cached / a cache that must evict
def test_batch_equals_alone(model_path: str, n_slots: int | None, tmp_path: Path) -> None:
    opts = EngineOptions(n_slots=n_slots or 10_000, ctx=256, max_batch=4, trace_path=str(tmp_path / "t.jsonl"))
    engine = Engine(model_path, opts)
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS[:5]]
        alone = [engine.generate(p, 10).tokens for p in prompts]
        engine.reset()
        # five requests over four slots: the fifth waits for a slot; two join after the others started
        assert _run_batch(engine, prompts, 10, join_at=3) == alone
    finally:
        engine.close()
    # one fetch per (step, layer, expert) for the union of the rows, never one per sequence
    _meta, rows = read_trace(str(tmp_path / "t.jsonl"))
    rows = rows[rows["phase"] == DECODE]
    per_step = Counter(zip(rows["step"].tolist(), rows["layer"].tolist(), rows["expert"].tolist(), strict=True))
    assert len(rows) and max(per_step.values()) == 1


def test_prompts_arriving_together_prefill_in_one_step(model_path: str, tmp_path: Path) -> None:
    """Four requests queued at once: one step runs all four prompts (each layer's experts fetched once for
    their union) and gives every one its first token; each answer equals the request's alone."""
    opts = EngineOptions(n_slots=10_000, ctx=256, max_batch=4, trace_path=str(tmp_path / "t.jsonl"))
    engine = Engine(model_path, opts)
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(p) for p in PROMPTS[:4]]
        alone = [engine.generate(p, 8).tokens for p in prompts]
        engine.reset()
        first_step = engine.trace.step + 1
        batch = engine.scheduler()
        seqs = [batch.add(p, 8) for p in prompts]
        out: dict[int, list[int]] = {}
        events = batch.step()
        assert {id(ev.sequence) for ev in events} == {id(s) for s in seqs}
        while events:
            for ev in events:
                out.setdefault(id(ev.sequence), []).append(ev.token)
            events = batch.step()
        assert [out[id(s)] for s in seqs] == alone
    finally:
        engine.close()
    _meta, rows = read_trace(str(tmp_path / "t.jsonl"))
    rows = rows[(rows["phase"] != DECODE) & (rows["step"] >= first_step)]
    assert len(set(rows["step"].tolist())) == 1  # the four prompts' one step
    per_key = Counter(zip(rows["layer"].tolist(), rows["expert"].tolist(), strict=True))
    assert len(per_key) and max(per_key.values()) == 1


def test_a_burst_of_requests_starts_in_one_step(model_path: str, tmp_path: Path) -> None:
    """Requests that reach the server a little apart (each parsed and templated first) still start together:
    their prompts run in one step instead of the first one's alone, while a lone request is not held back."""
    engine = Engine(model_path, EngineOptions(n_slots=10_000, ctx=256, max_batch=4, trace_path=str(tmp_path / "t")))
    loop = asyncio.new_event_loop()
    worker = Worker(engine, admission=Admission(gather_s=30.0, gather_gap_s=1.0))
    worker.start()

    def job(prompt: str) -> Job:
        return Job(engine.tokenizer.encode(prompt), 4, Sampler(), TextStream(engine.tokenizer), loop)

    async def first_token_at(j: Job) -> float:
        """When the job's first text came; waits for the rest of its answer."""
        assert isinstance(await j.events.get(), TextEvent)
        at = time.monotonic()
        while not isinstance(await j.events.get(), DoneEvent):
            pass
        return at

    try:
        start = time.monotonic()
        lone = job(PROMPTS[5])
        worker.submit(lone)
        assert loop.run_until_complete(first_token_at(lone)) - start < 15.0  # a gap, not the 30 s window
        first_step = engine.trace.step + 1
        burst = [job(p) for p in PROMPTS[:4]]
        for j in burst:
            worker.submit(j)
            time.sleep(0.1)  # well under the gap

        async def all_done() -> None:
            await asyncio.gather(*(first_token_at(j) for j in burst))

        loop.run_until_complete(all_done())
    finally:
        worker.stop()
        engine.close()
        loop.close()
    _meta, rows = read_trace(str(tmp_path / "t"))
    prompt_steps = rows[(rows["phase"] != DECODE) & (rows["step"] >= first_step)]["step"]
    assert len(set(prompt_steps.tolist())) == 1


def test_slot_keeps_its_conversation(model_path: str) -> None:
    """A request that extends a finished one lands on its slot and prefills only its new tokens."""
    engine = Engine(model_path, EngineOptions(n_slots=10_000, ctx=256, max_batch=3))
    try:
        tok = engine.tokenizer
        batch = engine.scheduler()
        first = [tok.encode(p) for p in PROMPTS[:3]]
        seqs = [batch.add(p, 6) for p in first]
        answers: dict[int, list[int]] = {}
        while len(batch):
            for ev in batch.step():
                answers.setdefault(id(ev.sequence), []).append(ev.token)
        follow = first[1] + answers[id(seqs[1])][:-1] + tok.encode(" and then")
        seq = batch.add(follow, 4)
        got = []
        while len(batch):
            got += [ev.token for ev in batch.step()]
        assert seq.stats.reused_tokens == len(first[1]) + len(answers[id(seqs[1])]) - 1
        engine.reset()
        assert got == engine.generate(follow, 4).tokens
    finally:
        engine.close()


def test_batch_size_is_counted_in_the_budget(model_path: str) -> None:
    one = Engine(model_path, EngineOptions(ram_budget_mb=2000, ctx=4096, max_batch=1))
    resident_one, kv = one.plan.resident, one.kv.nbytes
    one.close()
    many = Engine(model_path, EngineOptions(ram_budget_mb=2000, ctx=4096, max_batch=8))
    try:
        assert len(many.batch_kvs) == 7
        # the seven other sequences' KV caches are allocated up front, so the plan measured them
        assert many.plan.resident - resident_one >= 7 * kv * 0.9
    finally:
        many.close()
    auto = Engine(model_path, EngineOptions(ram_budget_mb=2000, ctx=4096, max_batch=None))
    try:
        assert auto.max_batch == 8  # the default where the KV caches take little of the budget
    finally:
        auto.close()
    with pytest.raises(MoestreamError, match="--max-batch must be at most 64"):
        EngineOptions(max_batch=65)


def _complete(url: str, prompt: str, stream: bool, max_tokens: int = 12) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        return c.completions.create(**kw).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw) if ch.choices)


def _concurrently(calls: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as exc:  # reported by the assertion on the result
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_clients_get_what_they_get_alone(model_path: str, tmp_path: Path) -> None:
    with serve_process(model_path, tmp_path, "--max-batch", "4", "--ram-budget-mb", "2000") as url:
        alone = [_complete(url, p, stream=False) for p in PROMPTS]
        # six clients, half streaming, over four slots
        together = _concurrently([lambda p=p, i=i: _complete(url, p, stream=i % 2 == 0) for i, p in enumerate(PROMPTS)])
        assert together == alone

        # one client leaves mid-stream: the others' answers are unchanged
        def leave_early() -> str:
            c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            stream = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True)
            first = next(iter(stream))
            stream.close()
            return first.choices[0].text

        out = _concurrently([leave_early] + [lambda p=p: _complete(url, p, stream=True) for p in PROMPTS[1:4]])
        assert out[1:] == alone[1:4]
        m = _metrics(url)
        assert m["moestream_requests_cancelled_total"] >= 1
        assert m["moestream_sequence_slots"] == 4
        # decode steps ran several requests' rows together
        assert m['moestream_decode_batch_size_bucket{le="1"}'] < m["moestream_decode_batch_size_count"]


def test_full_queue_answers_429(model_path: str, tmp_path: Path) -> None:
    with serve_process(model_path, tmp_path, "--max-batch", "1", "--max-queue", "1", "--ram-budget-mb", "2000") as url:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0}
        results = _concurrently([lambda: _post(url, "/v1/completions", body) for _ in range(4)])
        statuses = sorted(status for status, _ in results)
        assert statuses.count(200) >= 2 and 429 in statuses, statuses
        busy = next(b for s, b in results if s == 429)
        assert busy["error"]["code"] == "queue_full" and "--max-queue" in busy["error"]["message"]
        assert _metrics(url)["moestream_requests_rejected_total"] >= 1


def test_retry_after_header(model_path: str, tmp_path: Path) -> None:
    with serve_process(model_path, tmp_path, "--max-batch", "1", "--max-queue", "0", "--ram-budget-mb", "2000") as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0})
        hold = threading.Thread(target=_post, args=(url, "/v1/completions", json.loads(body)))
        hold.start()
        try:
            for _ in range(200):  # until the first request holds the only slot
                if _metrics(url)["moestream_requests_running"] == 1:
                    break
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 429 and int(r.getheader("Retry-After")) >= 1
            conn.close()
        finally:
            hold.join()


def test_an_arrival_never_holds_the_streams_that_decode(model_path: str) -> None:
    """A burst is gathered only while nothing decodes: a request arriving during a stream's decoding joins at
    the next step instead of holding that stream for the gathering window."""
    engine = Engine(model_path, EngineOptions(n_slots=10_000, ctx=256, max_batch=4))
    loop = asyncio.new_event_loop()
    worker = Worker(engine, admission=Admission(gather_s=30.0, gather_gap_s=5.0))
    worker.start()

    def job(prompt: str, n: int) -> Job:
        return Job(engine.tokenizer.encode(prompt), n, Sampler(), TextStream(engine.tokenizer), loop)

    async def token_times(j: Job) -> list[float]:
        times = []
        while not isinstance(event := await j.events.get(), DoneEvent):
            if isinstance(event, TextEvent):
                times.append(time.monotonic())
        return times

    try:
        running = job(PROMPTS[0], 60)
        worker.submit(running)
        times = loop.run_until_complete(asyncio.wait_for(_first_then_rest(running, token_times), 60))
        late = job(PROMPTS[1], 4)
        worker.submit(late)
        rest = loop.run_until_complete(asyncio.wait_for(token_times(running), 60))
        loop.run_until_complete(asyncio.wait_for(token_times(late), 60))
    finally:
        worker.stop()
        engine.close()
        loop.close()
    gaps = [b - a for a, b in zip(times[-1:] + rest, rest, strict=False)]
    assert rest and max(gaps) < 3.0  # a step's time, not the 5 s gap or the 30 s window


async def _first_then_rest(j: Job, token_times) -> list[float]:
    """The time of the job's first text event (the stream is decoding from then on)."""
    while not isinstance(await j.events.get(), TextEvent):
        pass
    return [time.monotonic()]
