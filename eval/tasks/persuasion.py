"""lm-eval `custom_dataset` hooks of the local tasks (`!function persuasion.<name>` in the YAMLs beside this
file): the verified task files of `hf_attn.tooling.task_data`, built on first use."""

from hf_attn.tooling import task_data


def lastword(**_metadata):
    return task_data.dataset_dict("persuasion_lastword")


def nextsent(**_metadata):
    return task_data.dataset_dict("persuasion_nextsent")
