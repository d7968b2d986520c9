"""The second embedded corpus (Python 3.11 docs), `--calibration-corpus`, and heal's evaluation-text guard."""

import argparse
import hashlib

import pytest
import torch
from conftest import exit_status

from benchmarks.experiments import cross_domain
from hf_attn.conversion import cli as convert_cli
from hf_attn.conversion.checkpoint import calibration as cal
from hf_attn.conversion.specs import CalibrationSpec, add_spec_arguments, spec_from_args
from hf_attn.conversion.training.data import (
    HealSettings,
    check_disjoint,
    check_not_embedded_eval,
    load_data,
    load_train_corpus,
)
from hf_attn.tooling import assets, python_docs
from hf_attn.tooling.corpus import Corpus


@pytest.fixture(scope="module")
def docs_dir():
    return assets.python_docs_dir()


def test_python_docs_texts_match_the_pinned_checksums(docs_dir):
    for section in python_docs.SECTIONS:
        path = docs_dir / f"{section}.txt"
        digest = hashlib.sha256(path.read_bytes()).hexdigest()  # computed here, not by the asset code
        assert digest == python_docs.PINNED_SHA256[section], section
    listed = {line.split()[1] for line in (docs_dir / "SHA256SUMS").read_text().splitlines()}
    assert listed == {f"{s}.txt" for s in python_docs.SECTIONS}


def test_split_is_disjoint_and_no_evaluation_text_is_calibration_or_heal_text(docs_dir):
    evaluation = {p.resolve() for p in assets.embedded_eval_files()}
    assert evaluation == {assets.austen_file("persuasion").resolve(), (docs_dir / "faq.txt").resolve()}
    for name in assets.CORPORA:
        assert not evaluation & {p.resolve() for p in assets.calibration_corpus_files(name)}, name
    assert not evaluation & {p.resolve() for p in cal.default_calibration_files()}
    assert not evaluation & {p.resolve() for p in load_train_corpus()[1]}
    # content too: no 200+ character paragraph of the FAQ is in the docs' calibration part
    calib = assets.python_docs_calibration_files()
    joined = Corpus.from_text("\n\n".join(p.read_text() for p in calib), "calibration")
    faq = assets.python_docs_eval_file()
    check_disjoint(joined, calib, Corpus.from_text(faq.read_text(), "faq"), [faq])


def test_mix_is_equal_shares_of_both_corpora():
    mix = assets.calibration_corpus_files("mix")
    assert mix == assets.train_text_files() + assets.python_docs_calibration_files()
    assert len(assets.train_text_files()) == len(assets.python_docs_calibration_files())  # equal shares


def test_calibration_ids_weight_a_file_by_how_often_it_is_listed(tmp_path, smollm2_path):
    """Shares from the start of each file, equal per listing: [a, b, b] gives a a third of the tokens and b
    two thirds, contiguous (not the same start twice); the reference: the tokenizer run on each text here."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    a, b = assets.austen_file("emma"), assets.python_docs_calibration_files()[0]

    def start(path, n):
        return tok(path.read_text()[:20_000], add_special_tokens=False)["input_ids"][:n]

    assert cal.calibration_ids(tok, [a, b, b], 30).tolist() == start(a, 10) + start(b, 20)
    assert cal.calibration_ids(tok, [a, b], 31).tolist() == start(a, 16) + start(b, 15)  # remainder: first
    assert cal.calibration_ids(tok, [b, a, b], 31).tolist() == start(b, 21) + start(a, 10)
    short = tmp_path / "short.txt"
    short.write_text("A few words only.")
    with pytest.raises(ValueError, match="asked for 40, the 2 file"):
        cal.calibration_ids(tok, [short, a, a, short], 40)


def test_strip_rest_on_a_hand_checked_example():
    source = (
        "Title\n=====\n\n.. index:: single: foo\n   pair: bar; baz\n\n"
        "See :func:`os.path.join` and :ref:`the tutorial <tut-intro>`, ``x + 1`` and\n"
        "`Python <https://python.org>`_ here::\n\n   print(1)\n\n"
        ".. note::\n   :class: hidden\n\n   Kept body.\n\n.. A comment\n   spanning lines.\n\nEnd.\n"
    )
    expected = (
        "Title\n\nSee os.path.join and the tutorial, x + 1 and\nPython here:\n\n   print(1)\n\n"
        "   Kept body.\n\nEnd.\n"
    )
    assert python_docs.strip_rest(source) == expected


def test_calibration_corpus_option_parses_resolves_and_refuses_unknown_names(capsys):
    for main in (convert_cli.gqa_main, convert_cli.mla_main):
        argv = ["--output", "/nonexistent/out", "--calibration-corpus", "shakespeare"]
        assert (
            exit_status(main, argv + (["--num-kv-heads", "1"] if main is convert_cli.gqa_main else [])) == 2
        )
        err = capsys.readouterr().err
        assert "invalid choice: 'shakespeare'" in err and "python-docs" in err
    both = ["--output", "o", "--num-kv-heads", "1", "--calibration-corpus", "mix", "--calibration-text", "a"]
    assert exit_status(convert_cli.gqa_main, both) == 2
    assert "not allowed with" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Unknown calibration corpus 'x'"):
        assets.calibration_corpus_files("x")

    parser = argparse.ArgumentParser()
    add_spec_arguments(parser, CalibrationSpec, prefix="calibration")
    for name, files in [("python-docs", assets.python_docs_calibration_files()), ("mix", None)]:
        spec = spec_from_args(
            CalibrationSpec, parser.parse_args(["--calibration-corpus", name]), prefix="calibration"
        )
        assert spec.files() == (files or assets.calibration_corpus_files("mix"))
    default = spec_from_args(CalibrationSpec, parser.parse_args([]), prefix="calibration")
    assert default == CalibrationSpec() and default.files() == assets.calibration_corpus_files("mix")


def test_heal_refuses_training_text_that_contains_an_evaluation_text(tmp_path, docs_dir):
    emma = assets.austen_file("emma").read_text()[:50_000]
    faq = (docs_dir / "faq.txt").read_text()
    for name, text in [("faq", emma + "\n\n" + faq[10_000:20_000]), ("persuasion", emma + "\n\n")]:
        if name == "persuasion":
            text += assets.austen_file("persuasion").read_text()[5_000:9_000]
        path = tmp_path / f"{name}.txt"
        path.write_text(text)
        corpus, files = load_train_corpus([path])
        with pytest.raises(ValueError, match="share .* paragraph"):
            check_not_embedded_eval(corpus, files)
        # through heal itself, whatever --eval-text it measures with (refused before the model is read)
        settings = HealSettings(output=str(tmp_path / "o"), train_text=[str(path)], eval_text=[str(path)])
        with pytest.raises(ValueError):
            load_data(settings, tmp_path / "no-model", num_processes=1)
        other = tmp_path / "other_eval.txt"
        other.write_text(assets.austen_file("emma").read_text()[60_000:80_000])
        settings = HealSettings(output=str(tmp_path / "o"), train_text=[str(path)], eval_text=[str(other)])
        with pytest.raises(ValueError, match="share .* paragraph"):
            load_data(settings, tmp_path / "no-model", num_processes=1)
    clean = tmp_path / "clean.txt"
    clean.write_text(emma)
    check_not_embedded_eval(*load_train_corpus([clean]))  # no overlap: no error


def test_heal_train_corpus_names_the_embedded_texts(tmp_path, docs_dir, smollm2_path, capsys):
    """`--train-corpus mix` (the default) trains on the five novels and the five documentation sections (the
    files listed here independently), never on an evaluation text; it excludes --train-text."""
    from hf_attn.conversion.training import heal as heal_mod

    novels = [assets.austen_file(n) for n in ("emma", "mansfieldpark", "northangerabbey", "prideprejudice",
                                                "sensesensibility")]  # fmt: skip
    docs = [docs_dir / f"{n}.txt" for n in ("tutorial", "reference", "howto", "using", "extending")]
    cases = (("mix", novels + docs), ("python-docs", docs), ("austen", novels), (None, novels + docs))
    for corpus, files in cases:
        settings = HealSettings(output=str(tmp_path / "o"), train_corpus=corpus, eval_tokens=0, seq_len=512)
        data = load_data(settings, smollm2_path, num_processes=1)
        assert sorted(data.train_corpus.name.split("+")) == sorted(f.name for f in files), corpus
    argv = ["--output", str(tmp_path / "o"), "--train-corpus", "mix", "--train-text", str(novels[0])]
    assert exit_status(heal_mod.main, argv) == 2 and "not allowed with" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_heal_mix_gives_the_novels_and_the_documentation_equal_shares(tmp_path, docs_dir, smollm2_path):
    """Healing on `mix` draws as many chunks of the documentation as of the novels (the smaller corpus's
    chunks repeated in turn), every chunk of both present, the tokens each corpus's own tokenization; its
    stream's hash differs from the joined text's, so a checkpoint of a proportional run does not resume."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    novels = [assets.austen_file(n) for n in ("sensesensibility", "prideprejudice", "mansfieldpark", "emma",
                                                "northangerabbey")]  # fmt: skip  (publication order)
    docs = [docs_dir / f"{n}.txt" for n in ("tutorial", "reference", "howto", "using", "extending")]
    expected, tokens = [], 0
    for files in (novels, docs):
        text = "\n\n".join(f.read_text(encoding="utf-8") for f in files)
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        expected.append(ids[: ids.numel() // 256 * 256].view(-1, 256))
        tokens += ids.numel()
    settings = HealSettings(output=str(tmp_path / "o"), train_corpus="mix", eval_tokens=0, seq_len=256)
    data = load_data(settings, smollm2_path, num_processes=1)
    big, small = expected
    assert len(big) > len(small) and data.chunks.shape == (2 * len(big), 256)
    assert torch.equal(data.chunks[: len(big)], big)
    drawn = data.chunks[len(big) :]
    assert {tuple(c.tolist()) for c in drawn} == {tuple(c.tolist()) for c in small}
    counts = torch.bincount(torch.arange(len(big)) % len(small))
    assert counts.max() - counts.min() <= 1  # each documentation chunk repeated as often as any other, +-1
    assert data.train_tokens == tokens
    assert data.train_sha256 != data.train_corpus.sha256
    austen = HealSettings(output=str(tmp_path / "o"), train_corpus="austen", eval_tokens=0, seq_len=256)
    one = load_data(austen, smollm2_path, num_processes=1)
    assert torch.equal(one.chunks, big) and one.train_sha256 == one.train_corpus.sha256


def test_cross_domain_check_and_default_rule():
    def row(corpus, p, q):
        return {"corpus": corpus, "ratio": {"persuasion": p, "python-faq": q}}

    assert cross_domain.check_row(row("a", 2.0, 2.5))
    assert not cross_domain.check_row(row("a", 2.0, 2.51))
    rule = cross_domain.best_corpus([row("a", 2.0, 8.0), row("b", 3.0, 3.0)])  # geomeans 4 and 3
    assert rule["best"] == "b" and rule["scores"]["a"] == pytest.approx(4.0)


def test_in_genre_bound_and_cost_from_hand_computed_rows():
    def row(name, corpus, p, q):  # original perplexities 10 (Persuasion) and 4 (FAQ)
        return {"conversion": name, "corpus": corpus, "ppl": {"persuasion": p, "python-faq": q},
                "ratio": {"persuasion": p / 10, "python-faq": q / 4}}  # fmt: skip

    rows = [row("a", "austen", 15, 40), row("a", "python-docs", 60, 8), row("a", "mix", 18, 9)]
    rows += [row("b", "austen", 12, 30), row("b", "mix", 13, 5)]  # no python-docs row: no in-genre entry
    (a,) = cross_domain.in_genre(rows, "mix")
    assert a["conversion"] == "a" and a["ratio"] == {"persuasion": 1.5, "python-faq": 2.0}
    assert a["bound"] == pytest.approx(2.0 / 1.5)  # FAQ by the docs row, Persuasion by the novels row
    assert a["cost"] == pytest.approx({"persuasion": 18 / 15, "python-faq": 9 / 8})
    assert "cost" not in cross_domain.in_genre(rows, "other")[0]
    summary = {"original": {"persuasion": 10, "python-faq": 4}, "rows": [], "in_genre": [a]}
    summary["default_rule"] = {"scores": {"mix": 1.0}, "best": "mix"}
    assert "| a | 1.500 | 2.000 | 1.333 | 1.200 | 1.125 |" in cross_domain.markdown(summary)


def test_cross_domain_refuses_bad_refinement_settings_before_any_work(tmp_path, capsys):
    argv = ["--results", str(tmp_path / "r"), "--refine-steps", "-1"]
    assert exit_status(cross_domain.main, argv) == 2
    err = capsys.readouterr().err
    assert "--refine-steps must be >= 0 and --refine-tokens positive, got -1 and 4096" in err
    assert not (tmp_path / "r").exists()


def test_study_second_corpus_column_is_opt_in_and_keeps_earlier_row_keys():
    import dataclasses

    from hf_attn.eval import report
    from hf_attn.eval.study import DEFAULT_CONFIG, load_config

    settings, _ = load_config(DEFAULT_CONFIG, "quick")  # the quick profile leaves the column off
    assert settings.second_corpus_tokens == 0
    old_fields = {f.name for f in dataclasses.fields(settings)} - {"second_corpus_tokens", "variants"}
    assert settings.key() == {k: getattr(settings, k) for k in old_fields}  # the keys rows had before
    on = dataclasses.replace(settings, second_corpus_tokens=4096)
    assert on.key()["second_corpus_tokens"] == 4096 and "Python 3.11 FAQ" in on.protocol

    row = {"label": "x", "healed": False, "perplexity": 30.0, "kv_bytes_per_token": 1.0, "kv_fraction": 1.0}
    plain = report.format_table({"rows": [row]})
    assert "PPL Python FAQ" not in plain and plain.count("|") == 3 * (len(report.COLUMNS) + 1)
    table = report.format_table({"rows": [{**row, "perplexity_python_faq": 16.25}]}).splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert header[header.index("Perplexity") + 1] == "PPL Python FAQ"
    assert cells[header.index("PPL Python FAQ")] == "16.25" and len(cells) == len(header)


def test_study_report_states_the_cross_domain_check_per_row():
    """Ratios to the untouched source on each text, by hand: 60 / 30 = 2 and 37.5 / 15 = 2.5 (2.5 / 2 = 1.25,
    the tolerance: passes); 37.6 / 15 (1.2533) does not; without the FAQ column there is no table."""
    from hf_attn.eval import report

    def row(name, healed, p, q):
        return {"name": name, "label": name, "healed": healed, "perplexity": p, "perplexity_python_faq": q}

    rows = [row("source", False, 30.0, 15.0), row("a", False, 60.0, 37.5), row("a+healed", True, 60.0, 37.6)]
    lines = report.cross_domain_table({"rows": rows}).splitlines()
    assert "<= 1.25" in lines[0] and len(lines) == 4  # header, rule, two rows: not the source itself
    assert lines[2] == "| a | no | 2.000 | 2.500 | 1.250 pass |"
    assert lines[3] == "| a+healed | yes | 2.000 | 2.507 | 1.253 no |"
    assert report.cross_domain_table({"rows": [{**r, "perplexity_python_faq": None} for r in rows]}) is None
