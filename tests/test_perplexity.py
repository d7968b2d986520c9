"""Perplexity evaluation on the real SmolLM2 and the first tokens of *Persuasion*, checked against an
independent loop written here (the Transformers perplexity guide, loss from the model's `labels=` path)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import exit_status
from transformers import AutoModelForCausalLM, AutoTokenizer, ViTConfig

from hf_attn.eval import perplexity
from hf_attn.tooling import perplexity as core
from hf_attn.tooling.corpus import load_corpus, tokenize

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 256
N_DISJOINT = 1200  # 4 full windows + a 176-token tail
N_SLIDING, STRIDE = 1000, 192  # 5 windows, the last one 232 tokens


def reference_nll(model, ids: torch.Tensor, context: int, stride: int) -> tuple[float, int]:
    """The guide's loop, one window at a time: labels -100 on already scored tokens, mean loss * count."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + context, ids.numel())
        x = ids[begin:end].unsqueeze(0)
        labels = x.clone()
        labels[:, : -(end - prev_end)] = -100
        with torch.no_grad():
            loss = model(input_ids=x, labels=labels).loss
        scored = int((labels[:, 1:] != -100).sum())
        nll += loss.double().item() * scored
        count += scored
        prev_end = end
        if end == ids.numel():
            break
    return nll, count


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def ids(tokenizer, persuasion_path):
    """Persuasion tokenized here, independently of eval.corpus (plain file read, no special tokens)."""
    text = persuasion_path.read_text(encoding="utf-8")
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:N_DISJOINT])


@pytest.fixture(scope="module")
def sdpa_model(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def run_cli(args: list[str], *, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = (launcher or [sys.executable]) + ["-m", "eval.perplexity", "--no-progress", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


# ----------------------------------------------------------------------------------------------- protocol


@pytest.mark.parametrize(
    "n,context,stride", [(10, 4, 4), (11, 4, 4), (13, 4, 1), (13, 5, 3), (9, 9, 9), (30, 8, 5)]
)
def test_windows_score_what_the_guide_scores(n, context, stride):
    """Scored target positions per window equal those of the guide's label masking."""
    expected, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        labels = [-100 if j < end - (end - prev_end) else j for j in range(begin, end)]
        expected.append([t for t in labels[1:] if t != -100])  # the model's shift drops the first label
        prev_end = end
        if end == n:
            break
    got = [list(range(w.score_from, w.end)) for w in core.plan_windows(n, context, stride)]
    assert got == [e for e in expected if e]
    scored = sorted(t for w in got for t in w)
    assert len(scored) == len(set(scored))
    if stride < context:
        assert scored == list(range(1, n))


def test_batches_group_equal_shapes():
    windows = core.plan_windows(1000, 256, 192)
    batches = core.plan_batches(windows, 2)
    assert [len(b) for b in batches] == [1, 2, 1, 1]  # first window, two full ones, one full, the short tail
    assert [w for b in batches for w in b] == windows


def test_corpus_reads_file_unchanged(persuasion_path, tmp_path):
    corpus = load_corpus()
    assert corpus.text == persuasion_path.read_text(encoding="utf-8")
    assert corpus.name == "persuasion.txt"
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first\n"), b.write_text("second")
    assert load_corpus([a, b]).text == "first\n\n\nsecond"


def test_tokenize_adds_no_special_tokens(tokenizer):
    assert (
        tokenize(tokenizer, "Anne Elliot").tolist()
        == tokenizer("Anne Elliot", add_special_tokens=False)["input_ids"]
    )
    assert (
        tokenize(tokenizer, "Anne Elliot").tolist() == tokenizer("Anne Elliot")["input_ids"]
    )  # SmolLM2: no BOS


# ------------------------------------------------------------------------------------- against the reference


@pytest.fixture(scope="module")
def cli_disjoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppl") / "one.json"
    res = run_cli(["--max-tokens", str(N_DISJOINT), "--context-length", str(CONTEXT), "--output", str(out)])
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(out.read_text())


def test_cli_equals_reference_disjoint(cli_disjoint, sdpa_model, ids, persuasion_path):
    nll, count = reference_nll(sdpa_model, ids, CONTEXT, CONTEXT)
    assert cli_disjoint["tokens_scored"] == count == N_DISJOINT - 5
    assert rel(cli_disjoint["nll_sum"], nll) < 1e-4
    assert rel(cli_disjoint["perplexity"], torch.tensor(nll / count).exp().item()) < 1e-4
    assert (cli_disjoint["context_length"], cli_disjoint["stride"]) == (CONTEXT, CONTEXT)
    assert cli_disjoint["corpus"] == "persuasion.txt"
    assert cli_disjoint["calibrated_on_scored_text"] == []  # the shipped model was not calibrated at all


def test_calibrated_on_names_scored_files_a_conversion_step_read(tmp_path):
    scored, other = tmp_path / "scored.txt", tmp_path / "other.txt"
    scored.write_text("the evaluation text\n")
    other.write_text("calibration text\n")
    copy = tmp_path / "copy.txt"
    copy.write_text("the evaluation text\n")  # same content under another name: still the scored text
    digest = lambda f: hashlib.sha256(f.read_bytes()).hexdigest()  # noqa: E731
    files = lambda *fs: {"files": [{"name": f.name, "sha256": digest(f)} for f in fs]}  # noqa: E731
    history = [
        {"kind": "mla", "calibration": files(other, copy)},
        {"kind": "refine", "calibration": files(other)},
        {"kind": "heal", "settings": {}},  # no calibration entry
    ]
    assert perplexity.calibrated_on(history, [scored]) == ["scored.txt (mla)"]
    assert perplexity.calibrated_on(history, [other]) == ["other.txt (mla)", "other.txt (refine)"]
    assert perplexity.calibrated_on([], [scored]) == []


@pytest.fixture(scope="module")
def api_sliding(sdpa_model, ids):
    return core.evaluate_perplexity(
        sdpa_model,
        ids,
        context_length=CONTEXT,
        stride=STRIDE,
        batch_size=2,
        max_tokens=N_SLIDING,
        progress=False,
    )


def test_api_equals_reference_sliding(api_sliding, sdpa_model, ids):
    nll, count = reference_nll(sdpa_model, ids[:N_SLIDING], CONTEXT, STRIDE)
    assert api_sliding.tokens_scored == count == N_SLIDING - 1
    assert rel(api_sliding.nll_sum, nll) < 1e-4
    assert api_sliding.windows == 5 and api_sliding.stride == STRIDE


def test_two_processes_equal_one(cli_disjoint, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on a CPU-only machine: two gloo CPU processes."""
    if torch.accelerator.is_available():
        pytest.skip("the two-process test is written for CPU-only machines")
    out = tmp_path / "two.json"
    launcher = [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
    ]
    args = ["--max-tokens", str(N_DISJOINT), "--context-length", str(CONTEXT), "--output", str(out)]
    res = subprocess.run(
        launcher + ["-m", "eval.perplexity", "--no-progress", *args],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    two = json.loads(out.read_text())
    assert two["processes"] == 2
    assert two["tokens_scored"] == cli_disjoint["tokens_scored"]
    assert rel(two["nll_sum"], cli_disjoint["nll_sum"]) < 1e-6


def test_grouped_equals_sdpa(api_sliding, persuasion_path):
    grouped = perplexity.run(
        perplexity.PerplexitySettings(
            attn_implementation="hf_attn_grouped",
            texts=[persuasion_path],
            context_length=CONTEXT,
            stride=STRIDE,
            max_tokens=N_SLIDING,
            progress=False,
        )
    )
    assert grouped["attn_implementation"] == "hf_attn_grouped"
    assert grouped["tokens_scored"] == api_sliding.tokens_scored
    assert rel(grouped["perplexity"], api_sliding.perplexity) < 1e-4


# ------------------------------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text(" \n\n \n")
    (d / "short.txt").write_text("Anne was persuaded.\n")
    (d / "nomodel").mkdir()
    vit = ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
    vit.save_pretrained(d / "vit")  # a vision encoder: no causal-LM class
    return d


BAD = {
    "missing text": (["--text", "{d}/nope.txt"], "does not exist"),
    "empty text": (["--text", "{d}/empty.txt"], "empty"),
    "blank text": (["--text", "{d}/blank.txt"], "empty"),
    "short corpus": (["--text", "{d}/short.txt", "--context-length", "64"], "fewer than one window"),
    "stride zero": (["--stride", "0"], "stride"),
    "stride > context": (["--context-length", "64", "--stride", "65"], "stride"),
    "context > max positions": (["--context-length", "9000"], "maximum positions (8192)"),
    "unknown attention": (["--attn-implementation", "nope"], ("eager, sdpa", "hf_attn_grouped")),
    "no config": (["--model", "{d}/nomodel"], "has no config.json"),
    "not causal": (["--model", "{d}/vit"], "not a causal LM"),
    "missing dataset": (["--dataset", "no_such_dataset_hf_attn"], "Could not load dataset"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_clear_error(case, bad_inputs, capsys):
    argv, message = BAD[case]
    assert exit_status(perplexity.main, [a.format(d=bad_inputs) for a in argv] + ["--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hf-attn perplexity: error:"), err
    for part in (message,) if isinstance(message, str) else message:
        assert part in err, err


@pytest.mark.parametrize("case", ["unknown attention", "not causal"])
def test_bad_input_cli_no_traceback(case, bad_inputs):
    argv, message = BAD[case]
    res = run_cli([a.format(d=bad_inputs) for a in argv])
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    for part in (message,) if isinstance(message, str) else message:
        assert part in res.stderr.strip().splitlines()[-1]


def test_tokenize_remembers_per_tokenizer_and_text(smollm2_path):
    """The in-process memo gives the tokenizer's own ids, a copy each time, never another tokenizer's."""
    text = "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who never took up any book."
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    reference = tok(text, add_special_tokens=False)["input_ids"]
    first = tokenize(tok, text)
    first[0] = -1  # a caller may change its copy
    assert tokenize(tok, text).tolist() == reference
    other = AutoTokenizer.from_pretrained(smollm2_path)
    other.add_tokens(["Kellynch"])  # a different tokenizer: its own ids, not the remembered ones
    assert tokenize(other, text).tolist() == other(text, add_special_tokens=False)["input_ids"] != reference


# ------------------------------------------------------------------------------------ settings and flags


def test_parser_is_built_from_the_settings():
    """Every settings field has its flag; `--dtype` is the hidden deprecated spelling of `--load-dtype`."""
    parse = perplexity.build_parser().parse_args
    default = perplexity.settings_from_args(perplexity.PerplexitySettings, parse([]))
    assert default == perplexity.PerplexitySettings()
    new = perplexity.settings_from_args(perplexity.PerplexitySettings, parse(["--load-dtype", "bfloat16"]))
    old = perplexity.settings_from_args(perplexity.PerplexitySettings, parse(["--dtype", "bfloat16"]))
    assert new.load_dtype == old.load_dtype == "bfloat16"
    args = parse(["--text", "a.txt", "b.txt", "--no-progress", "--context-length", "64"])
    assert (args.texts, args.progress, args.context_length) == (["a.txt", "b.txt"], False, 64)
    assert "--dtype" not in perplexity.build_parser().format_help()
    with pytest.raises(SystemExit):
        parse(["--text", "a.txt", "--dataset", "wikitext"])  # one corpus source at a time
