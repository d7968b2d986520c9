"""`python -m benchmarks.gpu` without a GPU: the dry run sets up every part of every profile (so the suite
cannot rot between runs on a GPU) and checks each profile's planned seconds against its budget, naming the
part that cannot be set up or the profile that cannot fit; the wheel list satisfies the project's own
requirement, the carried bundle is checked, the package layout resolves into the checkout; the runner writes
every part's rows into one folder of four files; the results files."""

import json
from types import SimpleNamespace

import pytest

from benchmarks import gpu, gpu_bundle, gpu_checks, gpu_parts
from benchmarks.gpu_parts import PARTS, PROFILES


def test_dry_run_sets_up_every_part():
    results = {r["part"]: r for r in gpu_parts.dry_run({name: {} for name in gpu.all_parts()})}
    assert set(results) == set(PARTS) == set(gpu.all_parts())  # every part belongs to a profile
    broken = {name: r["error"] for name, r in results.items() if not r["ok"]}
    assert not broken
    # 7 kernel cases x 3 dtypes + 4 model cases + 2 layouts' layer fits: the tests that skip without CUDA
    assert results["kernel-tests"]["plan"][0].startswith("27 tests")
    assert results["attention"]["plan"][0].startswith("10 cases")  # 2 shapes x (2 contexts x 2 batches + 1)
    assert "batch 16 at 8192" in results["capacity"]["plan"][0]  # MHA 7B: 128 MiB per row and layer at 8k
    assert "batch 227 at 8192" in results["capacity"]["plan"][1]  # 512 + 64: 9 MiB
    assert "2 of 32 layers" in results["recipe"]["plan"][0] and "8 of 32" in results["recipe-deep"]["plan"][0]
    assert all("--device cuda" in line for line in results["recipe"]["plan"][1:])
    assert results["heal-lora"]["plan"][0].startswith("llama-3-8b, 32 layers")


def test_dry_run_names_each_part_that_cannot_be_set_up():
    overrides = {
        "mla-kernel": {"shapes": ["no-such-shape"]},
        "recipe": {"converters": ["nothing"]},
        "kernel-tests": {"tests": "tests/no_such_file.py"},
        "heal": {"steps": 1},
        "capacity": {"kv_gib_per_layer": 0.01},
        "fsdp": {},
    }
    results = {r["part"]: r for r in gpu_parts.dry_run(overrides)}
    assert results["fsdp"]["ok"]
    for name, needle in (("mla-kernel", "no-such-shape"), ("recipe", "nothing"), ("capacity", "holds no"),
                         ("kernel-tests", "no_such_file"), ("heal", "steps")):  # fmt: skip
        assert not results[name]["ok"] and needle in results[name]["error"], results[name]
    with pytest.raises(ValueError, match="unknown setting"):
        gpu_parts.resolve_settings("heal", {"stepz": 3})


def test_profiles_fit_their_budgets_by_the_parts_estimates():
    loan, extended = PROFILES["loan"], PROFILES["extended"]
    assert (loan.budget_s, extended.budget_s) == (300, 480)  # one 5-minute command, then one of 8
    assert loan.parts == ("kernel-tests", "mla-kernel", "capacity", "recipe") and loan.if_time == (
        "attention",
    )
    assert gpu.build_parser().parse_args([]).profile == "loan"  # the default
    for profile in PROFILES.values():
        assert gpu_parts.budget_problems(profile) == []
        assert gpu_parts.planned_s(profile) <= profile.budget_s


def test_dry_run_covers_both_profiles_and_fails_one_that_cannot_fit(monkeypatch, capsys):
    env = gpu_bundle.child_env(install=False)
    assert gpu.dry_run(gpu.all_parts(), {}, env, in_process=True) == 0
    out = capsys.readouterr().out
    assert "profile loan: planned 260 s of 300 s" in out and "profile extended:" in out
    assert "CANNOT" not in out
    slow = gpu_parts.Part("recipe", "gpu_recipe", "slower", plan_s=200, limit_s=250)
    monkeypatch.setitem(PARTS, "recipe", slow)
    assert gpu.dry_run([], {}, env, in_process=True) == 1
    assert "profile loan: planned 375 s of 300 s" in capsys.readouterr().out
    assert "recipe 200) > its budget 300 s" in " ".join(gpu_parts.budget_problems(PROFILES["loan"]))
    assert gpu.dry_run(["mla-kernel"], {"mla-kernel": {"batch": [0]}}, env, in_process=True) == 1


def test_runner_writes_every_part_into_one_folder(tmp_path, monkeypatch, capsys):
    """A part that fails at once on a machine without CUDA: its status, the four files, the exit status."""
    monkeypatch.setattr(gpu, "probe", lambda env: {"device": "GPU X"})
    plain = gpu_bundle.child_env
    monkeypatch.setattr(gpu_bundle, "child_env", lambda: plain(install=False))  # no carried wheels here
    out = tmp_path / "out"
    assert gpu.main(["--parts", "capacity", "--output", str(out)]) == 1
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "results.json", "results.md", "rows.jsonl"]
    part = json.loads((out / "results.json").read_text())["parts"]["capacity"]
    assert part["status"].startswith("failed (exit 1)") and "needs a CUDA GPU" in part["status"]
    assert part["planned_s"] == PARTS["capacity"].plan_s and part["settings"]["context"] == 8192
    assert gpu.load_existing(out)["parts"].keys() == {"capacity"}  # the folder is this command's


def test_kernel_test_rows_are_appended_as_each_test_ends(tmp_path, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    monkeypatch.setenv(gpu_checks.ROWS_ENV, str(rows))
    report = SimpleNamespace(
        nodeid="t.py::test_a[x]", when="call", outcome="passed", duration=1.234, longrepr=None
    )
    gpu_checks.pytest_runtest_logreport(report)
    gpu_checks.pytest_runtest_logreport(SimpleNamespace(**{**vars(report), "when": "teardown"}))  # no row
    skip = SimpleNamespace(
        **{**vars(report), "when": "setup", "outcome": "skipped", "longrepr": ("f", 1, "no GPU")}
    )
    gpu_checks.pytest_runtest_logreport(skip)
    got = gpu.read_rows(rows, "kernel-tests")["rows"]
    assert [(r["outcome"], r["seconds"], r["message"]) for r in got] == [
        ("passed", 1.23, ""),
        ("skipped", 1.23, "no GPU"),
    ]
    assert got[0]["test"] == "test_a[x]"


def test_recipe_rows_and_full_depth_estimate(tmp_path):
    from benchmarks.gpu_recipe import stage_rows

    log = tmp_path / "stages.jsonl"
    events = [("calibration", 2.0), ("factorization", 1.0), ("factorization", 1.0),
              ("closed-form write", 3.0), ("closed form", 6.0), ("layer fits", 4.0), ("layer fits", 4.0),
              ("refined write", 1.0), ("refinement", 10.0)]  # fmt: skip
    lines = [json.dumps({"stage": s, "seconds": t}) for s, t in events] + [json.dumps({"peak_gpu": 2**31})]
    log.write_text("\n".join(lines) + "\n")
    rows = {
        r["stage"].strip(): r for r in stage_rows("mla", log, 20.0, "ok", {"L": 2, "layers": 16, "bytes": 5})
    }
    assert rows["factorization"]["calls"] == 2 and rows["layer fits"]["per_layer_s"] == 4.0
    # write: its own 1 s x 5 (bytes) + factorization 2 s x 16; closed form: 1 x 5 + calibration 2 x 16 + write
    assert rows["closed-form write"]["full_depth_s"] == 5 + 32
    assert rows["closed form"]["full_depth_s"] == 5 + 32 + 37
    assert rows["refinement"]["full_depth_s"] == 128 + 5 + 1 * 16  # fits, write, the rest of it by layers
    assert rows["process start and the rest"]["seconds"] == 4.0
    assert rows["total"]["full_depth_s"] == 4 + 74 + 149 and rows["total"]["peak_gpu_gib"] == 2.0
    assert rows["  calibration".strip()]["stage"] == "  calibration"


@pytest.mark.parametrize(
    "converter, stages",
    [
        ("mla", {"closed form", "calibration", "closed-form write", "factorization", "refinement",
                 "layer fits", "refined write"}),
        ("gqa", {"closed form", "calibration and fit", "closed-form write", "refinement", "layer fits",
                 "refined write"}),
    ],
)  # fmt: skip
def test_recipe_child_times_every_stage_of_a_real_conversion(tmp_path, converter, stages):
    """The recipe's wrapped converter, run on the CPU on a tiny synthetic checkpoint: every stage it hooks is
    called (a hook on a name the converter no longer calls through would leave its stage out)."""
    import os
    import subprocess

    from benchmarks.gpu_recipe import STAGE_LOG, converter_argv
    from benchmarks.synthetic import write_synthetic

    src = write_synthetic(tmp_path / "src", shape="tiny", progress=False)
    log = tmp_path / "stages.jsonl"
    argv = converter_argv(converter, str(src), str(tmp_path / "out"), device="cpu")
    argv += ["--calibration-tokens", "256", "--refine-steps", "2"]
    proc = subprocess.run(argv, env={**os.environ, STAGE_LOG: str(log)}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = {json.loads(line).get("stage") for line in log.read_text().splitlines()}
    assert stages <= seen, f"stages never timed: {sorted(stages - seen)}"


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
    assert (src / "hf_attn" / "eval" / "cli.py").resolve() == root / "eval" / "cli.py"
    assert (src / "benchmarks" / "gpu_parts.py").resolve() == root / "benchmarks" / "gpu_parts.py"
    assert (
        src / "hf_attn" / "conversion" / "training" / "heal_fsdp.yaml"
    ).resolve() == root / "conversion" / "training" / "heal_fsdp.yaml"


def test_emitted_rows_follow_the_schema(tmp_path):
    emit = gpu_parts.Emitter(str(tmp_path / "rows.jsonl"), {"a", "b"}, "one")
    emit({"a": 1}, meta={"device": "x"})
    with pytest.raises(KeyError, match="not in the part's schema"):
        emit({"c": 1})
    emit.close()
    gpu_parts.Emitter(str(tmp_path / "rows.jsonl"), {"a"}, "two")({"a": 2})  # another part, the same file
    rows = gpu.read_rows(tmp_path / "rows.jsonl", "one")
    assert rows["rows"] == [{"a": 1}] and rows["meta"] == {"device": "x"}
    assert gpu.read_rows(tmp_path / "rows.jsonl", "two")["rows"] == [{"a": 2}]


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
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--profile", "nope"])
    assert exit_info.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
    assert gpu.parse_sets(['heal.steps=4', 'recipe.converters=["mla"]', "capacity.shape=llama-2-7b"]) == {
        "heal": {"steps": 4}, "recipe": {"converters": ["mla"]}, "capacity": {"shape": "llama-2-7b"}
    }  # fmt: skip


def test_results_merge_and_markdown(tmp_path):
    part = dict(date="2026-11-25", command="python -m benchmarks.gpu --parts capacity",
                environment={"device": "GPU X"}, planned_s=30,
                status="ok", seconds=1.0, limit_s=60, log_tail=[], meta={}, settings={"args": []},
                columns=[["command", "command", ""], ["value", "value", ".2f"]],
                rows=[{"command": "a", "value": 1.0}, {"command": "b", "value": None}])  # fmt: skip
    gpu.write({"benchmark": gpu.NAME, "parts": {"capacity": part}}, tmp_path)
    record = gpu.load_existing(tmp_path)
    assert record["parts"]["capacity"]["rows"] == part["rows"]
    text = (tmp_path / "results.md").read_text()
    assert "| command | value |\n|---|---|\n| a | 1.00 |\n| b | n/a |" in text
    assert "| capacity | ok | 1 | 30 | 2 | GPU X | 2026-11-25 |" in text


def test_kernel_goals_per_row():
    from benchmarks.gpu_kernel import goals

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

    runs = (("a", "capacity", "ok"), ("b", "heal", "ok"), ("c", "capacity", "failed (exit 1)"))
    for name, part, status in runs:
        (tmp_path / f"{name}.json").write_text(json.dumps(run_record(part, status)))
    files = [str(tmp_path / f"{n}.json") for n in "abc"]
    assert gpu.main(["--merge", *files, "--output", str(tmp_path / "all")]) == 0
    parts = json.loads((tmp_path / "all" / "results.json").read_text())["parts"]
    assert sorted(parts) == ["capacity", "heal"] and parts["capacity"]["status"] == "failed (exit 1)"
    (tmp_path / "other.json").write_text("{}")
    assert gpu.main(["--merge", str(tmp_path / "other.json"), "--output", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_recipe_rows_from_the_records_stage_seconds(tmp_path):
    from benchmarks.gpu_recipe import record_rows

    history = [{"kind": "mla", "stage_seconds": {"read": 1.0, "fit": 2.0, "other": 0.5}}, {"kind": "refine"}]
    (tmp_path / "config.json").write_text(json.dumps({"hf_attn": {"history": history}}))
    got = {r["stage"]: r for r in record_rows("mla", tmp_path, {"L": 2, "layers": 16, "bytes": 5})}
    assert [(r["full_depth_s"], r["per_layer_s"]) for r in got.values()] == [
        (5.0, None),
        (32.0, 1.0),
        (0.5, None),
    ]
    assert list(got) == ["mla record: read", "mla record: fit", "mla record: other"]
    assert record_rows("mla", tmp_path / "absent", {}) == []
