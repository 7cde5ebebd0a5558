"""One file per architecture; the GGUF `general.architecture` string picks the class."""

from moestream.models.qwen3moe import Qwen3Moe

ARCHITECTURES = {
    "qwen3moe": Qwen3Moe,
}
