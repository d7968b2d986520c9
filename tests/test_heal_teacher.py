"""Healing from a teacher (`--teacher`, the KL to the teacher's next-token distribution) and with LoRA
(`--lora-rank`, peft; adapters merged on save). Tiny random models (test_heal's fixtures) keep every run
to seconds; references are independent computations (a float64 sum over the vocabulary, peft's own model
before merging, vanilla transformers' DeepseekV3 for the export)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import exit_status
from safetensors.torch import load_file
from test_heal import _losses, _run
from test_heal import tiny as tiny_fixture
from test_heal import tiny_mla as tiny_mla_fixture

from hf_attn.conversion.training import heal as heal_mod
from hf_attn.conversion.training.recipe import HealRecipe, read_log
from hf_attn.conversion.training.teacher import distill_loss, training_loss
from hf_attn.tooling.files import checkpoint_hash, sha256_file

tiny, tiny_mla = tiny_fixture, tiny_mla_fixture  # (test_heal's fixtures: a random Llama / llama_mla, texts)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _recipe(temperature: float, weight: float) -> HealRecipe:
    return HealRecipe(
        32, 1, 1, 1, 1e-3, 0, "constant", 1, 0.0, 1.0, "all", "float32", 0, "x", "y",
        teacher_hash="t", distill_temperature=temperature, distill_weight=weight,
    )  # fmt: skip


def _hand_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 x mean over positions of sum_v p_v (log p_v - log q_v), written out in float64."""
    s, t = student.double() / temperature, teacher.double() / temperature
    log_q = s - s.exp().sum(-1, keepdim=True).log()
    log_p = t - t.exp().sum(-1, keepdim=True).log()
    per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
    return per_position.mean() * temperature**2


def _hashes(directory) -> dict:
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()}


# --------------------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_kl_and_its_gradient_equal_an_independent_float64_computation(temperature):
    g = torch.Generator().manual_seed(0)
    student = (3 * torch.randn(2, 5, 97, generator=g, dtype=torch.float64)).requires_grad_()
    teacher = 3 * torch.randn(2, 5, 97, generator=g, dtype=torch.float64)
    got = distill_loss(student, teacher, temperature)
    reference = student.detach().clone().requires_grad_()
    want = _hand_kl(reference, teacher, temperature)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch_kl = torch.nn.functional.kl_div(
        torch.log_softmax(student.detach() / temperature, -1).flatten(0, 1),
        torch.log_softmax(teacher / temperature, -1).flatten(0, 1),
        log_target=True,
        reduction="batchmean",
    )
    torch.testing.assert_close(got, torch_kl * temperature**2, rtol=1e-12, atol=0)
    got.backward()
    want.backward()
    torch.testing.assert_close(student.grad, reference.grad, rtol=1e-10, atol=1e-14)
    assert student.grad.abs().max() > 1e-3  # (the comparison can fail)


def test_training_loss_mixes_kl_and_next_token_cross_entropy(tiny):
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, ce, kl = training_loss(student, teacher, ids, _recipe(2.0, 0.3))
    with torch.no_grad():
        s, t = student(input_ids=ids).logits[:, :-1], teacher(input_ids=ids).logits[:, :-1]
    hand_ce = torch.nn.functional.cross_entropy(s.reshape(-1, 512).double(), ids[:, 1:].reshape(-1))
    hand_kl = _hand_kl(s, t, 2.0)
    assert kl.item() == pytest.approx(hand_kl.item(), rel=1e-5) and kl.item() > 1e-3
    assert ce.item() == pytest.approx(hand_ce.item(), rel=1e-5)
    assert loss.item() == pytest.approx(0.3 * hand_kl.item() + 0.7 * hand_ce.item(), rel=1e-5)


def test_a_student_equal_to_its_teacher_has_zero_kl_zero_gradient_and_never_moves(tiny, tmp_path):
    model_dir = tiny[0]
    before = _hashes(model_dir)
    pure = dict(teacher=str(model_dir), distill_weight=1.0)  # (w < 1 would train on the labels too)
    result = _run(tiny, tmp_path / "out", max_steps=2, eval_tokens=0, **pure)
    steps = [e for e in read_log(result["log"]) if e["event"] == "step"]
    assert [e["kl"] for e in steps] == [0.0, 0.0] and [e["loss"] for e in steps] == [0.0, 0.0]
    assert all(e["ce"] > 1 for e in steps)  # the labels' loss was not what trained
    source, healed = (
        load_file(model_dir / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert all(torch.equal(source[k], healed[k]) for k in source)  # zero gradient: AdamW moved nothing
    assert _hashes(model_dir) == before  # the teacher (here also the source) was never written
    record = json.loads((tmp_path / "out" / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["teacher"] == str(model_dir) and record["teacher_hash"] == checkpoint_hash(model_dir)


# --------------------------------------------------------------------------------------------- which teacher


def test_teacher_auto_takes_the_recorded_source_and_says_so_when_there_is_none(tiny, tmp_path, capsys):
    first = _run(tiny, tmp_path / "first", max_steps=1, eval_tokens=0)  # records its source: tiny
    assert first["source"] == str(tiny[0])
    teacher_before = _hashes(tiny[0])
    second = _run(
        (tmp_path / "first", *tiny[1:]), tmp_path / "second", max_steps=2, teacher="auto", eval_tokens=0
    )
    assert second["teacher"] == str(tiny[0]) and second["teacher_hash"] == checkpoint_hash(tiny[0])
    assert [e["kl"] > 0 for e in read_log(second["log"]) if e["event"] == "step"] == [True, True]
    assert _hashes(tiny[0]) == teacher_before
    capsys.readouterr()

    no_record = _run(tiny, tmp_path / "third", max_steps=1, teacher="auto", eval_tokens=0)
    lines = [line for line in capsys.readouterr().out.splitlines() if "--teacher auto" in line]
    assert len(lines) == 1 and "records no source" in lines[0] and "labels only" in lines[0]
    assert no_record["teacher"] is None and no_record["settings"]["teacher"] == "auto"

    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "first", moved)
    config = json.loads((moved / "config.json").read_text())
    config["hf_attn"]["history"][0]["source"] = str(tmp_path / "gone")
    (moved / "config.json").write_text(json.dumps(config))
    gone = _run((moved, *tiny[1:]), tmp_path / "fourth", max_steps=1, teacher="auto", eval_tokens=0)
    lines = [line for line in capsys.readouterr().out.splitlines() if "--teacher auto" in line]
    assert len(lines) == 1 and "not on this machine" in lines[0] and gone["teacher"] is None


def _fails(capsys, argv) -> str:
    assert exit_status(heal_mod.main, argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_teacher_of_another_vocabulary_or_bad_options_are_one_line_and_write_nothing(
    tiny, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    model_dir, train, held_out = tiny
    bigger = tmp_path / "bigger-vocab"
    config = LlamaConfig(
        **{**AutoModelForCausalLM.from_pretrained(model_dir).config.to_dict(), "vocab_size": 600}
    )
    LlamaForCausalLM(config).save_pretrained(bigger)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, bigger / name)
    other_tokens = tmp_path / "other-tokenizer"
    shutil.copytree(model_dir, other_tokens)
    tokenizer = json.loads((other_tokens / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other_tokens / "tokenizer.json").write_text(json.dumps(tokenizer))

    base = ["--model", str(model_dir), "--train-text", str(train), "--eval-text", str(held_out)]
    base += [
        "--output",
        str(tmp_path / "out"),
        "--seq-len",
        "32",
        "--eval-context",
        "64",
        "--eval-tokens",
        "640",
    ]
    err = _fails(capsys, [*base, "--teacher", str(bigger)])
    assert "another vocabulary" in err and "600 logits against 512" in err
    assert "another vocabulary" in _fails(capsys, [*base, "--teacher", str(other_tokens)])
    assert "--distill-weight must be between 0 and 1" in _fails(
        capsys, [*base, "--teacher", "auto", "--distill-weight", "1.5"]
    )
    assert "needs a teacher" in _fails(capsys, [*base, "--distill-temperature", "2"])
    assert "--distill-temperature must be positive" in _fails(
        capsys, [*base, "--teacher", str(model_dir), "--distill-temperature", "0"]
    )
    assert "not a checkpoint directory" in _fails(capsys, [*base, "--teacher", str(tmp_path / "nowhere")])
    assert "--lora-rank must be a positive integer, got 0" in _fails(capsys, [*base, "--lora-rank", "0"])
    assert "--lora-rank" in _fails(capsys, [*base, "--lora-rank", "2.5"])
    assert "no such linear module" in _fails(
        capsys, [*base, "--lora-rank", "2", "--lora-targets", "kv_b_proj"]
    )
    assert "needs --lora-rank" in _fails(capsys, [*base, "--lora-targets", "q_proj"])
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.heal").exists()


# --------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("lora_rank", [None, 4])
def test_resume_with_a_teacher_gives_bitwise_the_uninterrupted_weights(
    lora_rank, tiny, tiny_mla, tmp_path, capsys
):
    """Student: the tiny llama_mla; teacher: the tiny Llama (same tokenizer). 3 steps, stop, 3 more with
    --resume == 6 steps in one go, bit for bit; a resume with another teacher is refused."""
    common = dict(schedule="constant", teacher=str(tiny[0]), eval_tokens=0, lora_rank=lora_rank)
    out, state = tmp_path / "out", tmp_path / "state"
    _run(tiny_mla, out, max_steps=3, keep_checkpoints=True, state_dir=state, **common)
    resumed = _run(
        tiny_mla,
        out,
        max_steps=6,
        resume=True,
        overwrite=True,
        keep_checkpoints=True,
        state_dir=state,
        **common,
    )
    reference = _run(tiny_mla, tmp_path / "reference", max_steps=6, **common)
    assert list(_losses(resumed["log"]).items()) == list(_losses(reference["log"]).items())
    got, want = load_file(out / "model.safetensors"), load_file(tmp_path / "reference" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    source = load_file(tiny_mla[0] / "model.safetensors")
    assert any(not torch.equal(source[k], want[k]) for k in want)

    other = {**common, "teacher": str(out)}
    with pytest.raises(ValueError, match="teacher_hash"):
        _run(tiny_mla, tmp_path / "other", max_steps=6, resume=True, state_dir=state, **other)


# --------------------------------------------------------------------------------------------- LoRA


def test_lora_output_is_a_plain_checkpoint_equal_to_the_peft_model(tiny_mla, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    result = _run(tiny_mla, out, max_steps=3, lora_rank=4, keep_checkpoints=True, eval_tokens=0)
    assert result["lora"] == {
        "rank": 4,
        "targets": ["k_rope_proj", "k_up_proj", "kv_down_proj", "o_proj", "q_proj", "v_up_proj"],
    }
    ((_, ckpt),) = heal_mod.find_checkpoints(tmp_path / "out.heal")
    base = AutoModelForCausalLM.from_pretrained(tiny_mla[0], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, ckpt).eval()
    healed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert healed.config.model_type == "llama_mla" and not hasattr(healed, "peft_config")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert not any("adapter" in p.name for p in out.iterdir())
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, healed(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())

    source, weights = load_file(tiny_mla[0] / "model.safetensors"), load_file(out / "model.safetensors")
    assert source.keys() == weights.keys()
    changed = {k for k in source if not torch.equal(source[k], weights[k])}
    assert changed and all(".self_attn." in k and k.endswith("_proj.weight") for k in changed)


def test_lora_healed_deepseek_layout_stays_exportable(tiny, tmp_path):
    from test_export import deepseek_layout_model
    from transformers import DeepseekV3ForCausalLM

    from hf_attn.conversion import export

    src = tmp_path / "src"
    deepseek_layout_model("llama", vocab_size=512).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny[0] / name, src / name)
    healed = tmp_path / "healed"
    _run((src, *tiny[1:]), healed, max_steps=2, lora_rank=2, lora_targets=["q_proj,o_proj"], eval_tokens=0)
    exported = export.export_checkpoint(src=healed, dst=tmp_path / "exported")
    from transformers import AutoModelForCausalLM

    mla = AutoModelForCausalLM.from_pretrained(healed, dtype=torch.float32).eval()
    vanilla = DeepseekV3ForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = mla(input_ids=ids).logits, vanilla(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
