"""The model math. An architecture is one file: its config (read from GGUF metadata), the tensors it names,
and which mixer and FFN each of its decoder blocks uses; the GGUF `general.architecture` string picks the
class. Shared once: base.py (embedding, head, the one forward step), layer.py (the decoder block, the mixer
interface, a step's context), rows.py (row-wise ops of a step of several sequences), moe.py (the MoE block:
router, routed and shared experts), routed.py (the one executor of routed experts), routing.py (routers),
attention.py and kv_cache.py (attention over a cache, the KV cache), rope.py, ops.py (norms and small ops),
mla.py (latent attention and its cache), sparse_attention.py (DeepSeek Sparse Attention: the lightning indexer
and latent attention over its choice), compressed_attention.py (DeepSeek-V4's sliding and compressed attention, its
lightning indexer, the compressed cache), hyper.py (hyper-connected residual streams), deltanet.py (Gated DeltaNet and
the hybrid cache), kda.py (Kimi Delta Attention),
gqa.py (the plain grouped-query decoder Mixtral, OLMoE, Qwen2-MoE and MiniMax-M2 share), dense.py
(the dense models: Llama, Qwen2, Qwen3), memory.py (the bytes a model's KV cache and prompt steps take), loader.py
(weights and metadata as the model names them, checked), common.py (the expert provider, embedding, fused projections,
resident tensors)."""

from collections.abc import Mapping
from typing import Any

from moestream.models.deepseek2 import DeepSeek2
from moestream.models.deepseek4 import DeepSeek4
from moestream.models.deepseek32 import DeepSeek32
from moestream.models.dense import Llama, Qwen2, Qwen3
from moestream.models.glm4moe import Glm4Moe
from moestream.models.glm5_next import Glm5Next
from moestream.models.glm_dsa import GlmDsa
from moestream.models.gpt_oss import GptOss
from moestream.models.minimax_m2 import MiniMaxM2
from moestream.models.mixtral import Mixtral
from moestream.models.olmoe import Olmoe
from moestream.models.qwen2moe import Qwen2Moe
from moestream.models.qwen3moe import Qwen3Moe
from moestream.models.qwen35moe import Qwen35Moe

ARCHITECTURES = {
    "deepseek2": DeepSeek2,
    "deepseek4": DeepSeek4,
    "deepseek32": DeepSeek32,
    "glm-dsa": GlmDsa,
    "glm5-next": Glm5Next,
    "glm4moe": Glm4Moe,
    "gpt-oss": GptOss,
    "minimax-m2": MiniMaxM2,
    "qwen3moe": Qwen3Moe,
    "qwen35moe": Qwen35Moe,
    "llama": Mixtral,  # with experts; without them, Llama (model_class)
    "olmoe": Olmoe,
    "qwen2moe": Qwen2Moe,
    "qwen2": Qwen2,
    "qwen3": Qwen3,
}


def model_class(arch: str, metadata: Mapping[str, Any]) -> type | None:
    """The model class of a file's `general.architecture`: llama names both Mixtral (with experts) and the
    dense Llama; None where moestream has none."""
    if arch == "llama" and not metadata.get("llama.expert_count"):
        return Llama
    return ARCHITECTURES.get(arch)
