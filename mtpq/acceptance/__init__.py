"""Engine-neutral reports and gates: what the torch runtime and llama.cpp measure, judged the same way.

- :mod:`.metrics`: a generation's record and acceptance metrics with vLLM's definitions (per round, or from an
  engine's per-request totals);
- :mod:`.prompts`: the prompt sets drafted over;
- :mod:`.report`: the acceptance report, its verdict and its Markdown;
- :mod:`.quality`: the quality report of ``mtpq compare`` and its gates.

Torch-free: the runtime (``mtpq.runtime``) and the engines (``mtpq.engines``) import this, never the reverse.
"""
