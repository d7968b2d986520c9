"""`hf-attn bench gpu` without a GPU: the dry run sets every part up (so the suite cannot rot between GPU
rentals), names the part that cannot be set up, the wheel list satisfies the project's own requirement, the
carried bundle is checked, the package layout resolves into the checkout, and the results files."""

import json

import pytest

from hf_attn.eval.bench import gpu, gpu_bundle, gpu_parts
from hf_attn.eval.bench.gpu_parts import PARTS


def test_dry_run_sets_up_every_part():
    results = {r["part"]: r for r in gpu_parts.dry_run({name: {} for name in PARTS})}
    assert set(results) == set(PARTS)
    broken = {name: r["error"] for name, r in results.items() if not r["ok"]}
    assert not broken
    # 7 kernel cases x 3 dtypes + 4 model cases: the compiled tests that skip without CUDA
    assert results["kernel-tests"]["plan"][0].startswith("25 tests")
    assert results["attention"]["plan"][0].startswith(
        "22 cases"
    )  # 2 shapes x (4 contexts x 2 batches + 3 prefills)


def test_dry_run_names_each_part_that_cannot_be_set_up():
    overrides = {
        "mla-kernel": {"shapes": ["no-such-shape"]},
        "calibration": {"steps": ["nothing"]},
        "kernel-tests": {"tests": "tests/no_such_file.py"},
        "heal": {"steps": 1},
        "engine": {},
    }
    results = {r["part"]: r for r in gpu_parts.dry_run(overrides)}
    assert results["engine"]["ok"]
    for name, needle in (("mla-kernel", "no-such-shape"), ("calibration", "nothing"),
                         ("kernel-tests", "no_such_file"), ("heal", "steps")):  # fmt: skip
        assert not results[name]["ok"] and needle in results[name]["error"], results[name]
    with pytest.raises(ValueError, match="unknown setting"):
        gpu_parts.resolve_settings("heal", {"stepz": 3})


def test_wheel_list_satisfies_the_project_requirement(monkeypatch):
    assert gpu_bundle.check_wheel_list() == []
    wheels = [w if w[0] != "transformers" else ("transformers", "5.17.0", "") for w in gpu_bundle.WHEELS]
    monkeypatch.setattr(gpu_bundle, "WHEELS", tuple(wheels))
    assert any("transformers==5.17.0" in p for p in gpu_bundle.check_wheel_list())


def _fake_bundle(root, *, total):
    wheels = []
    (root / "wheels").mkdir(parents=True)
    for name, version, _ in gpu_bundle.WHEELS:
        file = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        (root / "wheels" / file).write_bytes(b"x" * 10)
        wheels.append(dict(file=file, name=name.replace("-", "_"), version=version, bytes=10))
    (root / "manifest.json").write_text(json.dumps({"wheels": wheels, "total_bytes": total}))


def test_bundle_check(tmp_path):
    assert gpu_bundle.check_bundle(tmp_path / "absent") != []
    _fake_bundle(tmp_path / "ok", total=1000)
    assert gpu_bundle.check_bundle(tmp_path / "ok") == []
    _fake_bundle(tmp_path / "big", total=gpu_bundle.SIZE_LIMIT + 1)
    assert any("64 MiB" in p for p in gpu_bundle.check_bundle(tmp_path / "big"))
    next((tmp_path / "ok" / "wheels").glob("transformers-*")).write_bytes(b"changed!!!!")
    assert any("transformers" in p for p in gpu_bundle.check_bundle(tmp_path / "ok"))


def test_package_layout_resolves_into_the_checkout(tmp_path):
    src = gpu_bundle.package_layout(gpu_bundle.ROOT, tmp_path)
    root = gpu_bundle.ROOT
    assert (src / "hf_attn" / "__init__.py").resolve() == root / "hf_attn" / "__init__.py"
    assert (src / "hf_attn" / "eval" / "bench" / "gpu.py").resolve() == root / "eval" / "bench" / "gpu.py"
    assert (
        src / "hf_attn" / "conversion" / "heal_fsdp.yaml"
    ).resolve() == root / "conversion" / "heal_fsdp.yaml"


def test_emitted_rows_follow_the_schema(tmp_path):
    emit = gpu_parts.Emitter(str(tmp_path / "rows.jsonl"), {"a", "b"})
    emit({"a": 1}, meta={"device": "x"})
    with pytest.raises(KeyError, match="not in the part's schema"):
        emit({"c": 1})
    emit.close()
    rows = gpu.read_rows(tmp_path / "rows.jsonl")
    assert rows["rows"] == [{"a": 1}] and rows["meta"] == {"device": "x"}


def test_bad_options_exit_2_and_write_nothing(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for argv in (
        ["--set", "nope.x=1"],
        ["--limit", "heal=0"],
        ["--budget-s", "0"],
        ["--output", str(foreign)],
    ):
        assert gpu.main(argv) == 2
        assert "error:" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert gpu.parse_sets(['heal.steps=4', 'engine.args=["--x"]', "calibration.shape=llama-2-7b"]) == {
        "heal": {"steps": 4}, "engine": {"args": ["--x"]}, "calibration": {"shape": "llama-2-7b"}
    }  # fmt: skip


def test_results_merge_and_markdown(tmp_path):
    part = dict(date="2026-11-25", command="hf-attn bench gpu --parts engine",
                environment={"device": "GPU X"},
                status="ok", seconds=1.0, limit_s=60, log_tail=[], meta={}, settings={"args": []},
                columns=[["command", "command", ""], ["value", "value", ".2f"]],
                rows=[{"command": "a", "value": 1.0}, {"command": "b", "value": None}])  # fmt: skip
    gpu.write({"benchmark": gpu.NAME, "parts": {"engine": part}}, tmp_path)
    record = gpu.load_existing(tmp_path)
    assert record["parts"]["engine"]["rows"] == part["rows"]
    text = (tmp_path / "results.md").read_text()
    assert "| command | value |\n|---|---|\n| a | 1.00 |\n| b | n/a |" in text
    assert "| engine | ok | 1 | 2 | GPU X | 2026-11-25 |" in text


def test_kernel_goals_per_row():
    from hf_attn.eval.bench.gpu_kernel import goals

    row = dict(context=16384, tuned_copy_pct=65.0, vs_torch=2.5, vs_gqa=1.2)
    assert goals(row) == "not met: bandwidth"
    assert goals({**row, "context": 4096}) == "met"  # bandwidth counts from 8k context on
    slow = {**row, "tuned_copy_pct": 71.0, "vs_torch": 1.9, "vs_gqa": 1.0}
    assert goals(slow) == "not met: 2x PyTorch, vs GQA"
    assert goals({**row, "context": 1024, "vs_gqa": 0.5, "tuned_copy_pct": None}) == "met"  # GQA from 4k on


def test_merge_of_several_runs(tmp_path, capsys):
    def run_record(part, status):
        return {"benchmark": gpu.NAME, "parts": {part: dict(date="2026-11-25", command="c", environment={},
                                                             status=status, seconds=1, rows=[], columns=[],
                                                             meta={}, settings={})}}  # fmt: skip

    runs = (("a", "engine", "ok"), ("b", "heal", "ok"), ("c", "engine", "failed (exit 1)"))
    for name, part, status in runs:
        (tmp_path / f"{name}.json").write_text(json.dumps(run_record(part, status)))
    files = [str(tmp_path / f"{n}.json") for n in "abc"]
    assert gpu.main(["--merge", *files, "--output", str(tmp_path / "all")]) == 0
    parts = json.loads((tmp_path / "all" / "results.json").read_text())["parts"]
    assert sorted(parts) == ["engine", "heal"] and parts["engine"]["status"] == "failed (exit 1)"
    (tmp_path / "other.json").write_text("{}")
    assert gpu.main(["--merge", str(tmp_path / "other.json"), "--output", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
