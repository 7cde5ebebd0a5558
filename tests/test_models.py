"""Every architecture against transformers, and streaming never changing the output.

A new architecture joins by adding its TinyArch (tests/hf_gguf.py) to ARCH_CASES. What only one
architecture has (the converter's exact tensor mapping, DeltaNet chunking, recurrent checkpoints) is tested
in that architecture's own file.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize

from moestream.analysis.trace import DISK, PROMPT, read_trace
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.formats.gguf_file import GGUFFile
from moestream.models import routed
from moestream.models.attention import query_chunks
from moestream.models.kv_cache import KVCache
from moestream.streaming.expert_cache import ExpertCache
from moestream.streaming.expert_store import PER_EXPERT_TENSOR, is_routed_expert_tensor
from tests.hf_gguf import (
    QWEN3MOE,
    QWEN35MOE,
    TinyArch,
    n_experts,
    one_torch_thread,
    random_tokens,
    rel_error,
    tiny_vocab_size,
)
from tests.hf_gguf_deepseek import DEEPSEEK_V2, DEEPSEEK_V2_LITE, DEEPSEEK_V3
from tests.hf_gguf_deepseek4 import DEEPSEEK_V4
from tests.hf_gguf_dense import DENSE_CASES
from tests.hf_gguf_dsa import DEEPSEEK_V32, GLM_DSA
from tests.hf_gguf_glm import GLM4MOE, GLM45_AIR
from tests.hf_gguf_glm5_next import GLM5_NEXT
from tests.hf_gguf_gpt_oss import GPT_OSS
from tests.hf_gguf_gqa import MIXTRAL, MIXTRAL_PER_EXPERT, OLMOE, QWEN2MOE
from tests.hf_gguf_minimax import MINIMAX_M2

transformers = pytest.importorskip("transformers")

ARCH_CASES = [QWEN3MOE, QWEN35MOE, DEEPSEEK_V2_LITE, DEEPSEEK_V2, DEEPSEEK_V3, GLM4MOE, GLM45_AIR]
ARCH_CASES += [GLM_DSA, DEEPSEEK_V32, GLM5_NEXT]
ARCH_CASES += [MIXTRAL, MIXTRAL_PER_EXPERT, OLMOE, QWEN2MOE, GPT_OSS, DEEPSEEK_V4, MINIMAX_M2, *DENSE_CASES]
MOE_CASES = [a for a in ARCH_CASES if not a.dense]  # what streams and routes
# The default run takes the cases whose mixers and FFNs differ most (qwen3moe, qwen35moe, deepseek-v3, mixtral,
# gpt-oss, llama-dense); `-m ""` (.ci/run) takes every case. The others differ from those by config fields or a
# tensor layout, and their own test files (test_glm4moe.py, test_deepseek2.py, ...) cover what is theirs alone.
SLOW_CASES = {"deepseek-v2-lite", "deepseek-v2", "glm-4.5", "glm-4.5-air", "mixtral-per-expert", "olmoe", "qwen2moe",
              "qwen2", "qwen3", "minimax-m2", "deepseek-v3.2", "glm-5.3-flash"}  # fmt: skip

SLOW = pytest.mark.slow  # in .ci/run's full run only (see SLOW_CASES)


def case_params(cases: list[TinyArch]) -> list:
    """The cases as parameters, those of SLOW_CASES marked slow."""
    return [pytest.param(a, id=a.id, marks=[pytest.mark.slow] if a.id in SLOW_CASES else []) for a in cases]


ARCH_PARAMS, MOE_PARAMS = case_params(ARCH_CASES), case_params(MOE_CASES)
N_PROMPT, N_DECODE = 80, 16  # the prompt is longer than one DeltaNet chunk (64)


one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def _routed(arch: TinyArch) -> None:
    """A test of what routed experts do skips a dense model's case."""
    if arch.dense:
        pytest.skip("a dense model: no routed experts")


def _engine(path: str, **kw) -> Engine:
    return Engine(path, EngineOptions(n_slots=kw.pop("n_slots", 32), **kw))


@pytest.fixture(scope="module", params=ARCH_PARAMS)
def tiny(request, tmp_path_factory):
    """(arch, model file, tokens, transformers' logits for every position of prompt + decoded tokens, model)."""
    arch: TinyArch = request.param
    model = arch.hf_model()
    path = str(tmp_path_factory.mktemp(arch.id) / "m.gguf")
    arch.write(model, path)
    toks = random_tokens(N_PROMPT + N_DECODE, model.config.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float()
    return arch, path, toks, ref, model


def test_config_reads_the_converters_metadata(tiny):
    arch, path, _, _, model = tiny
    eng = _engine(path)
    try:
        assert type(eng.model).arch == arch.name
        for key, want in arch.expected(model.config).items():
            assert getattr(eng.cfg, key) == pytest.approx(want), key
    finally:
        eng.close()


def test_logits_match_transformers(tiny):
    """The exactness contract: in exact mode every position's logits lie within 1e-3 (absolute) of
    transformers' float32, the prompt in one call (longer than every window and DeltaNet chunk), then token by
    token over the cache (DeltaNet: chunked, then recurrent)."""
    _, path, toks, ref, _ = tiny
    eng = _engine(path, exact=True)
    try:
        with torch.inference_mode():
            ours = eng.forward(toks[:N_PROMPT], 0, all_logits=True)
            assert (ours - ref[:N_PROMPT]).abs().max() < 1e-3
            for j in range(N_PROMPT, N_PROMPT + N_DECODE):
                last = eng.forward([toks[j]], j)
                assert (last - ref[j]).abs().max() < 1e-3, j
    finally:
        eng.close()


def test_whole_prompt_equals_token_by_token_and_micro_batches(tiny):
    _, path, toks, _, _ = tiny
    prompt = toks[:N_PROMPT]
    eng = _engine(path)
    try:
        with torch.inference_mode():
            whole = eng.forward(prompt, 0, all_logits=True)
            eng.kv.truncate(0)
            steps = torch.stack([eng.forward([t], i) for i, t in enumerate(prompt)])
            eng.kv.truncate(0)
            chunks = []
            for s in range(0, N_PROMPT, 13):  # ragged micro-batches (with checkpoints inside them)
                chunks.append(eng.forward(prompt[s : s + 13], s, all_logits=True))
            chunked = torch.cat(chunks)
    finally:
        eng.close()
    assert rel_error(steps, whole) < 1e-5
    assert rel_error(chunked, whole) < 1e-5


@pytest.mark.parametrize("which", [pytest.param(0, marks=SLOW), 1], ids=["float", "quantized"])
@pytest.mark.parametrize("arch", MOE_PARAMS)
def test_streaming_never_changes_greedy_output(tmp_path, arch, which):
    dense_type, expert_type = arch.stream_types[which]
    model = arch.hf_model(seed=2)
    path = str(tmp_path / "s.gguf")
    arch.write(model, path, dense_type=dense_type, expert_type=expert_type)
    cfg = model.config
    prompt = random_tokens(40, cfg.vocab_size, seed=2)
    outputs, hit_rates = [], []
    for slots in (cfg.num_experts_per_tok, cfg.num_experts_per_tok + 3, cfg.num_hidden_layers * n_experts(cfg)):
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=16))
        try:
            gen = eng.generate(prompt, 12, Sampler())
            outputs.append(gen.tokens)
            hit_rates.append(gen.stats.hit_rate)
            assert eng.cache.used_slots <= slots
        finally:
            eng.close()
    assert outputs[0] == outputs[1] == outputs[2]
    assert hit_rates[0] < hit_rates[2]


class _KeepLogits:
    """Greedy, keeping the logits it chose from: the first are the prompt's last position's."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor) -> int:
        self.logits.append(logits.clone())
        return int(logits.argmax())

    def pick(self, logits: torch.Tensor, history=None, top=None) -> tuple[int, None]:
        """The scheduler's call (Sampler.pick): no penalties, no log-probabilities."""
        return self(logits), None


def _disk_reads_per_layer(trace: str) -> dict[int, tuple[int, int]]:
    """Per layer: (expert reads of the prompt, distinct experts the prompt routed to)."""
    _, rows = read_trace(trace)
    rows = rows[rows["phase"] == PROMPT]
    out = {}
    for layer in np.unique(rows["layer"]).tolist():
        mine = rows[rows["layer"] == layer]
        out[layer] = (int((mine["source"] == DISK).sum()), len(np.unique(mine["expert"])))
    return out


def test_span_attention_runs_in_query_chunks_equal_to_one_call():
    """KVCache.attend over a span in chunks of queries (each over the keys up to its last position) equals
    the whole span at once, grouped-query heads included."""
    torch.manual_seed(0)
    pos, T, H, Hkv, D = 20, 50, 4, 2, 16
    q = torch.randn(T, H, D)
    keys, values = torch.randn(pos + T, Hkv, D), torch.randn(pos + T, Hkv, D)
    kv = KVCache([Hkv], D, 128, torch.float32)
    kv.query_chunk = 1000
    whole = kv.attend(q, keys, values, pos)
    for chunk in (1, 7, 8):
        kv.query_chunk = chunk
        assert torch.allclose(kv.attend(q, keys, values, pos), whole, atol=1e-6)
    assert query_chunks(T, 8)[-1] == (48, 50) and len(query_chunks(T, 8)) == 7


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=SLOW)], ids=["cached", "streaming"])
def test_layer_major_prefill_equals_micro_batch_major(tiny, tmp_path, stream):
    """Prompts of 1, 2 and 10 micro-batches run as one span through every layer give the tokens and the last
    position's logits of the micro-batch-major path, with every expert cached and under a budget that
    streams; the span reads each expert of a layer at most once, where the micro-batches read them again."""
    arch, path, toks, _, model = tiny
    _routed(arch)
    cfg, ub = model.config, 8
    slots = cfg.num_experts_per_tok + 3 if stream else cfg.num_hidden_layers * n_experts(cfg)
    for n in (1, 2, 10):
        runs = {}
        for span in (ub, None):
            trace = str(tmp_path / f"{n}-{span}.csv")
            eng = Engine(path, EngineOptions(n_slots=slots, ubatch=ub, prefill_span=span, trace_path=trace))
            keep = _KeepLogits()
            try:
                assert eng.prompt_span == (span or eng.ctx)
                tokens = eng.generate(toks[: n * ub], 4, keep).tokens
            finally:
                eng.close()
            runs[span] = tokens, keep.logits[0], _disk_reads_per_layer(trace)
        (mb_tokens, mb_logits, mb_reads), (tokens, logits, reads) = runs[ub], runs[None]
        assert tokens == mb_tokens, n
        assert rel_error(logits, mb_logits) < 1e-4, n
        assert all(got <= distinct for got, distinct in reads.values()), reads
        if stream and n == 10:  # the micro-batches read experts again where the cache cannot hold a layer's
            assert sum(r for r, _ in mb_reads.values()) >= sum(r for r, _ in reads.values())


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=SLOW)], ids=["cached", "streaming"])
def test_a_span_summed_as_its_experts_come_is_bit_identical(tiny, stream, monkeypatch):
    """A span whose experts are fetched in order and summed as they come (routed.InOrderSum) gives the very
    logits of holding every (token, expert) result to the end, with every expert cached and under a budget
    that streams; the span's fetches did ask for the order."""
    arch, path, toks, _, model = tiny
    _routed(arch)
    cfg = model.config
    slots = 2 * n_experts(cfg) + 4 if stream else cfg.num_hidden_layers * n_experts(cfg)
    asked: list[bool] = []
    real = ExpertCache.fetch_groups

    def spy(self, layer, ids, admit=True, ordered=False):
        asked.append(ordered)
        return real(self, layer, ids, admit, ordered)

    monkeypatch.setattr(ExpertCache, "fetch_groups", spy)
    runs = {}
    for pairs in (0, 1 << 30):
        monkeypatch.setattr(routed, "ORDERED_MIN_PAIRS", pairs)
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=8))
        keep = _KeepLogits()
        try:
            runs[pairs] = eng.generate(toks[:80], 4, keep).tokens, keep.logits[0]
        finally:
            eng.close()
        assert any(asked) == (pairs == 0)
        asked.clear()
    assert runs[0][0] == runs[1 << 30][0]
    assert torch.equal(runs[0][1], runs[1 << 30][1])


def test_prompt_reuse_gives_samerandom_tokens(tiny):
    _, path, toks, _, _ = tiny
    prompt = toks[:N_PROMPT]
    eng = _engine(path, ubatch=16)
    try:
        first = eng.generate(prompt, 6, Sampler())
        follow = prompt + first.tokens + [9, 10]
        reused = eng.generate(follow, 6, Sampler())
        assert reused.stats.reused_tokens >= len(prompt)
        eng.reset()
        fresh = eng.generate(follow, 6, Sampler())
        assert fresh.stats.reused_tokens == 0
        assert reused.tokens == fresh.tokens
    finally:
        eng.close()


def test_route_hook_replaces_the_routers_choice(tiny):
    arch, path, toks, _, _ = tiny
    _routed(arch)
    eng = _engine(path)
    calls = []

    # what analysis.routes.RouteTrace answers
    def fixed(layer: int, pos: int, n: int, seq: object = None) -> torch.Tensor:
        calls.append((layer, pos, n))
        return torch.tensor([[layer % 8, 7]] * n)

    try:
        eng.route_hook = fixed
        eng.generate(toks[:20], 3, Sampler())
        assert eng.cache.stats.misses == 2 * eng.cfg.n_layers  # only the forced experts were ever read
        assert (0, 0, 20) in calls and (eng.cfg.n_layers - 1, 21, 1) in calls
    finally:
        eng.close()


def test_kv_memory_is_what_the_budget_counts(tiny):
    _, path, *_ = tiny
    eng = _engine(path, ctx=256)
    try:
        assert eng.kv.nbytes == type(eng.model).memory(eng.cfg).kv_nbytes(256, eng.exact)
    finally:
        eng.close()


def test_llama_cpp_reads_the_same_model(tiny):
    """llama.cpp's own graph on the same file: names, head order and norm offsets agree with it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    _, path, toks, _, _ = tiny
    f = GGUFFile(path)
    per_expert = any(PER_EXPERT_TENSOR.fullmatch(name) for name in f.tensors)
    lite = f.arch == "deepseek2" and "deepseek2.attention.q_lora_rank" not in f.metadata
    f.close()
    if per_expert:
        pytest.skip("llama.cpp no longer loads files with one tensor per expert")
    if lite:  # moestream reads the absent key as "no q LoRA", whatever the depth
        pytest.skip("llama.cpp takes a deepseek2 file without q_lora_rank for V2-Lite only at its 27 layers")
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, logits_all=True, verbose=False, n_threads=1)
    llm.eval(toks[:40])
    ref = torch.tensor(llm.scores[:40])
    llm.close()
    eng = _engine(path)
    try:
        with torch.inference_mode():
            ours = eng.forward(toks[:40], 0, all_logits=True)
    finally:
        eng.close()
    assert rel_error(ours, ref) < 2e-3  # llama.cpp rounds some activations to F16
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# ---- the test converter --------------------------------------------------------------------------


def _kind(name: str, ndim: int, arch: str) -> str:
    """Which type the converter gives a tensor of `arch` (GGUF name): the routed experts', the dense one, or F32."""
    if name.endswith(".bias"):  # the converter keeps every bias F32 (GPT-OSS's experts' are 2-D)
        return "f32"
    if name.endswith("tid2eid.weight"):  # DeepSeek-V4's hash table
        return "i32"
    if "hc_" in name or name.endswith("_ape.weight"):  # V4's float32 checkpoint tensors stay F32
        return "f32"
    if is_routed_expert_tensor(name):
        return "expert"
    f32_names = ("ssm_conv1d.weight", "ssm_a", "ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight")
    if arch == "glm5-next" and "indexer_compressor_" in name:  # its pool gates and biases (tensor_force_quant)
        return "f32"
    if arch != "deepseek4":  # the DSA indexer's head weights stay F32; V4's indexer.proj is quantized as the rest
        f32_names += ("indexer.proj.weight",)
    if ndim == 1 or "norm" in name or "ffn_gate_inp" in name or name.endswith(f32_names):
        return "f32"
    return "dense"


def test_f32_file_reads_back_exactly(tiny):
    """Our reader and gguf's agree on every tensor of an F32 file (gguf's shapes are in ggml order)."""
    arch, path, *_ = tiny
    f = GGUFFile(path)
    by_name = {t.name: t for t in GGUFReader(path).tensors}
    assert f.arch == arch.name and set(f.tensors) == set(by_name)
    for name, info in f.tensors.items():
        t = by_name[name]
        kind = np.int32 if info.ggml_type == T.I32 else np.float32  # I32: DeepSeek-V4's tid2eid tables
        assert info.ggml_type in (T.F32, T.I32) and tuple(reversed(t.shape.tolist())) == info.shape, name
        got = f.read(name).view(kind).reshape(info.shape)
        np.testing.assert_array_equal(got, np.asarray(t.data).reshape(info.shape), err_msg=name)
    f.close()


@pytest.mark.parametrize(
    "dense,expert,tol",
    [
        (T.F16, T.Q8_0, 0.01),
        (T.Q8_0, T.Q4_0, 0.15),
        pytest.param(T.Q8_0, T.Q4_K, 0.15, marks=SLOW),
        pytest.param(T.BF16, T.F32, 0.01, marks=SLOW),
    ],  # fmt: skip
)
@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_quantized_types(tmp_path, arch, dense, expert, tol):
    model = arch.hf_model(seed=1)
    f32_path, path = tmp_path / "f.gguf", tmp_path / "q.gguf"
    arch.write(model, f32_path)
    arch.write(model, path, dense_type=dense, expert_type=expert)
    exact = {t.name: np.asarray(t.data, dtype=np.float32) for t in GGUFReader(f32_path).tensors}
    f = GGUFFile(path)
    gguf_arch = f.arch
    f.close()
    for t in GGUFReader(path).tensors:
        w = exact[t.name]
        kind = _kind(t.name, len(t.shape), gguf_arch)
        assert t.tensor_type == {"dense": dense, "expert": expert, "f32": T.F32, "i32": T.I32}[kind], t.name
        if kind == "i32":
            continue
        got = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(w.shape)
        rel = np.linalg.norm(got - w) / np.linalg.norm(w)
        assert rel < (tol if kind != "f32" else 1e-7), (t.name, rel)


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_tied_embeddings_omit_output(tmp_path, arch):
    model = arch.hf_model(seed=2, tie_word_embeddings=True)
    path = tmp_path / "tied.gguf"
    arch.write(model, path, tokenizer_md={})
    f = GGUFFile(path)
    assert "output.weight" not in f.tensors and "token_embd.weight" in f.tensors
    assert not any(k.startswith("tokenizer.") for k in f.metadata)
    f.close()
    eng = Engine(str(path), EngineOptions(n_slots=32))  # the head reads the embedding's bytes
    try:
        toks = random_tokens(12, model.config.vocab_size)
        with torch.inference_mode(), torch.no_grad():
            ours = eng.forward(toks, 0, all_logits=True)
            ref = model(torch.tensor([toks])).logits[0].float()
        assert rel_error(ours, ref) < 1e-3
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ARCH_PARAMS)
def test_vocab_mismatch_is_explained(tmp_path, arch):
    model = arch.hf_model(vocab_size=tiny_vocab_size() + 3)
    with pytest.raises(ValueError, match="tiny BPE vocab"):
        arch.write(model, tmp_path / "bad.gguf")
    assert not list(tmp_path.iterdir())
