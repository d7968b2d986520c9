"""Healing (`conversion.training.heal`): learning, data parallel equivalence, resume after SIGKILL, frozen
parameters, bad input. A tiny random Llama with a 512-token BPE tokenizer trained here keeps every run to
seconds."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import exit_status
from safetensors.torch import load_file

from hf_attn.conversion.training import heal as heal_mod
from hf_attn.conversion.training.data import (
    ChunkOrder,
    HealSettings,
    check_disjoint,
    load_eval_corpus,
    load_train_corpus,
)
from hf_attn.conversion.training.heal import heal
from hf_attn.conversion.training.recipe import HealRecipe, find_checkpoints, read_log
from hf_attn.tooling import assets, devices
from hf_attn.tooling.files import checkpoint_hash, sha256_file

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
SMALL = dict(seq_len=32, batch_size=4, lr=3e-3, eval_context=64, eval_tokens=640)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, train text file, eval text file): a random 2-layer GQA Llama (4 query / 2 KV heads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("heal")
    train_text = assets.austen_file("emma").read_text()[:40_000]
    eval_text = assets.austen_file("persuasion").read_text()[:12_000]
    (root / "train.txt").write_text(train_text)
    (root / "eval.txt").write_text(eval_text)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([train_text], trainer)
    model_dir = root / "tiny"
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(model_dir)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir, root / "train.txt", root / "eval.txt"


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: tiny matmuls gain nothing from more and lose a lot on a busy shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(tiny, output, **kwargs) -> dict:
    model_dir, train, held_out = tiny
    settings = HealSettings(
        model=model_dir, output=output, train_text=[train], eval_text=[held_out], **{**SMALL, **kwargs}
    )
    return heal(settings, progress=False)


def _losses(log_path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_log(log_path) if e["event"] == "step"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(tiny, output, *extra) -> list[str]:
    model_dir, train, held_out = tiny
    args = ["--model", str(model_dir), "--output", str(output), "--train-text", str(train)]
    args += ["--eval-text", str(held_out), "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3"]
    return [*args, "--eval-context", "64", "--eval-tokens", "640", "--no-progress", *extra]


def _env() -> dict:
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


# --------------------------------------------------------------------------------------------- data


def test_chunk_order_is_seeded_resumable_and_covers_every_chunk():
    full = list(itertools.islice(ChunkOrder(10, seed=3), 35))
    for epoch in range(3):
        assert sorted(full[10 * epoch : 10 * epoch + 10]) == list(range(10))
    assert full[:10] != full[10:20]  # a new permutation each epoch
    for start in (0, 7, 10, 23):
        assert list(itertools.islice(ChunkOrder(10, seed=3, start=start), 35 - start)) == full[start:]
    assert list(itertools.islice(ChunkOrder(10, seed=4), 10)) != full[:10]


def test_default_texts_are_the_five_novels_and_disjoint_from_persuasion():
    train, train_files = load_train_corpus()
    held_out, eval_files = load_eval_corpus()
    assert [p.stem for p in train_files] == list(assets.TRAIN_NOVELS)
    assert [p.stem for p in eval_files] == ["persuasion"]
    check_disjoint(train, train_files, held_out, eval_files)  # raises on overlap


def test_cosine_schedule_warms_up_and_decays_to_ten_percent():
    r = HealRecipe(32, 1, 1, 1, 1e-3, 4, "cosine", 20, 0.0, 1.0, "all", "float32", 0, "x", "y")
    factors = [r.lr_factor(s) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert factors[20] == pytest.approx(0.1)


# --------------------------------------------------------------------------------------------- training


def test_tiny_llama_learns_and_output_has_the_input_format(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = tiny[0]
    result = _run(tiny, tmp_path / "out", max_steps=15)
    losses = _losses(result["log"])
    assert list(losses) == list(range(1, 16))
    assert sum(list(losses.values())[-3:]) / 3 < sum(list(losses.values())[:3]) / 3 - 0.5, losses
    assert result["eval_after"]["perplexity"] < 0.8 * result["eval_before"]["perplexity"]

    # the first step's loss is the source model's loss on the first 4 chunks of the seeded order
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(tiny[1].read_text(), add_special_tokens=False)["input_ids"]
    chunks = torch.tensor(ids[: len(ids) // 32 * 32]).view(-1, 32)  # (N, 32)
    first = chunks[torch.randperm(len(chunks), generator=torch.Generator().manual_seed(0))[:4]]  # (4, 32)
    source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = source(input_ids=first).logits[:, :-1].float()  # (4, 31, V)
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), first[:, 1:].reshape(-1))
    assert losses[1] == pytest.approx(expected.item(), rel=1e-5)

    out = tmp_path / "out"
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (model_dir, out))
    record = out_cfg.pop("hf_attn")
    assert out_cfg == src_cfg
    assert list(record) == ["history"] and len(record["history"]) == 1
    last = record["history"][-1]
    assert last["kind"] == "heal"
    assert last["source_hash"] == checkpoint_hash(model_dir)
    assert last["settings"]["lr"] == 3e-3 and last["settings"]["seq_len"] == 32
    assert last["steps"] == 15 and last["tokens"] == 15 * 4 * 32
    assert last["final_loss"] == pytest.approx(losses[15])
    assert last["train_data"]["corpus"] == "train.txt"
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    healed = AutoModelForCausalLM.from_pretrained(out)
    assert healed.config.model_type == "llama" and healed.dtype == torch.float32
    assert not find_checkpoints(tmp_path / "out.heal")  # checkpoints go once the output is complete


def test_grad_accum_gives_the_same_steps_as_a_larger_batch(tiny, tmp_path):
    a = _run(tiny, tmp_path / "a", max_steps=4, eval_tokens=0)
    b = _run(tiny, tmp_path / "b", max_steps=4, eval_tokens=0, batch_size=2, grad_accum=2)
    la, lb = _losses(a["log"]), _losses(b["log"])
    assert list(la) == list(lb) == [1, 2, 3, 4]
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-4, abs=1e-5)


def test_gradient_checkpointing_changes_nothing_and_max_tokens_rounds_up_to_whole_steps(tiny, tmp_path):
    plain = _run(tiny, tmp_path / "a", max_tokens=300, eval_tokens=0)  # 128 tokens per step -> 3 steps
    ckpt = _run(tiny, tmp_path / "b", max_tokens=300, eval_tokens=0, gradient_checkpointing=True)
    assert plain["steps"] == 3 and plain["tokens"] == 384
    la, lb = _losses(plain["log"]), _losses(ckpt["log"])
    assert list(lb) == [1, 2, 3] and list(lb.values()) == pytest.approx(list(la.values()), rel=1e-5)


def test_relative_lr_moves_each_tensor_by_its_own_scale(tiny, tmp_path):
    """Adam's first step moves every element with a gradient by the group's lr (bias-corrected, |g| >> eps):
    with --relative-lr R each tensor's largest move is R x its RMS before the step (the norms' ones and the
    linear weights' N(0, 0.02) draws differ 50x); with --lr, lr for every tensor."""
    before = load_file(tiny[0] / "model.safetensors")
    for name, kwargs in (("relative", {"relative_lr": 1e-2}), ("absolute", {"lr": 1e-3})):
        _run(tiny, tmp_path / name, max_steps=1, eval_tokens=0, **kwargs)
        after = load_file(tmp_path / name / "model.safetensors")
        for key, w in before.items():
            moved = (after[key].double() - w.double()).abs().max().item()
            expected = 1e-2 * w.double().pow(2).mean().sqrt().item() if name == "relative" else 1e-3
            assert moved == pytest.approx(expected, rel=1e-3), (name, key)


@pytest.fixture(scope="module")
def tiny_mla(tiny, tmp_path_factory):
    """The tiny model's tokenizer with a random `llama_mla` model (latent rank 48, 8 of 16 RoPE pairs)."""
    import shutil

    from hf_attn.models.llama_mla import LlamaMLAConfig, LlamaMLAForCausalLM

    model_dir = tmp_path_factory.mktemp("heal_mla") / "tiny_mla"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny[0] / name, model_dir / name)
    config = LlamaMLAConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        kv_lora_rank=48,
        rope_pairs=4,
    )
    torch.manual_seed(0)
    LlamaMLAForCausalLM(config).save_pretrained(model_dir)
    return (model_dir, *tiny[1:])


@pytest.mark.parametrize("kind", ["llama", "llama_mla"])
def test_trainable_attention_leaves_every_other_parameter_bit_identical(kind, tiny, tiny_mla, tmp_path):
    from transformers import AutoModelForCausalLM

    case = tiny if kind == "llama" else tiny_mla
    _run(case, tmp_path / "out", max_steps=3, trainable="attention", eval_tokens=0)
    before = load_file(case[0] / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    attention = {k for k in before if ".self_attn." in k}
    assert changed == attention  # every attention weight moved, nothing else did
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.model_type == kind


def test_left_out_step_settings_follow_the_checkpoint():
    """--trainable, --seq-len and --lr left out: a per-head llama_mla heals its attention alone on 1,024-token
    chunks at 1.5e-5, the DeepSeek layout (and its export) all parameters on 1,024 at 3e-5, pooled GQA/MQA
    all on 512 at 1e-4, every other checkpoint (and LoRA) all on 512 at 3e-5 (docs/healing.md); a value given
    is kept."""
    left_out = HealSettings(output="o")
    per_head = {"model_type": "llama_mla", "rope_layout": "per_head"}
    chosen = left_out.with_defaults(per_head)
    assert (chosen.trainable, chosen.seq_len, chosen.lr) == ("attention", 1024, 1.5e-5)
    assert left_out.with_defaults({"model_type": "llama_mla"}).trainable == "attention"  # per_head by default
    for config in ({"model_type": "llama_mla", "rope_layout": "shared"}, {"model_type": "deepseek_v3"}):
        chosen = left_out.with_defaults(config)
        assert (chosen.trainable, chosen.seq_len, chosen.lr) == ("all", 1024, 3e-5), config
    pooled = {"hf_attn": {"history": [{"kind": "gqa"}, {"kind": "refine"}, {"kind": "heal"}]}}
    for model_type in ("llama", "qwen2", "mistral"):
        chosen = left_out.with_defaults({"model_type": model_type, **pooled})
        assert (chosen.trainable, chosen.seq_len, chosen.lr) == ("all", 512, 1e-4), model_type
        expanded = {"model_type": model_type, "hf_attn": {"history": [{"kind": "expand"}]}}
        for config in ({"model_type": model_type}, expanded):  # unconverted, or an exact expansion
            chosen = left_out.with_defaults(config)
            assert (chosen.trainable, chosen.seq_len, chosen.lr) == ("all", 512, 3e-5), config
    lora = HealSettings(output="o", lora_rank=4).with_defaults(per_head)
    assert (lora.trainable, lora.seq_len, lora.lr) == ("all", 512, 3e-5)
    given = HealSettings(output="o", trainable="all", seq_len=64, lr=1e-3).with_defaults(per_head)
    assert (given.trainable, given.seq_len, given.lr) == ("all", 64, 1e-3)
    assert HealSettings(output="o", lr=2e-5).with_defaults(per_head).lr == 2e-5


@pytest.mark.parametrize("kind", ["llama", "llama_mla"])
def test_heal_without_trainable_trains_what_the_checkpoint_calls_for(kind, tiny, tiny_mla, tmp_path):
    """Left out, --trainable is `attention` for a per-head llama_mla (nothing else moves) and `all` for a
    Llama (every tensor moves); the record names the choice."""
    case = tiny if kind == "llama" else tiny_mla
    result = _run(case, tmp_path / "out", max_steps=2, eval_tokens=0)
    before = load_file(case[0] / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    attention = {k for k in before if ".self_attn." in k}
    assert changed == (attention if kind == "llama_mla" else set(before))
    assert result["settings"]["trainable"] == ("attention" if kind == "llama_mla" else "all")
    assert (result["settings"]["seq_len"], result["settings"]["lr"]) == (SMALL["seq_len"], SMALL["lr"])


def test_two_processes_follow_the_one_process_trajectory(tiny, tmp_path):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two data-parallel processes need two GPUs on a CUDA machine (CPU: gloo)")
    one = _run(tiny, tmp_path / "one", max_steps=4, batch_size=4)
    cmd = [
        PYTHON,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
    ]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    extra = ["--batch-size", "2", "--max-steps", "4", "--checkpoint-every", "2", "--keep-checkpoints"]
    cmd += ["-m", "conversion.training", *_cli(tiny, tmp_path / "two", *extra)]
    res = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    log = read_log(tmp_path / "two.heal" / "log.jsonl")
    assert log[0]["recipe"]["num_processes"] == 2 and log[0]["recipe"]["batch_size"] == 2
    one_losses, two_losses = _losses(one["log"]), _losses(tmp_path / "two.heal" / "log.jsonl")
    assert list(two_losses) == [1, 2, 3, 4]
    for step, loss in one_losses.items():
        assert two_losses[step] == pytest.approx(loss, rel=1e-4, abs=1e-5)
    ((step, ckpt),) = find_checkpoints(tmp_path / "two.heal")
    saved = torch.load(ckpt / heal_mod.STATE_FILE, weights_only=False)
    assert step == 4 and len(saved["rng"]) == 2 and saved["data_position"] == 16
    two_evals = [e["perplexity"] for e in log if e["event"] == "eval"]
    assert two_evals == pytest.approx(
        [one["eval_before"]["perplexity"], one["eval_after"]["perplexity"]], rel=1e-4
    )


def test_resume_after_sigkill_continues_the_uninterrupted_trajectory(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    steps = 90
    out, state = tmp_path / "killed", tmp_path / "killed.heal"
    cmd = [
        PYTHON,
        "-m",
        "conversion.training",
        *_cli(tiny, out, "--max-steps", str(steps), "--checkpoint-every", "3"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (state / "log.jsonl").exists() and max(_losses(state / "log.jsonl"), default=0) >= 7:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not out.exists()
    checkpoints = find_checkpoints(state)
    killed_at, ckpt = checkpoints[-1]  # (an older one survives only if killed while deleting it)
    assert killed_at >= 6 and killed_at % 3 == 0
    AutoModelForCausalLM.from_pretrained(ckpt)  # the last complete checkpoint loads as a model
    saved = torch.load(ckpt / heal_mod.STATE_FILE, weights_only=False)
    assert saved["step"] == killed_at and saved["data_position"] == killed_at * 4

    with pytest.raises(FileExistsError, match="--resume"):
        _run(tiny, out, max_steps=steps)
    resumed = _run(tiny, out, max_steps=steps, checkpoint_every=3, resume=True)
    reference = _run(tiny, tmp_path / "reference", max_steps=steps)
    got, want = _losses(resumed["log"]), _losses(reference["log"])
    assert list(got) == list(want) == list(range(1, steps + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
    assert resumed["eval_after"]["perplexity"] == pytest.approx(
        reference["eval_after"]["perplexity"], rel=1e-5
    )
    assert resumed["eval_before"] == pytest.approx(reference["eval_before"])
    assert [e["event"] for e in read_log(resumed["log"])].count("resume") == 1


# --------------------------------------------------------------------------------------------- bad input


def _fails(capsys, argv) -> str:
    assert exit_status(heal_mod.main, argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]  # (progress bars of `datasets` aside)
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_inputs_give_one_line_errors(tiny, tmp_path, capsys):
    model_dir, train, held_out = tiny
    base = ["--model", str(model_dir), "--eval-context", "64", "--eval-tokens", "640", "--seq-len", "32"]
    out = ["--output", str(tmp_path / "out")]
    (tmp_path / "empty.txt").write_text("")
    assert "empty" in _fails(capsys, [*base, *out, "--train-text", str(tmp_path / "empty.txt")])
    (tmp_path / "short.txt").write_text("A few words only.")
    assert "too short" in _fails(capsys, [*base, *out, "--train-text", str(tmp_path / "short.txt")])
    err = _fails(capsys, [*base, *out, "--train-text", str(held_out), "--eval-text", str(held_out)])
    assert "also the evaluation text" in err
    (tmp_path / "copy.txt").write_text(held_out.read_text())
    err = _fails(
        capsys, [*base, *out, "--train-text", str(tmp_path / "copy.txt"), "--eval-text", str(held_out)]
    )
    assert "same content" in err
    (tmp_path / "mixed.txt").write_text(train.read_text() + "\n\n" + held_out.read_text()[2000:6000])
    err = _fails(
        capsys, [*base, *out, "--train-text", str(tmp_path / "mixed.txt"), "--eval-text", str(held_out)]
    )
    assert "share" in err and "paragraph" in err
    assert "--trainable" in _fails(capsys, [*base, *out, "--train-text", str(train), "--trainable", "mlp"])
    with pytest.raises(ValueError, match="Unknown --trainable 'mlp'"):  # the library checks it too
        HealSettings(output=str(tmp_path / "o"), trainable="mlp").validate()
    (tmp_path / "file").write_text("not a directory")
    err = _fails(capsys, [*base, "--output", str(tmp_path / "file" / "out"), "--train-text", str(train)])
    assert "not writable" in err
    (tmp_path / "exists").mkdir()
    assert "--overwrite" in _fails(
        capsys, [*base, "--output", str(tmp_path / "exists"), "--train-text", str(train)]
    )
    err = _fails(
        capsys, [*base, *out, "--train-text", str(train), "--max-minutes", "1", "--schedule", "cosine"]
    )
    assert "step budget" in err
    err = _fails(capsys, [*base, *out, "--train-text", str(train), "--relative-lr", "0"])
    assert "--relative-lr must be positive, got 0.0" in err
    assert "not allowed with" in _fails(capsys, [*base, *out, "--lr", "1e-4", "--relative-lr", "1e-3"])
    assert not (tmp_path / "out").exists()


def test_cli_error_is_one_line_without_traceback(tiny, tmp_path):
    cmd = [PYTHON, "-m", "conversion.training", *_cli(tiny, tmp_path / "o", "--trainable", "mlp")]
    res = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr and res.stderr.strip().splitlines()[-1].startswith(
        "hf-attn heal: error:"
    )


def test_time_budget_stops_at_the_first_step_past_it_and_resumes_with_a_larger_one(tiny, tmp_path):
    state = tmp_path / "state"
    common = dict(
        schedule="constant", eval_tokens=0, budget_clock="cpu", state_dir=state, keep_checkpoints=True
    )
    first = _run(tiny, tmp_path / "a", max_minutes=0.005, **common)  # 0.3 s of CPU time
    log = [e for e in read_log(first["log"]) if e["event"] == "step"]
    assert log[-1]["train_cpu_seconds"] >= 0.3 > log[-2]["train_cpu_seconds"]
    assert find_checkpoints(state)[-1][0] == first["steps"]  # the final checkpoint a longer run resumes from
    second = _run(tiny, tmp_path / "b", max_minutes=0.01, resume=True, **common)
    log = [e for e in read_log(second["log"]) if e["event"] == "step"]
    assert [e["step"] for e in log] == list(range(1, second["steps"] + 1))
    assert log[-1]["train_cpu_seconds"] >= 0.6 > log[-2]["train_cpu_seconds"]
    reference = _run(tiny, tmp_path / "c", max_steps=second["steps"], schedule="constant", eval_tokens=0)
    assert [e["loss"] for e in log] == pytest.approx(list(_losses(reference["log"]).values()), rel=1e-5)


def test_bfloat16_checkpoint_stays_bfloat16_and_bf16_autocast_trains(tiny, tmp_path, capsys):
    """... and the command warns once that bfloat16 is emulated where oneDNN has no kernels for this CPU."""
    import shutil

    from transformers import AutoModelForCausalLM

    src = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.bfloat16).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny[0] / name, src / name)
    with devices.announcing("hf-attn heal"):
        result = _run(
            (src, *tiny[1:]), tmp_path / "out", max_steps=6, autocast_dtype="bfloat16", eval_tokens=0
        )
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning: --autocast-dtype" in line]
    assert len(warned) == (0 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 1)
    losses = list(_losses(result["log"]).values())
    assert losses[-1] < losses[0]
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_output_over_inside_or_around_the_source_is_refused_before_training(tiny, tmp_path, capsys):
    import shutil

    src = tmp_path / "parent" / "src"
    shutil.copytree(tiny[0], src)

    def hashes() -> dict:
        return {
            str(p.relative_to(tmp_path)): sha256_file(p) for p in sorted(tmp_path.rglob("*")) if p.is_file()
        }

    before = hashes()
    base = ["--model", str(src), "--train-text", str(tiny[1]), "--max-steps", "2", "--overwrite"]
    for output, where in ((src, "is"), (src / "healed", "is inside"), (src.parent, "contains")):
        err = _fails(capsys, [*base, "--output", str(output)])
        assert f"--output {output.resolve()} {where} the source checkpoint {src.resolve()}" in err, err
    assert hashes() == before  # nothing written, nothing trained: the source's files are unchanged
    assert not (tmp_path / "parent" / "src.heal").exists()


def test_deprecated_dtype_flag_still_sets_the_autocast_dtype():
    parser = heal_mod.build_parser()
    args = parser.parse_args(["--output", "o", "--dtype", "bfloat16"])
    assert (
        HealSettings(**{k: v for k, v in vars(args).items() if k != "no_progress"}).autocast_dtype
        == "bfloat16"
    )
    assert parser.parse_args(["--output", "o"]).autocast_dtype == "float32"
    assert "--autocast-dtype" in parser.format_help() and "--dtype" not in parser.format_help()
