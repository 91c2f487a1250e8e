"""The names of `--tool-call-parser` and `--reasoning-parser`, each to the parser class that
engine/serve/parsers imports on lookup ("module:Class"). A module of its own, below both: the
config checks a name in every process without importing the front end.
"""

from __future__ import annotations

TOOL_CALL_PARSERS = {
    "hermes": "engine.serve.parsers.hermes:HermesParser",
    "qwen25": "engine.serve.parsers.hermes:HermesParser",  # Qwen2.5/Qwen3 write the Hermes format
    "llama3": "engine.serve.parsers.llama3:Llama3Parser",
    "deepseek_v3": "engine.serve.parsers.deepseek_v3:DeepSeekV3Parser",
    "deepseek_v31": "engine.serve.parsers.deepseek_v3:DeepSeekV31Parser",
    "glm45": "engine.serve.parsers.glm45:Glm45Parser",
    # the other server's spellings of the same (SGLang's or vLLM's)
    "qwen": "engine.serve.parsers.hermes:HermesParser",
    "llama3_json": "engine.serve.parsers.llama3:Llama3Parser",
    "deepseekv3": "engine.serve.parsers.deepseek_v3:DeepSeekV3Parser",
    "deepseekv31": "engine.serve.parsers.deepseek_v3:DeepSeekV31Parser",
    "glm": "engine.serve.parsers.glm45:Glm45Parser",
}

REASONING_PARSERS = {
    "deepseek-r1": "engine.serve.parsers.reasoning:DeepSeekR1Reasoning",
    "qwen3": "engine.serve.parsers.reasoning:Qwen3Reasoning",
    "glm45": "engine.serve.parsers.reasoning:Glm45Reasoning",
    "deepseek_r1": "engine.serve.parsers.reasoning:DeepSeekR1Reasoning",  # vLLM's spelling
}
