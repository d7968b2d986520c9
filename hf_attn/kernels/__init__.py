"""Optional GPU kernels (Triton; `pip install hf-attn[kernels]`). Importing this package imports nothing
heavy: `hf_attn.kernels.mla_decode` imports triton and is loaded only where a kernel is used (`llama_mla`'s
absorbed decode on CUDA tensors)."""
