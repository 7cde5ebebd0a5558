"""The model math. One file per architecture (its config, attention, block and forward); the GGUF
`general.architecture` string picks the class. Shared once: loader.py (weights and metadata as the model
names them, checked), base.py (embedding, head, engine attachments), moe.py (router and experts),
deltanet.py (Gated DeltaNet and the hybrid cache), mla.py (multi-head latent attention and its cache),
common.py (norms, RoPE, KV cache, routing), gqa.py (the plain GQA decoder Mixtral, OLMoE and Qwen2-MoE
share)."""

from moestream.models.deepseek2 import DeepSeek2
from moestream.models.glm4moe import Glm4Moe
from moestream.models.gpt_oss import GptOss
from moestream.models.mixtral import Mixtral
from moestream.models.olmoe import Olmoe
from moestream.models.qwen2moe import Qwen2Moe
from moestream.models.qwen3moe import Qwen3Moe
from moestream.models.qwen35moe import Qwen35Moe

ARCHITECTURES = {
    "deepseek2": DeepSeek2,
    "glm4moe": Glm4Moe,
    "gpt-oss": GptOss,
    "qwen3moe": Qwen3Moe,
    "qwen35moe": Qwen35Moe,
    "llama": Mixtral,  # with experts only: a dense llama file is refused by its config
    "olmoe": Olmoe,
    "qwen2moe": Qwen2Moe,
}
