"""pycalm: single-GPU LLM inference in pure Python, every GPU kernel a numba @cuda.jit function."""

__version__ = "0.1.0"
