"""flashserve: an LLM inference engine whose attention runs on Triton kernels."""

__version__ = "0.1.0"
