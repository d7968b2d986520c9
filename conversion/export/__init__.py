"""The exact export of a DeepSeek-layout `llama_mla` checkpoint as `deepseek_v3` (`hf-attn export`, also
`python -m conversion.export`); docs/layout.md lists the modules."""

from hf_attn.conversion.export.deepseek import deepseek_state_dict, export_checkpoint, main
from hf_attn.conversion.export.plan import ExportPlan, plan_export

__all__ = ["ExportPlan", "deepseek_state_dict", "export_checkpoint", "main", "plan_export"]
