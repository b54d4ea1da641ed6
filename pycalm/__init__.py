"""pycalm: single-GPU LLM inference in pure Python, every GPU kernel a numba @cuda.jit function.

import pycalm
llm = pycalm.load("smollm2")          # pycalm.app.api: generate, chat, tokenize, perplexity
"""

__version__ = "0.1.0"

__all__ = ["LLM", "Generation", "load", "__version__"]


def __getattr__(name: str) -> object:
    # the API is imported on first use, so `import pycalm` (and every pycalm.* module) stays light
    if name in ("LLM", "Generation", "load"):
        from pycalm.app import api

        return getattr(api, name)
    raise AttributeError(f"module 'pycalm' has no attribute {name!r}")
