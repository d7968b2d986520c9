"""hf-attn: KV-cache-saving attention for Hugging Face Transformers.

`import hf_attn` registers every attention implementation (and the `llama_mla` model type) with transformers.
"""

from hf_attn.registry import IMPLEMENTATIONS, register

__all__ = ["IMPLEMENTATIONS", "register"]
__version__ = "0.1.0"

register()
