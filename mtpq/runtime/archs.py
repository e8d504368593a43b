"""The GGUF architectures the torch runtime runs, known without importing torch: commands that need the runtime
check a file against this before any work (``mtpq.runtime.families.RUNTIME_FAMILIES`` registers the same set)."""

# in the order the families came (tests run them in this order)
RUNTIME_ARCHS_IN_ORDER = (
    "glm4moe",
    "qwen35",
    "qwen35moe",
    "deepseek2",
    "glm-dsa",
    "deepseek32",
    "hy_v3",
    "cohere2moe",
    "bailingmoe3",
    "qwen3next",
    "nemotron_h_moe",
    "step35",
    "mimo2",
    "deepseek4",
)
RUNTIME_ARCHS = frozenset(RUNTIME_ARCHS_IN_ORDER)
