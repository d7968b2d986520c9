"""The main job end to end on the real embedded default, with tiny budgets (every row, few tokens)."""

import json
import shutil

import pytest

from hf_attn.eval.study import DEFAULT_CONFIG, code_hash, load_config, run_study

TINY = {
    "eval_tokens": 256,
    "context_length": 128,
    "decode_prompt_tokens": 64,
    "decode_new_tokens": 4,
    "calibration_tokens": 512,
    "heal_minutes": 0.05,
    "heal_seq_len": 64,
    "heal_batch_size": 1,
    "task_items": 2,
    "refine_steps": 1,
    "refine_tokens": 128,
}


def study(root, **kwargs):
    return run_study(
        profile="quick", results=root / "results", store=root / "store", overrides=TINY, **kwargs
    )


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    # Discarding keeps the test's disk use near two checkpoints (~1 GB) instead of thirteen.
    yield root, study(root, keep_checkpoints=False)
    shutil.rmtree(root, ignore_errors=True)


def test_every_row_is_reported(first_run):
    root, record = first_run
    _, variants = load_config(DEFAULT_CONFIG, "quick")
    expected = [v.name for v in variants] + [v.name + "+healed" for v in variants if v.heal]
    names = [r["name"] for r in record["rows"]]
    assert sorted(names) == sorted(expected)
    failed = {r["name"]: r["error"] for r in record["rows"] if "error" in r}
    assert not failed, failed
    report = (root / "results" / "report.md").read_text()
    for r in record["rows"]:
        assert r["label"] in report
    assert (root / "results" / "pareto.png").stat().st_size > 10_000
    saved = json.loads((root / "results" / "results.json").read_text())
    assert [r["name"] for r in saved["rows"]] == names


def test_rows_are_consistent(first_run):
    _, record = first_run
    rows = {r["name"]: r for r in record["rows"]}
    src, mha, mqa = rows["source"], rows["mha"], rows["mqa-mean"]
    # Independent facts: the MHA expansion is exact and caches 3x; MQA caches a third (9 -> 3 -> 1 KV heads).
    assert mha["perplexity"] == pytest.approx(src["perplexity"], rel=1e-4)
    assert mha["kv_bytes_per_token"] == 3 * src["kv_bytes_per_token"]
    assert mqa["kv_bytes_per_token"] * 3 == src["kv_bytes_per_token"]
    assert src["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4  # layers * (K, V) * KV heads * head_dim * fp32
    # The accuracy column: the same model scores the same (an exact identity), every score is a fraction.
    assert mha["lastword_acc"] == src["lastword_acc"]
    assert all(
        0 <= r["lastword_acc"] <= 1 and r["task_items"] == {"persuasion_lastword": 2} for r in rows.values()
    )
    for name in ("mla-50", "mla-25", "mla-12"):
        assert rows[name]["kv_fraction"] <= {"mla-50": 0.5, "mla-25": 0.25, "mla-12": 0.125}[name] + 1e-9


def test_second_run_reuses_the_cache(first_run):
    root, _ = first_run
    # Every checkpoint of the first run was discarded once measured ...
    assert list((root / "store").iterdir()) == []
    # ... and the same results directory resumes every row without converting or healing again.
    record = study(root, keep_checkpoints=False)
    assert all(r.get("resumed") for r in record["rows"])
    assert record["counts"] == {"converted": 0, "healed": 0, "reused": 0}


def test_kept_checkpoints_are_reused_by_a_new_results_dir(tmp_path):
    first = study(tmp_path, only=["mqa-mean"])
    assert first["counts"] == {"converted": 1, "healed": 1, "reused": 0}
    kept = sorted(p.name.split("-")[-2] for p in (tmp_path / "store").iterdir() if p.suffix != ".heal")
    assert kept == ["healed", "mean"]  # the converted and the healed checkpoint, kept by default
    # Without a source row the fraction still compares with the source's cache: MQA keeps 1 of 3 KV heads.
    assert [r["kv_fraction"] for r in first["rows"]] == pytest.approx([1 / 3, 1 / 3])
    # New rows (another results dir), same store: both checkpoints are reused, not rebuilt.
    again = run_study(
        profile="quick",
        results=tmp_path / "again",
        store=tmp_path / "store",
        overrides=TINY,
        only=["mqa-mean"],
    )
    assert again["counts"] == {"converted": 0, "healed": 0, "reused": 2}
    assert not any(r.get("resumed") for r in again["rows"])
    for a, b in zip(first["rows"], again["rows"], strict=True):
        assert b["perplexity"] == pytest.approx(a["perplexity"], rel=1e-6)


def test_a_failing_variant_is_reported_not_fatal(tmp_path):
    config = tmp_path / "study.toml"
    config.write_text(
        DEFAULT_CONFIG.read_text().split("[[variants]]")[0]
        + '[[variants]]\nname = "source"\nkind = "source"\n'
        + '[[variants]]\nname = "bad"\nkind = "gqa"\nnum_kv_heads = 2\nmethod = "mean"\nheal = true\n'
    )
    record = study(tmp_path, config=config)
    rows = {r["name"]: r for r in record["rows"]}
    assert "error" not in rows["source"] and rows["source"]["perplexity"] > 1
    assert "2" in rows["bad"]["error"] and "3" in rows["bad"]["error"]  # names the offending head counts
    assert "error" in rows["bad+healed"]
    assert "FAILED" in (tmp_path / "results" / "report.md").read_text()


def test_code_hash_follows_the_source(tmp_path, monkeypatch):
    pkg = tmp_path / "hashed_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = code_hash(("hashed_pkg",))
    assert code_hash(("hashed_pkg",)) == before
    (pkg / "sub" / "mod.py").write_text("X = 2\n")  # a nested file of the package counts
    assert code_hash(("hashed_pkg",)) != before


def test_an_unknown_heal_corpus_is_refused(tmp_path):
    config = tmp_path / "study.toml"
    text = DEFAULT_CONFIG.read_text()
    assert 'heal_corpus = "mix"' in text
    config.write_text(text.replace('heal_corpus = "mix"', 'heal_corpus = "wikipedia"'))
    with pytest.raises(ValueError, match="heal_corpus 'wikipedia'.*austen"):
        load_config(config, "default")
