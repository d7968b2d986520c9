"""The main job end to end on the real embedded default, with tiny budgets (every row, few tokens).

One study over the real variant list (plus a failing variant ahead of them) keeps its checkpoints; the other
tests resume its rows and reuse its store instead of converting or healing again."""

import contextlib
import json
import re
import shutil

import pytest

from hf_attn.eval import study as study_module
from hf_attn.eval.study import DEFAULT_CONFIG, code_hash, load_config, run_study

TINY = {
    "eval_tokens": 128,  # two 64-token windows: enough for the exact identities checked below
    "context_length": 64,
    "decode_prompt_tokens": 32,
    "decode_new_tokens": 4,
    "calibration_tokens": 512,
    "heal_minutes": 0.02,  # the loop always takes one step; one is enough for a healed row
    "heal_seq_len": 64,
    "heal_batch_size": 1,
    "task_items": 2,
    "refine_steps": 1,
    "refine_tokens": 128,
}
# A variant whose conversion fails while it runs (`failing_bad_variant`): the study must report it and go on.
BAD = '[[variants]]\nname = "bad"\nkind = "gqa"\nnum_kv_heads = 1\nmethod = "mean"\nheal = true\n\n'


def study(root, results="results", **kwargs):
    return run_study(profile="quick", results=root / results, store=root / "store", overrides=TINY, **kwargs)


@contextlib.contextmanager
def failing_bad_variant():
    """The conversion of the variant `bad` raises, as one that runs out of memory does (bad options are
    refused before any variant runs, so only such a failure reaches the table)."""
    real = study_module.convert

    def convert(variant, **kwargs):
        if variant.name == "bad":
            raise RuntimeError("the conversion ran out of memory")
        return real(variant, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(study_module, "convert", convert)
        yield


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    header, variants = DEFAULT_CONFIG.read_text().split("[[variants]]", 1)
    header = re.sub(r"(?m)^variants = .*$", "", header)  # every variant, not the quick profile's choice
    config = root / "study.toml"
    config.write_text(header + BAD + "[[variants]]" + variants)  # the failing variant first
    # Keeps every checkpoint (~13 x 0.5 GB, deleted with the fixture) for the reuse tests below.
    with failing_bad_variant():
        record = study(root, config=config)
    yield root, record
    shutil.rmtree(root, ignore_errors=True)


def test_every_row_is_reported(first_run):
    root, record = first_run
    _, variants = load_config(root / "study.toml", "default")  # every variant of the file, `bad` first
    expected = [v.name for v in variants] + [v.name + "+healed" for v in variants if v.heal]
    names = [r["name"] for r in record["rows"]]
    assert sorted(names) == sorted(expected)
    failed = {r["name"]: r["error"] for r in record["rows"] if "error" in r}
    assert sorted(failed) == ["bad", "bad+healed"], failed
    report = (root / "results" / "report.md").read_text()
    for r in record["rows"]:
        assert r["label"] in report
    assert (root / "results" / "pareto.png").stat().st_size > 10_000
    saved = json.loads((root / "results" / "results.json").read_text())
    assert [r["name"] for r in saved["rows"]] == names


def test_a_failing_variant_is_reported_not_fatal(first_run):
    root, record = first_run
    rows = {r["name"]: r for r in record["rows"]}
    assert "ran out of memory" in rows["bad"]["error"]  # names what went wrong
    assert "error" in rows["bad+healed"]
    assert "FAILED" in (root / "results" / "report.md").read_text()
    # ... and every variant after it was converted (7) and healed (5: `source` heals the source itself).
    assert record["counts"] == {"converted": 7, "healed": 5, "reused": 0}


def test_rows_are_consistent(first_run):
    _, record = first_run
    rows = {r["name"]: r for r in record["rows"] if "error" not in r}
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
    # A healed row's decode speed is its unhealed row's (same shapes and code), measured once.
    for row in rows.values():
        if row["healed"]:
            assert row["decode_measured_on"] == row["variant"]
            assert row["decode_tokens_per_second"] == rows[row["variant"]]["decode_tokens_per_second"]
        else:
            assert "decode_measured_on" not in row and row["decode_tokens_per_second"] > 0


def test_second_run_reuses_the_cache(first_run):
    root, first = first_run
    # The same results directory resumes every row without converting, healing or loading a checkpoint.
    with failing_bad_variant():
        record = study(root, config=root / "study.toml")
    assert all(r.get("resumed") for r in record["rows"] if "error" not in r)
    assert record["counts"] == {"converted": 0, "healed": 0, "reused": 0}
    assert [r["name"] for r in record["rows"]] == [r["name"] for r in first["rows"]]


def test_kept_checkpoints_are_reused_by_a_new_results_dir(first_run):
    root, first = first_run

    def store():  # the checkpoints in the store, by variant name (`NAME-KEY`, `NAME-healed-KEY`)
        return sorted(p.name.rsplit("-", 1)[0] for p in (root / "store").iterdir() if p.suffix != ".heal")

    _, variants = load_config(root / "study.toml", "default")
    variants = [v for v in variants if v.name != "bad"]  # its conversion failed: nothing to keep
    converted = [v.name for v in variants if v.kind != "source"]
    built = converted + [v.name + "-healed" for v in variants if v.heal]
    assert store() == sorted(built)  # every converted and healed checkpoint, kept by default
    # New rows (another results dir), same store: both checkpoints of one variant are reused, not rebuilt,
    # then discarded once measured (--discard-checkpoints); the other variants' checkpoints stay.
    again = study(root, results="again", only=["mqa-calibrated"], keep_checkpoints=False)
    assert again["counts"] == {"converted": 0, "healed": 0, "reused": 2}
    assert not any(r.get("resumed") for r in again["rows"])
    before = {r["name"]: r for r in first["rows"]}
    for r in again["rows"]:
        assert r["perplexity"] == pytest.approx(before[r["name"]]["perplexity"], rel=1e-6)
    # Without a source row the fraction still compares with the source's cache: MQA keeps 1 of 3 KV heads.
    assert [r["kv_fraction"] for r in again["rows"]] == pytest.approx([1 / 3, 1 / 3])
    assert store() == sorted(set(built) - {"mqa-calibrated", "mqa-calibrated-healed"})


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


def test_a_profile_runs_the_variants_it_names(tmp_path):
    _, every = load_config(DEFAULT_CONFIG, "default")
    settings, quick = load_config(DEFAULT_CONFIG, "quick")
    assert [v.name for v in quick] == [v for v in settings.variants]  # in the file's order
    assert set(settings.variants) < {v.name for v in every}
    config = tmp_path / "study.toml"
    config.write_text(DEFAULT_CONFIG.read_text().replace('"mla-50-deepseek"]', '"mla-51"]'))
    with pytest.raises(ValueError, match=r"\['mla-51'\] in \[quick\].*choose from"):
        load_config(config, "quick")


def test_an_unknown_heal_corpus_is_refused(tmp_path):
    config = tmp_path / "study.toml"
    text = DEFAULT_CONFIG.read_text()
    assert 'heal_corpus = "mix"' in text
    config.write_text(text.replace('heal_corpus = "mix"', 'heal_corpus = "wikipedia"'))
    with pytest.raises(ValueError, match="heal_corpus 'wikipedia'.*austen"):
        load_config(config, "default")
