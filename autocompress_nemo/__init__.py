"""autocompress-nemo: hardware-guided compression of LLMs on Megatron-core."""

__version__ = "0.1.0"
