"""One file per architecture; the GGUF `general.architecture` string picks the class."""

from moestream.models.qwen3moe import Qwen3Moe
from moestream.models.qwen35moe import Qwen35Moe

ARCHITECTURES = {
    "qwen3moe": Qwen3Moe,
    "qwen35moe": Qwen35Moe,
}
