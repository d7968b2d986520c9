"""Task accuracy of a loaded model on the local Persuasion tasks, for the study's accuracy column.

`task_accuracy(model, tokenizer)` runs lm-eval (`eval.harness.evaluate_model`: `lm_eval.simple_evaluate` with
lm-eval's `HFLM` around the model already in memory, the local task index only) and returns the numbers flat:

    {"lastword_acc": ..., "lastword_ppl": ..., "nextsent_acc": ..., "nextsent_acc_norm": ...,
     "items": {"persuasion_lastword": n, "persuasion_nextsent": n}, "limit": limit, "seconds": ...}

The scores are lm-eval's own (tests/test_harness.py checks them against an independent computation).
"""

from __future__ import annotations

import contextlib
import io
import logging
import time

from hf_attn.eval.harness import evaluate_model
from hf_attn.tooling.task_data import TASKS

_KEYS = {
    ("persuasion_lastword", "acc,none"): "lastword_acc",
    ("persuasion_lastword", "perplexity,none"): "lastword_ppl",
    ("persuasion_nextsent", "acc,none"): "nextsent_acc",
    ("persuasion_nextsent", "acc_norm,none"): "nextsent_acc_norm",
}


def task_accuracy(
    model, tokenizer, *, tasks: tuple[str, ...] = TASKS, limit: int | None = None, batch_size: int = 16
) -> dict:
    """Accuracy (and the last word's perplexity) of `model` on the local tasks (default: both); `limit` =
    first N items of each (None: all of them)."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {tasks!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for every item), got {limit}")
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    lm_eval_log = logging.getLogger("lm_eval")
    level = lm_eval_log.level
    lm_eval_log.setLevel(logging.ERROR)  # a library call: lm-eval's warnings and progress bars stay quiet
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            results = evaluate_model(
                model, tokenizer, list(tasks), batch_size=batch_size, limit=limit, bootstrap_iters=0
            )["results"]
    finally:
        model.train(was_training)
        lm_eval_log.setLevel(level)
    out = {name: results[task][key] for (task, key), name in _KEYS.items() if task in tasks}
    out["items"] = {task: results[task]["sample_len"] for task in tasks}
    out["limit"] = limit
    out["seconds"] = time.perf_counter() - start
    return out
