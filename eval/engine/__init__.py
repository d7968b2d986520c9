"""Serving engines: exported checkpoints run in vLLM's own environment (a subprocess), checked against
transformers and the llama_mla source (`check.py`); the worker protocol (`worker.py`), the engine environment
(`environment.py`) and the minimal reproduction of vLLM's CPU rotary bug (`rotary_repro.py`)."""
