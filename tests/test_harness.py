"""eval.harness: lm-eval on hf-attn checkpoints (hf_attn_grouped, llama_mla), local tasks by name and by YAML
path, one-line errors (offline included); the local tasks' scores equal an independent computation."""

import json
import math

import pytest
import torch
from conftest import saved_checkpoint

pytest.importorskip("lm_eval")

from hf_attn.eval import harness  # noqa: E402
from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM  # noqa: E402
from hf_attn.tooling import task_data  # noqa: E402

LIMIT = 3


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def tiny_gqa(tokenizer, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    yield from saved_checkpoint(tmp_path_factory, "tiny-gqa", LlamaForCausalLM(config), tokenizer)


@pytest.fixture(scope="module")
def tiny_mla(tokenizer, tmp_path_factory):
    torch.manual_seed(1)
    config = LlamaMLAConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        kv_lora_rank=12,
        rope_pairs=2,
    )
    yield from saved_checkpoint(tmp_path_factory, "tiny-mla", LlamaMLAForCausalLM(config), tokenizer)


@pytest.fixture(scope="module")
def tiny_deepseek(tokenizer, tmp_path_factory):
    """A dense DeepSeek-V3 (MLA without q LoRA): the layout hf-attn's MLA checkpoints export to."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(2)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=512,
    )
    yield from saved_checkpoint(tmp_path_factory, "tiny-deepseek", DeepseekV3ForCausalLM(config), tokenizer)


def _loglik(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | context) and whether it is the greedy continuation: the tokens of
    context + continuation beyond those of the context, scored by one eager forward pass."""
    ctx = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    cont = torch.tensor(whole[len(ctx) :])
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([whole])).logits[0].double().log_softmax(-1)
    logp = logp[len(ctx) - 1 : len(whole) - 1]  # (K, V): the positions predicting the continuation
    return logp.gather(1, cont[:, None]).sum().item(), bool((logp.argmax(-1) == cont).all())


def _reference_scores(path, tokenizer, limit: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    lastword = task_data.load_items("persuasion_lastword")[:limit]
    scored = [_loglik(model, tokenizer, it["context"], " " + it["target"]) for it in lastword]
    nextsent = task_data.load_items("persuasion_nextsent")[:limit]
    acc, acc_norm = [], []
    for it in nextsent:
        ll = [_loglik(model, tokenizer, it["context"], " " + c)[0] for c in it["choices"]]
        norm = [v / len(c) for v, c in zip(ll, it["choices"])]
        acc.append(max(range(len(ll)), key=ll.__getitem__) == it["label"])
        acc_norm.append(max(range(len(norm)), key=norm.__getitem__) == it["label"])
    return {
        "lastword_ppl": math.exp(-sum(s for s, _ in scored) / len(scored)),
        "lastword_acc": sum(g for _, g in scored) / len(scored),
        "nextsent_acc": sum(acc) / len(acc),
        "nextsent_acc_norm": sum(acc_norm) / len(acc_norm),
    }


def test_local_tasks_with_hf_attn_grouped_equal_an_independent_computation(tiny_gqa, tokenizer, tmp_path):
    out = tmp_path / "harness.json"
    argv = ["--model", str(tiny_gqa), "--attn-implementation", "hf_attn_grouped", "--limit", str(LIMIT)]
    assert harness.main([*argv, "--batch-size", "2", "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["attn_implementation"] == "hf_attn_grouped"
    lastword, nextsent = record["results"]["persuasion_lastword"], record["results"]["persuasion_nextsent"]
    assert lastword["sample_len"] == nextsent["sample_len"] == LIMIT
    ref = _reference_scores(tiny_gqa, tokenizer, LIMIT)
    assert lastword["perplexity,none"] == pytest.approx(ref["lastword_ppl"], rel=1e-4)
    assert lastword["acc,none"] == ref["lastword_acc"]
    assert nextsent["acc,none"] == pytest.approx(ref["nextsent_acc"])
    assert nextsent["acc_norm,none"] == pytest.approx(ref["nextsent_acc_norm"])


@pytest.mark.parametrize("kind", ["llama_mla", "deepseek_v3"])
def test_mla_checkpoints_and_a_task_yaml_path(kind, request, tmp_path, capsys):
    """A task given as a YAML file (its own local data), run on a llama_mla and a DeepSeek-V3 checkpoint."""
    checkpoint = request.getfixturevalue({"llama_mla": "tiny_mla", "deepseek_v3": "tiny_deepseek"}[kind])
    data = tmp_path / "tiny.jsonl"
    data.write_text(
        "".join(
            json.dumps({"context": c, "target": t}) + "\n"
            for c, t in [("The cat sat on the", "mat"), ("Anne walked to the", "house")]
        )
    )
    task = tmp_path / "tiny_lastword.yaml"
    task.write_text(
        "task: tiny_lastword\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: \"{{' ' + target}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    out = tmp_path / "mla.json"
    assert harness.main(["--model", str(checkpoint), "--tasks", str(task), "--output", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["model_type"] == kind
    assert record["results"]["tiny_lastword"]["sample_len"] == 2
    assert "tiny_lastword: acc" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "no_such_task_xyz"], "Unknown task"),
        (["--tasks", "missing/dir/task.yaml"], "does not exist"),
        (["--include-path", "missing/dir"], "does not exist"),
        (["--model", "hf-attn-test/no-such-model-xyz", "--tasks", "persuasion_lastword"], "offline"),
        (["--load-dtype", "float32", "--batch-size", "0"], "--batch-size"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    import lm_eval.tasks

    class LocalOnly(lm_eval.tasks.TaskManager):  # lm-eval's own index (thousands of YAMLs) is slow to read
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalOnly)
    assert harness.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_hub_task_data_offline_says_offline(tiny_gqa, tmp_path, capsys):
    task = tmp_path / "hub_task.yaml"
    task.write_text(
        "task: hub_task\ndataset_path: hf-attn-test/no-such-dataset-xyz\ntest_split: test\n"
        "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{target}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    assert harness.main(["--model", str(tiny_gqa), "--tasks", str(task)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "offline" in err, err  # one line: no weights were loaded


def test_task_accuracy_for_the_study(tiny_gqa, tokenizer):
    from transformers import AutoModelForCausalLM

    from hf_attn.eval.tasks.accuracy import task_accuracy

    model = AutoModelForCausalLM.from_pretrained(tiny_gqa)
    model.train()
    got = task_accuracy(model, tokenizer, limit=2, batch_size=4)
    assert model.training  # left as it was
    assert got["items"] == {"persuasion_lastword": 2, "persuasion_nextsent": 2}
    ref = _reference_scores(tiny_gqa, tokenizer, 2)
    for key in ("lastword_acc", "nextsent_acc", "nextsent_acc_norm"):
        assert got[key] == pytest.approx(ref[key])
    assert got["lastword_ppl"] == pytest.approx(ref["lastword_ppl"], rel=1e-4)
