"""The local accuracy tasks (hf_attn/tooling/task_data.py): deterministic, pinned checksums verified on use,
built only from the evaluation novel, and the protocol's properties checked on the real items."""

import hashlib
import re
import shutil

import pytest

from hf_attn.tooling import assets, task_data


@pytest.fixture(scope="module")
def novel_text(persuasion_path):
    return persuasion_path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def built(novel_text):
    return task_data.build_tasks(novel_text, forbidden="")  # the overlap check has its own tests


def test_builder_is_deterministic_and_matches_the_pinned_checksums(novel_text, built):
    again = task_data.build_tasks(novel_text, forbidden="")
    assert again == built
    for name, items in built.items():
        assert len(items) == task_data.N_ITEMS
        assert hashlib.sha256(task_data.to_jsonl(items)).hexdigest() == task_data.TASK_SHA256[name]
    other = task_data.build_tasks(novel_text, forbidden="", seed=task_data.SEED + 1)
    assert other["persuasion_lastword"] != built["persuasion_lastword"]


def test_files_are_verified_on_use(tmp_path):
    directory = task_data.task_dir()  # built (or verified) from the stored novel
    assert [it["id"] for it in task_data.load_items("persuasion_nextsent")] == list(range(task_data.N_ITEMS))
    copy = tmp_path / "tasks"
    shutil.copytree(directory, copy)
    task_data._verify(copy)  # intact: passes
    path = copy / "persuasion_lastword.jsonl"
    path.write_bytes(path.read_bytes().replace(b'"target": "', b'"target": "x', 1))
    with pytest.raises(OSError, match="pinned checksum"):
        task_data._verify(copy)
    with pytest.raises(ValueError, match="Unknown local task"):
        task_data.task_file("lambada")


def test_builder_refuses_calibration_text(novel_text):
    with pytest.raises(ValueError, match="calibration/healing text"):
        task_data.build_from_assets("emma")
    emma = assets.austen_file("emma").read_text(encoding="utf-8")
    leaked = novel_text[:20000] + "\n\n" + emma[50000:50400] + "\n\n" + novel_text[20000:40000]
    with pytest.raises(ValueError, match="13-word sequence"):
        task_data.build_tasks(leaked, forbidden=emma)
    task_data.check_no_overlap(novel_text[:40000], emma)  # the evaluation novel itself shares none


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_lastword_items_follow_the_protocol(novel_text, built):
    flat = _flat(novel_text)
    lo, hi = task_data.LASTWORD_CONTEXT_WORDS
    for item in built["persuasion_lastword"]:
        context, target = item["context"], item["target"]
        assert lo <= len(context.split()) <= hi
        assert re.fullmatch(r"[A-Za-z]{4,}", target)
        assert target.lower() in re.findall(r"[a-z]+(?:'[a-z]+)?", context.lower())  # broad-context property
        assert re.search(re.escape(f"{context} {target}") + r"[.!?]", flat)  # the sentence's last word


def test_nextsent_items_follow_the_protocol(novel_text, built):
    flat = _flat(novel_text)
    items = built["persuasion_nextsent"]
    assert {it["label"] for it in items} == set(range(task_data.N_CHOICES))
    for item in items:
        choices, label = item["choices"], item["label"]
        assert len(choices) == task_data.N_CHOICES == len(set(choices))
        assert f"{item['context']} {choices[label]}" in flat  # the true next sentence follows the context
        for i, choice in enumerate(choices):
            assert choice in flat
            if i != label:
                assert f"{item['context']} {choice}" not in flat
            ratio = len(choice.split()) / len(choices[label].split())
            assert 1 / task_data.DISTRACTOR_LENGTH_RATIO <= ratio <= task_data.DISTRACTOR_LENGTH_RATIO
