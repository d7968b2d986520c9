"""Benchmarks of healing (`conversion.training.heal`): training throughput against a bare PyTorch loop, and
the healing curve (held-out perplexity after so many minutes of healing).

    python -m benchmarks.heal throughput [--model DIR] [--steps 8] [--rounds 2] [--seq-len 512]
    python -m benchmarks.heal curve --model DIR [--minutes 5 15 30] [--lr 1e-4] [--trainable all]
        [--clock wall|cpu | --cpu-seconds-per-step S] [--name NAME]

throughput: the same model, data order, optimizer (AdamW, betas 0.9/0.95), clipping and lr schedule, stepped
by `heal()` and by a bare loop (forward with labels, backward, clip, step, zero_grad); the rounds alternate
bare / heal so that the load of a shared machine hits both alike. Reported: median seconds per optimizer step
and CPU seconds per optimizer step of each (the first two steps of every run skipped as warm-up), tokens/s,
and heal / bare (tokens/s ratio) in wall and in CPU time; on a busy shared machine the CPU-time ratio (with
OMP_NUM_THREADS=1) is the meaningful one.

curve: one healing run, stopped and resumed at each mark (a final checkpoint lets the next segment `--resume`
with the same data order and optimizer state), so the marks lie on one trajectory with a constant lr after
warmup. A mark is `--max-minutes` of training time (evaluation excluded), counted on the wall clock or, with
`--clock cpu`, in process CPU time (`budget_clock="cpu"`): on a shared machine the second is the fair
measure of "minutes of healing on this CPU", since the wall clock also counts the others' load (run it with
OMP_NUM_THREADS=1 so that CPU time is compute, not spin-waiting threads). With `--cpu-seconds-per-step S`
(the CPU cost of one step measured here), a mark is `minutes * 60 / S` steps instead: the trajectory depends
on steps, not on the hardware, so it can be computed on a faster machine (a GPU, in fp32) and read in
minutes of this CPU.
At each mark the held-out perplexity uses the project's protocol: the first `--eval-tokens` (8192) tokens
of *Persuasion*, disjoint 1024-token windows.

Results go to `--results` (JSON, default under `hf_attn.tooling.assets.cache_dir()/bench_heal/`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from hf_attn.conversion.training.data import ChunkOrder, HealSettings, chunk_tokens, load_train_corpus
from hf_attn.conversion.training.heal import heal
from hf_attn.conversion.training.recipe import CLOCKS, TRAINABLE, read_log
from hf_attn.tooling import assets, loading
from hf_attn.tooling.cli import ArgumentParser, run_command
from hf_attn.tooling.corpus import tokenize
from hf_attn.tooling.devices import resolve_device
from hf_attn.tooling.errors import UserError, check_number
from hf_attn.tooling.files import check_output, write_json
from hf_attn.tooling.loading import resolve_model

PROG = "python -m benchmarks.heal"
WRITER = "hf-attn benchmarks.heal"  # its JSON's written_by: an hf-attn output (the output guard)

SKIP = 2  # warm-up steps left out of every timing


def work_dir() -> Path:
    path = assets.cache_dir() / "bench_heal"
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------------------------- throughput


def bare_loop(
    model_dir: Path, chunks: torch.Tensor, *, steps: int, batch_size: int, lr: float, seed: int
) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds per optimizer step of a plain loop doing what a step of `heal` does."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    device = resolve_device("auto")  # where heal's Accelerator puts the model too
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    order = iter(ChunkOrder(len(chunks), seed=seed))
    times = []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        batch = chunks[[next(order) for _ in range(batch_size)]].to(device)  # (B, L)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()  # (waits for the device, as heal's logging does)
        times.append((time.perf_counter() - start, time.process_time() - cpu_start))
    return times


def throughput(
    *, model: str | None, steps: int, rounds: int, seq_len: int, batch_size: int, lr: float = 1e-4
) -> dict:
    source = resolve_model(model)
    train_file = assets.austen_file("northangerabbey")  # one novel is plenty for a few steps
    corpus, _ = load_train_corpus([train_file])
    chunks = chunk_tokens(tokenize(loading.load_tokenizer(source), corpus), seq_len)
    bare, healed = [], []  # (wall, cpu) seconds per step
    for r in range(rounds):
        bare += bare_loop(source, chunks, steps=steps, batch_size=batch_size, lr=lr, seed=r)[SKIP:]
        out = work_dir() / "throughput"
        run = HealSettings(
            model=str(source),
            output=str(out),
            train_text=[str(train_file)],
            max_steps=steps,
            seq_len=seq_len,
            batch_size=batch_size,
            lr=lr,
            schedule="constant",
            eval_tokens=0,
            seed=r,
            overwrite=True,
        )
        result = heal(run)
        log = [e for e in read_log(result["log"]) if e["event"] == "step"]
        healed += [(e["step_seconds"], e["cpu_seconds"]) for e in log][SKIP:]
    tokens = seq_len * batch_size
    bare_s, heal_s = (statistics.median(t[0] for t in x) for x in (bare, healed))
    bare_cpu, heal_cpu = (statistics.median(t[1] for t in x) for x in (bare, healed))
    return {
        "model": str(source),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "steps_timed": {"bare": len(bare), "heal": len(healed)},
        "bare_seconds_per_step": bare_s,
        "heal_seconds_per_step": heal_s,
        "bare_tokens_per_second": tokens / bare_s,
        "heal_tokens_per_second": tokens / heal_s,
        "heal_over_bare": bare_s / heal_s,
        # CPU time per step: what a busy shared machine does not distort (with one thread it is compute)
        "bare_cpu_seconds_per_step": bare_cpu,
        "heal_cpu_seconds_per_step": heal_cpu,
        "heal_over_bare_cpu": bare_cpu / heal_cpu,
        "bare_all": bare,
        "heal_all": healed,
        "torch_threads": torch.get_num_threads(),
        "versions": loading.library_versions(),
    }


# --------------------------------------------------------------------------------------------- curve


def curve(
    *,
    model: str,
    name: str,
    minutes: list[float],
    lr: float,
    trainable: str,
    warmup_steps: int,
    seq_len: int,
    batch_size: int,
    eval_tokens: int,
    clock: str = "wall",
    cpu_seconds_per_step: float | None = None,
) -> dict:
    """Heal `model` in segments ending at each mark of `minutes` (training time); perplexity at each mark."""
    root = work_dir() / name
    state = root / "state"
    marks = []
    for i, m in enumerate(sorted(minutes)):
        out = root / f"healed-{m:g}min"
        run = HealSettings(
            model=model,
            output=str(out),
            max_minutes=None if cpu_seconds_per_step else m,
            max_steps=round(m * 60 / cpu_seconds_per_step) if cpu_seconds_per_step else None,
            budget_clock=clock,
            seq_len=seq_len,
            batch_size=batch_size,
            train_corpus="austen",  # the curve's recipe: the five novels
            lr=lr,
            warmup_steps=warmup_steps,
            schedule="constant",
            trainable=trainable,
            eval_tokens=eval_tokens,
            state_dir=state,
            keep_checkpoints=True,
            resume=i > 0,
            overwrite=True,
        )
        result = heal(run)
        marks.append(
            {
                "minutes": m,
                "output": str(out),
                "steps": result["steps"],
                "tokens": result["tokens"],
                "train_seconds": result["train_seconds"],
                "train_cpu_seconds": result["train_cpu_seconds"],
                "final_loss": result["final_loss"],
                "perplexity": result["eval_after"]["perplexity"],
            }
        )
        print(f"[{name}] {m:g} min: {result['steps']} steps, ppl {result['eval_after']['perplexity']:.3f}")
    return {
        "name": name,
        "model": str(model),
        "recipe": {
            "lr": lr,
            "trainable": trainable,
            "warmup_steps": warmup_steps,
            "schedule": "constant",
            "seq_len": seq_len,
            "batch_size": batch_size,
            "clock": f"steps at {cpu_seconds_per_step} CPU s/step" if cpu_seconds_per_step else clock,
            "torch_threads": torch.get_num_threads(),
        },
        "eval": {
            "corpus": result["eval_before"]["corpus"],
            "tokens": eval_tokens,
            "context": 1024,
            "stride": 1024,
        },
        "perplexity_before": result["eval_before"]["perplexity"],
        "marks": marks,
        "log": result["log"],
        "versions": loading.library_versions(),
    }


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: the embedded SmolLM2)"
    )
    t.add_argument(
        "--steps", type=int, default=8, help=f"optimizer steps per run (the first {SKIP} not timed)"
    )
    t.add_argument("--rounds", type=int, default=2)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--batch-size", type=int, default=1)
    c = sub.add_parser("curve")
    c.add_argument("--model", required=True)
    c.add_argument("--name", default=None, help="work directory name (default: the model directory's name)")
    c.add_argument("--minutes", type=float, nargs="+", default=[5, 15, 30])
    c.add_argument("--lr", type=float, default=1e-4)
    c.add_argument("--trainable", default="all", choices=TRAINABLE)
    c.add_argument("--warmup-steps", type=int, default=10)
    c.add_argument("--seq-len", type=int, default=512)
    c.add_argument("--batch-size", type=int, default=1)
    c.add_argument("--eval-tokens", type=int, default=8192)
    c.add_argument("--clock", default="wall", choices=CLOCKS, help="what the minutes count")
    c.add_argument("--cpu-seconds-per-step", type=float, default=None, help="marks in steps: minutes*60/S")
    for sp in (t, c):
        sp.add_argument("--results", default=None, help="JSON file (default: under the bench_heal work dir)")
    return p


def check_args(args: argparse.Namespace) -> Path:
    """Every option, the model's files and the results path checked before any work; the results path."""
    integer = dict(inclusive=True, integer=True)
    check_number("--seq-len", args.seq_len, minimum=2, **integer)
    check_number("--batch-size", args.batch_size, minimum=1, **integer)
    if args.what == "throughput":
        check_number("--steps", args.steps, minimum=SKIP + 1, **integer)  # the first SKIP are not timed
        check_number("--rounds", args.rounds, minimum=1, **integer)
        default = assets.cache_dir() / "bench_heal" / "throughput.json"
    else:
        for minutes in args.minutes:
            check_number("--minutes", minutes)
        check_number("--lr", args.lr)
        check_number("--warmup-steps", args.warmup_steps, minimum=0, **integer)
        check_number("--eval-tokens", args.eval_tokens, minimum=1024, **integer)  # one 1024-token window
        check_number("--cpu-seconds-per-step", args.cpu_seconds_per_step)
        if args.name is not None and (
            not args.name or Path(args.name).name != args.name or args.name == ".."
        ):
            raise UserError(f"--name {args.name!r} is not a plain directory name; give one without '/'")
        default = assets.cache_dir() / "bench_heal" / f"curve-{args.name or Path(args.model).name}.json"
    loading.check_checkpoint_complete(resolve_model(args.model))
    if args.results is None:  # hf-attn's own cache: its earlier results are replaced
        return check_output(None, default, overwrite=True, flag="--results", kind=None)
    return check_output(None, args.results, overwrite=True, flag="--results", kind="json")


def bench(args: argparse.Namespace) -> None:
    """The command's work: the checks, then the measurement, its summary and the JSON record."""
    path = check_args(args)
    if args.what == "throughput":
        res = throughput(
            model=args.model,
            steps=args.steps,
            rounds=args.rounds,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
        )
        print(
            f"bare {res['bare_tokens_per_second']:.1f} tok/s, "
            f"heal {res['heal_tokens_per_second']:.1f} tok/s: heal/bare = {res['heal_over_bare']:.3f} "
            f"({res['steps_timed']} timed steps, median); CPU time: heal/bare = "
            f"{res['heal_over_bare_cpu']:.3f}"
        )
    else:
        res = curve(
            model=args.model,
            name=args.name or Path(args.model).name,
            minutes=args.minutes,
            lr=args.lr,
            trainable=args.trainable,
            warmup_steps=args.warmup_steps,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            eval_tokens=args.eval_tokens,
            clock=args.clock,
            cpu_seconds_per_step=args.cpu_seconds_per_step,
        )
    write_json(path, res, prog=WRITER)
    print(f"results: {path}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
