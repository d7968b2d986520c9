"""The export of a `llama_mla` checkpoint in the DeepSeek layout as an exact `deepseek_v3` checkpoint:
`deepseek` (`export_checkpoint` and `hf-attn export`), `plan` (what is exported, or why not) and
`engine_dims` (the latent and RoPE sizes vLLM's MLA backends take). `python -m conversion.export` is
`hf-attn export`."""

from hf_attn.conversion.export.deepseek import deepseek_state_dict, export_checkpoint, main
from hf_attn.conversion.export.plan import ExportPlan, plan_export

__all__ = ["ExportPlan", "deepseek_state_dict", "export_checkpoint", "main", "plan_export"]
