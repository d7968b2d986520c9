"""`--device auto|cpu|cuda` (`hf_attn.tooling.devices`), on the CPU: every command that can use an accelerator
defaults to auto, auto resolves to the CPU here and to CUDA where torch sees it (mocked: the choice only, no
CUDA work), `--device cuda` without CUDA is one line and exit status 2 with nothing written, and a run says
where it computed on stderr (once) and in its record."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import exit_status, tree_hashes
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks import mla_decode, scale
from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion import refine
from hf_attn.conversion.checkpoint import layerwise
from hf_attn.conversion.specs import CalibrationSpec, resolve_forward
from hf_attn.conversion.training import heal
from hf_attn.conversion.training import state as train_state
from hf_attn.eval import harness, perplexity, study
from hf_attn.tooling import assets, devices
from hf_attn.tooling.cli import run_command
from hf_attn.tooling.errors import UserError

TINY = dict(
    vocab_size=49152,  # SmolLM2's tokenizer
    hidden_size=36,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=6,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
# every command with a --device flag: its main and its name on stderr
COMMANDS = {
    "convert gqa": convert_cli.gqa_main,
    "convert mla": convert_cli.mla_main,
    "refine": refine.main,
    "heal": heal.main,
    "perplexity": perplexity.main,
    "harness": harness.main,
    "study": study.main,
    "benchmarks.scale": scale.main,  # python -m benchmarks.scale (from the checkout)
    "benchmarks.mla_decode": mla_decode.main,
}


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def mocked_cuda(monkeypatch):
    """torch says it sees one CUDA device (nothing may run on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mocked GPU 80GB")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer files, and a text to calibrate, train and score on."""
    root = tmp_path_factory.mktemp("device")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).save_pretrained(root / "tiny")
    for f in assets.smollm2_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, root / "tiny" / f.name)
    text = assets.austen_file("emma").read_text(encoding="utf-8")[:20000]  # not an evaluation text
    (root / "text.txt").write_text(text)
    return root


# ------------------------------------------------------------------------------------------- the rule


def test_auto_is_the_cpu_without_cuda_and_cpu_is_forced(no_cuda):
    assert devices.DEFAULT_DEVICE == "auto" and devices.DEVICES == ("auto", "cpu", "cuda")
    assert devices.resolve_device() == torch.device("cpu")
    assert devices.resolve_device("auto") == devices.resolve_device("cpu") == torch.device("cpu")
    assert resolve_forward("auto", "float32") == (torch.device("cpu"), torch.float32)
    assert layerwise.forward_record("auto", "float32") == {"device": "cpu", "forward_dtype": "float32"}


def test_auto_is_cuda_where_torch_sees_it(mocked_cuda):
    assert devices.resolve_device("auto") == torch.device("cuda")
    assert devices.resolve_device("cuda:0") == torch.device("cuda:0")
    assert devices.resolve_device("cpu") == torch.device("cpu")  # still forced
    assert resolve_forward("auto", "bfloat16") == (torch.device("cuda"), torch.bfloat16)
    assert layerwise.forward_record("auto", "float32")["device"] == "cuda"
    assert CalibrationSpec().device == "auto"  # validated without error: the choice, not CUDA work
    assert devices.describe_device(torch.device("cuda")) == "cuda (Mocked GPU 80GB)"
    with pytest.raises(UserError, match=r"--device cuda:3: torch sees 1 CUDA device"):
        devices.resolve_device("cuda:3")


def test_cuda_without_cuda_and_unknown_names_are_one_line_user_errors(no_cuda):
    with pytest.raises(UserError) as err:
        devices.resolve_device("cuda")
    line = str(err.value)
    assert "\n" not in line and "--device cuda" in line and "--device cpu" in line and "no CUDA" in line
    with pytest.raises(UserError, match=r"Unknown --device 'tpu'; choose one of auto, cpu, cuda"):
        devices.resolve_device("tpu")


@pytest.mark.parametrize("cuda", [False, True])
def test_heal_puts_the_accelerator_where_device_resolves(cuda, monkeypatch):
    """auto -> Accelerator(cpu=not CUDA); --device cpu forces cpu=True (the accelerator itself is a stub)."""
    import accelerate
    from accelerate.state import AcceleratorState

    made = []

    class Stub:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.distributed_type = type("D", (), {"value": "NO"})()
            self.num_processes = 1

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(accelerate, "Accelerator", Stub)
    monkeypatch.setattr(AcceleratorState, "_shared_state", {})
    train_state.make_accelerator("float32", 1)  # the default: auto
    train_state.make_accelerator("float32", 1, "cpu")
    assert [m["cpu"] for m in made] == [not cuda, True]


# ---------------------------------------------------------------------------------- every command


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_defaults_to_auto(name, no_cuda, capsys):
    assert exit_status(COMMANDS[name], ["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    option = re.search(r"--device (\{auto,cpu,cuda\}|DEVICE) (.*?)(?= -{1,2}[a-z]|$)", text)
    assert option is not None, text
    assert "(default: auto)" in option[2] and "auto: CUDA where torch sees it, else the CPU" in option[2]


def _bad_rows(ws: Path) -> list[tuple[str, list[str]]]:
    t, text = str(ws / "tiny"), str(ws / "text.txt")
    out = str(ws / "out")
    return [
        ("convert gqa", ["--model", t, "--output", out, "--num-kv-heads", "1"]),
        ("convert mla", ["--model", t, "--output", out]),
        ("refine", ["--model", t, "--source", t, "--output", out, "--no-progress"]),
        ("heal", ["--model", t, "--output", out, "--train-text", text, "--max-steps", "1"]),
        ("perplexity", ["--model", t, "--context-length", "64", "--output", str(ws / "ppl.json")]),
        ("harness", ["--model", t, "--limit", "2"]),
        ("study", ["--results", str(ws / "results")]),
        ("benchmarks.scale", ["--shapes", "llama-3-8b", "--output", str(ws / "scale")]),
        ("benchmarks.mla_decode", ["--source", t]),
    ]


@pytest.mark.parametrize("name", COMMANDS)
def test_cuda_without_cuda_is_one_line_exit_2_and_writes_nothing(ws, name, no_cuda, capsys, monkeypatch):
    argv = dict(_bad_rows(ws))[name]
    monkeypatch.chdir(ws)
    before = tree_hashes(ws)
    capsys.readouterr()
    assert exit_status(COMMANDS[name], [*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    prog = f"python -m {name}" if name.startswith("benchmarks.") else f"hf-attn {name}"
    assert err.startswith(f"{prog}: error: ") and "--device cuda" in err and "no CUDA" in err, err
    assert tree_hashes(ws) == before


# ------------------------------------------------------------------------------ said once, recorded


def test_the_device_line_is_said_once_per_command_and_only_in_a_command(mocked_cuda, capsys):
    devices.announce_device(torch.device("cuda"))  # a library call: silent
    assert capsys.readouterr().err == ""

    def work() -> None:
        for device in ("cuda", "cuda:0", "cpu", "cpu"):
            devices.announce_device(torch.device(device))

    assert run_command("hf-attn convert mla", work) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["hf-attn convert mla: device cuda (Mocked GPU 80GB)", "hf-attn convert mla: device cpu"]


@pytest.mark.parametrize("native", [False, True])
def test_emulated_bfloat16_is_warned_once_per_command_and_only_in_a_command(native, capsys, monkeypatch):
    monkeypatch.setattr(devices, "native_bfloat16", lambda device: native)
    devices.warn_emulated_bfloat16(torch.device("cpu"), "--autocast-dtype")  # a library call: silent
    assert capsys.readouterr().err == ""

    def work() -> None:
        for flag in ("--autocast-dtype", "--autocast-dtype", "--refine-step-dtype"):
            devices.warn_emulated_bfloat16(torch.device("cpu"), flag)

    assert run_command("hf-attn heal", work) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[2].strip() for line in lines] == (
        [] if native else ["--autocast-dtype bfloat16 on cpu", "--refine-step-dtype bfloat16 on cpu"]
    )


def _said(err: str, prog: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"{prog}: device")]


def test_runs_say_and_record_the_device_they_used(ws, tmp_path, no_cuda, capsys):
    """The default (auto) on this machine: the CPU, said once on stderr and written in every record."""
    t, text = str(ws / "tiny"), str(ws / "text.txt")
    calibration = ["--calibration-text", text, "--calibration-tokens", "256", "--calibration-window", "128"]
    converted = tmp_path / "mqa"
    argv = ["--model", t, "--output", str(converted), "--num-kv-heads", "1", *calibration]
    assert convert_cli.gqa_main([*argv, "--refine-steps", "1", "--refine-tokens", "256"]) == 0
    assert _said(capsys.readouterr().err, "hf-attn convert gqa") == ["hf-attn convert gqa: device cpu"]
    history = json.loads((converted / "config.json").read_text())["hf_attn"]["history"]
    assert [step["settings"]["device"] for step in history] == ["cpu", "cpu"]  # closed form, refinement

    healed = tmp_path / "healed"
    argv = ["--model", str(converted), "--output", str(healed), "--train-text", text, "--eval-tokens", "0"]
    assert heal.main([*argv, "--max-steps", "1", "--seq-len", "32", "--no-progress"]) == 0
    assert _said(capsys.readouterr().err, "hf-attn heal") == ["hf-attn heal: device cpu"]
    record = json.loads((healed / "config.json").read_text())["hf_attn"]["history"][-1]
    assert record["kind"] == "heal" and record["settings"]["device"] == "cpu"

    scored = tmp_path / "ppl.json"
    argv = ["--model", str(healed), "--text", text, "--context-length", "64", "--max-tokens", "128"]
    assert perplexity.main([*argv, "--no-progress", "--output", str(scored)]) == 0
    assert _said(capsys.readouterr().err, "hf-attn perplexity") == ["hf-attn perplexity: device cpu"]
    assert json.loads(scored.read_text())["device"] == "cpu"
