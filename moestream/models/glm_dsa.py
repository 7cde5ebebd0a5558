"""GLM-5, GLM-5.1 and GLM-5.2 (GGUF arch `glm-dsa`): DeepSeek-V3.2's shape (deepseek32.py: MLA over the top_k
tokens a lightning indexer picks, leading dense blocks, sigmoid routing with a correction bias, a shared
expert) with two differences of its own:
  - the indexer rotates its queries and keys in interleaved pairs, as the attention does;
  - GLM-5.2's blocks are "full" (run their indexer) or "shared" (attend to the tokens the last full block
    chose), per attention.indexer.types; a file without that key is all full below a 1M-token context and
    GLM-5.2's pattern (full, full, then one full in four) from there, as llama.cpp reads it.
The converter writes no expert_gating_func unless config.json has a scoring_func; the router is sigmoid.
"""

from __future__ import annotations

from typing import ClassVar

from moestream.models.deepseek32 import DeepSeek32, DeepSeek32Config
from moestream.models.loader import ArchMetadata

ARCH = "glm-dsa"
GLM_5_2_CONTEXT = 1 << 20  # files from this context on are GLM-5.2's (llama.cpp's rule)


class GlmDsaConfig(DeepSeek32Config):
    ARCH: ClassVar[str] = ARCH
    INTERLEAVED: ClassVar[bool] = True

    @staticmethod
    def default_full(m: ArchMetadata, n_blocks: int) -> list[bool]:
        if m.int("context_length", 4096) < GLM_5_2_CONTEXT:
            return [True] * n_blocks
        return [i < 2 or (i - 2) % 4 == 0 for i in range(n_blocks)]


class GlmDsa(DeepSeek32):
    arch = ARCH
    Config = GlmDsaConfig
