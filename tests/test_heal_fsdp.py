"""Healing under FSDP2 (`accelerate launch --config_file conversion/training/heal_fsdp.yaml`), 2 gloo
processes on CPU.

Reference: the same global batch healed by one plain process (no sharding, no launcher), which the sharded run
must reproduce to float tolerance, weights, losses, held-out perplexity and config alike. The sharded run is
stopped after one step (with its final checkpoint: full weights + full optimizer state) and resumed for the
second, so the same comparison also checks resume under sharding (a lost Adam state would change step 2).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from test_heal import PYTHON, REPO, SMALL, _env, _free_port, _losses, _run, tiny  # noqa: F401
from test_heal import tiny_mla as tiny_mla_fixture

from hf_attn.conversion.training import heal as heal_mod
from hf_attn.conversion.training.recipe import find_checkpoints, read_log

# float32: the sharded and the plain run differ only in reduction order, which AdamW's normalisation
# m / sqrt(v) amplifies where a gradient nearly cancels (seen: up to 1.9e-5, typical updates 5e-3 at lr 3e-3).
# Without the restored Adam moments step 2 would be a fresh-Adam step (about +-lr per element) instead of one
# mixing both steps' gradients: far outside the tolerance.
TOLERANCE = 1e-4


def _launch(case, output, *extra):
    model_dir, train, held_out = case
    cmd = [PYTHON, "-m", "accelerate.commands.launch", "--config_file", str(heal_mod.FSDP_CONFIG)]
    cmd += ["--num_processes", "2", "--main_process_port", str(_free_port())]
    cmd += ["-m", "hf_attn.conversion.training"]
    cmd += ["--model", str(model_dir), "--output", str(output), "--train-text", str(train)]
    cmd += ["--eval-text", str(held_out), "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3"]
    cmd += ["--eval-context", "64", "--eval-tokens", "640", "--schedule", "constant", "--no-progress", *extra]
    res = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]


tiny_mla = tiny_mla_fixture  # (the fixtures of test_heal: a random llama_mla and the texts)


def test_fsdp_two_processes_match_one_process_and_resume(tiny_mla, tmp_path):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch was built without torch.distributed / the gloo backend")
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two FSDP processes need two GPUs on a CUDA machine (CPU: gloo)")
    assert SMALL["batch_size"] == 4  # the reference's global batch = 2 processes x --batch-size 2
    one = _run(tiny_mla, tmp_path / "one", max_steps=2, schedule="constant")

    out = tmp_path / "fsdp"
    _launch(tiny_mla, out, "--max-steps", "1", "--keep-checkpoints")
    log = read_log(out.with_name("fsdp.heal") / "log.jsonl")
    assert log[0]["distributed"] == "FSDP" and log[0]["recipe"]["num_processes"] == 2
    ((step, ckpt),) = find_checkpoints(out.with_name("fsdp.heal"))
    saved = torch.load(ckpt / heal_mod.STATE_FILE, weights_only=False)
    assert step == 1 and saved["optimizer"]["state"]  # the full optimizer state reached the main process
    assert load_file(ckpt / "model.safetensors").keys() == load_file(tiny_mla[0] / "model.safetensors").keys()

    _launch(tiny_mla, out, "--max-steps", "2", "--resume", "--overwrite")
    events = [e["event"] for e in read_log(out.with_name("fsdp.heal") / "log.jsonl")]
    assert events.count("resume") == 1

    got, want = _losses(out.with_name("fsdp.heal") / "log.jsonl"), _losses(one["log"])
    assert list(got) == list(want) == [1, 2]
    assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5)
    source = load_file(tiny_mla[0] / "model.safetensors")
    healed = load_file(out / "model.safetensors")
    reference = load_file(tmp_path / "one" / "model.safetensors")
    assert healed.keys() == reference.keys()
    for name in reference:
        assert healed[name].dtype == reference[name].dtype
        torch.testing.assert_close(healed[name], reference[name], rtol=0, atol=TOLERANCE, msg=name)
    moved = max((reference[k] - source[k]).abs().max().item() for k in source)
    assert moved > 20 * TOLERANCE  # the comparison can fail: training moved the weights far more

    config, reference_config = (json.loads((d / "config.json").read_text()) for d in (out, tmp_path / "one"))
    record = config.pop("hf_attn")["history"][-1]
    reference_config.pop("hf_attn")
    assert config == reference_config  # same model type, architectures, dtype
    assert record["kind"] == "heal" and record["num_processes"] == 2 and record["steps"] == 2
    assert record["eval_after"]["perplexity"] == pytest.approx(one["eval_after"]["perplexity"], rel=1e-5)


def test_fsdp_with_a_replicated_teacher_matches_one_process(tiny_mla, tmp_path, request):
    """The teacher (the tiny Llama, same tokenizer) stays whole on every process beside the sharded student:
    the KL losses and the weights equal one plain process's."""
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch was built without torch.distributed / the gloo backend")
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two FSDP processes need two GPUs on a CUDA machine (CPU: gloo)")
    teacher = str(request.getfixturevalue("tiny")[0])  # (test_heal's tiny Llama)
    one = _run(tiny_mla, tmp_path / "one", max_steps=2, schedule="constant", teacher=teacher, eval_tokens=0)
    out = tmp_path / "fsdp"
    _launch(tiny_mla, out, "--max-steps", "2", "--teacher", teacher)
    log = read_log(out.with_name("fsdp.heal") / "log.jsonl")
    assert log[0]["distributed"] == "FSDP"
    got = [e["kl"] for e in log if e["event"] == "step"]
    want = [e["kl"] for e in read_log(one["log"]) if e["event"] == "step"]
    assert got == pytest.approx(want, rel=1e-5) and len(want) == 2 and min(want) > 0
    healed = load_file(out / "model.safetensors")
    reference = load_file(tmp_path / "one" / "model.safetensors")
    for name in reference:
        torch.testing.assert_close(healed[name], reference[name], rtol=0, atol=TOLERANCE, msg=name)
    record = json.loads((out / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["teacher"] == teacher and record["num_processes"] == 2
