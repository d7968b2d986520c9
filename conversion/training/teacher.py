"""Healing, the teacher: which checkpoint teaches (`resolve_teacher`), the check that it speaks the
student's vocabulary, the frozen teacher itself (`load_teacher`) and the loss (`training_loss`).

The teacher never trains and is never written: eval mode, `requires_grad=False`, its forward under `no_grad`
and outside autocast, in the dtype its config declares. It is not given to accelerate: under data parallel
and FSDP every process holds a whole replica (an inference-only model needs no gradient synchronisation and
no sharded optimizer), so a sharded student with a replicated teacher needs the teacher's weights once per
process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hf_attn.conversion.training.data import HealSettings
from hf_attn.conversion.training.recipe import HealRecipe, load_model, stored_dtype
from hf_attn.tooling import loading
from hf_attn.tooling.errors import UserError
from hf_attn.tooling.files import checkpoint_hash

NO_TEACHER = "none"
AUTO_TEACHER = "auto"


def resolve_teacher(teacher: str, student: Path) -> tuple[Path | None, str | None, str | None]:
    """(teacher directory, its weights hash, a note to print) for `--teacher`: `none` -> no teacher; `auto` ->
    the recorded source when its directory is here with the recorded weights, else no teacher and a note
    saying why; anything else -> that checkpoint (a directory or a hub id), which must be complete."""
    if teacher == NO_TEACHER:
        return None, None, None
    if teacher != AUTO_TEACHER:
        path = loading.resolve_model(teacher)
        loading.check_checkpoint_complete(path)
        return path, checkpoint_hash(path), None
    # the source of the student's first record: the model every later step (conversion, refinement, healing,
    # export) tries to preserve
    history = (loading.read_config(student).get("hf_attn") or {}).get("history") or []
    if not history or not history[0].get("source"):
        return None, None, f"--teacher auto: {student} records no source; healing on next-token labels only"
    path, recorded_hash = Path(history[0]["source"]), str(history[0].get("source_hash") or "")
    problem = None if (path / "config.json").is_file() else "is not on this machine"
    if problem is None:
        try:
            digest = checkpoint_hash(path)
        except OSError:
            digest = None
        if digest is None or (recorded_hash and digest != recorded_hash):
            problem = "has other weights now"
    if problem:
        return None, None, f"--teacher auto: the recorded source {path} {problem}; healing on labels only"
    return path, digest, None


def check_same_vocabulary(teacher: Path, student: Path, *, trust_remote_code: bool = False) -> None:
    """UserError unless the teacher's tokenizer maps every token to the student's id and both models have
    the same number of logits (the KL is taken token by token over one vocabulary)."""
    configs = [loading.load_config(p, trust_remote_code=trust_remote_code) for p in (teacher, student)]
    sizes = [c.get_text_config().vocab_size for c in configs]
    vocabs = [loading.load_tokenizer(p).get_vocab() for p in (teacher, student)]
    if sizes[0] != sizes[1] or vocabs[0] != vocabs[1]:
        detail = (
            f"{sizes[0]} logits against {sizes[1]}"
            if sizes[0] != sizes[1]
            else f"tokenizers of {len(vocabs[0])} and {len(vocabs[1])} tokens that differ"
        )
        raise UserError(
            f"--teacher {teacher} has another vocabulary than the student {student} ({detail}); distillation "
            "needs the same tokenizer: give the checkpoint the student was converted from, or --teacher none"
        )


def load_teacher(path: Path, settings: HealSettings, *, device):
    """The frozen teacher: its config's dtype, eval mode, no parameter requiring a gradient, on `device`; the
    attention implementation and `trust_remote_code` of the run's `settings`."""
    s = settings
    options = {"attn_implementation": s.attn_implementation, "trust_remote_code": s.trust_remote_code}
    teacher = load_model(path, gradient_checkpointing=False, dtype=stored_dtype(path), **options)
    return teacher.requires_grad_(False).eval().to(device)


def distill_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """T^2 x mean over positions of KL(p_teacher || p_student), both softmax(logits / T) over the vocabulary;
    logits (..., V), computed in float32 at least (`_SoftKL`: a student equal to its teacher gets a KL and
    a gradient of exactly 0)."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    vocab = student_logits.shape[-1]
    student = student_logits.to(dtype).reshape(-1, vocab)
    return _SoftKL.apply(student, teacher_logits.detach().to(dtype).reshape(-1, vocab), float(temperature))


class _SoftKL(torch.autograd.Function):
    """T^2 x mean_n KL(softmax(t_n / T) || softmax(s_n / T)) of logits (N, V), and its gradient in closed
    form: T (q - p) / N with p, q the teacher's and the student's distributions (autograd through
    log_softmax would give T (q sum(p) - p) / N: rounding, not 0, where q == p). Saves q - p only."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
        log_q = torch.log_softmax(student / temperature, dim=-1)
        log_p = torch.log_softmax(teacher / temperature, dim=-1)
        p = log_p.exp()
        n = student.shape[0]
        kl = (p * (log_p - log_q)).sum() / n
        ctx.save_for_backward(log_q.exp() - p)
        ctx.scale = temperature / n
        return kl * temperature**2

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (diff,) = ctx.saved_tensors
        return grad * ctx.scale * diff, None, None


def training_loss(net, teacher, input_ids: torch.Tensor, recipe: HealRecipe):
    """(loss to minimise, next-token cross-entropy, KL or None) of a batch of chunks (B, L). With a teacher
    the loss is w x KL + (1 - w) x cross-entropy (w = `recipe.distill_weight`), over the L - 1 positions
    whose next token the chunk holds (those the cross-entropy scores too)."""
    out = net(input_ids=input_ids, labels=input_ids, use_cache=False)
    if teacher is None:
        return out.loss, out.loss, None
    with torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
        target = teacher(input_ids=input_ids, use_cache=False).logits[:, :-1]
    kl = distill_loss(out.logits[:, :-1], target, recipe.distill_temperature)
    w = recipe.distill_weight
    loss = kl if w == 1 else w * kl + (1 - w) * out.loss
    return loss, out.loss, kl
