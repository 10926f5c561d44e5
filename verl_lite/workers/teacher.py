"""The distillation teacher's role: a frozen causal-LM ``MegatronEngine`` (``distillation.teacher_model``) on the
actor's workers in a layout of its own, as the reward model. It scores the student's rollout rows: the log-prob of
every sampled token at the student's temperature, so the per-token divergences compare like with like. Its
tokenizer must equal the student's (it reads the student's token ids): ``teacher_problems`` checks that first.
For ``forward_kl_topk`` it gives, per response position, its k largest log-probs and their ids instead (ids only
below the student's vocabulary size, so the student can score every one).
"""

from __future__ import annotations

import torch

from verl_lite.algorithms.distillation import TEACHER_LOG_PROBS_KEY, TEACHER_TOPK_IDS_KEY, TEACHER_TOPK_LOG_PROBS_KEY
from verl_lite.engine.model_files import model_config_problems, model_weight_problems, read_config
from verl_lite.workers.engine_worker import EngineWorker, sequence_batch

TEACHER_KEY = "distillation.teacher_model.model_path"
STUDENT_KEY = "actor_rollout_ref.model.path"
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


class TeacherWorker(EngineWorker):
    def compute_teacher_log_prob(self, piece, micro_batches: list[list[int]], temperature: float,
                                 topk: int | None = None, topk_below: int | None = None) -> dict | None:
        """This DP rank's piece (None off the output owner): ``{"teacher_log_probs": [n, W]}``, or with ``topk``
        ``{"teacher_topk_log_probs": [n, W, k], "teacher_topk_ids": [n, W, k] int32}`` (ids < ``topk_below``)."""
        batch = sequence_batch(piece)
        if topk is None:
            out = self.engine.infer(batch, micro_batches, temperature, outputs=("log_probs",))
            return None if out is None else {TEACHER_LOG_PROBS_KEY: out["log_probs"]}
        out = self.engine.infer(batch, micro_batches, temperature, outputs=("topk_log_probs", "topk_ids"), topk=topk,
                                topk_below=topk_below)
        return None if out is None else {TEACHER_TOPK_LOG_PROBS_KEY: out["topk_log_probs"],
                                         TEACHER_TOPK_IDS_KEY: out["topk_ids"].to(torch.int32)}


def tokenizer_difference(student, teacher) -> str | None:
    """How the two tokenizers differ (vocabulary: token -> id; special tokens and their ids), or None when equal."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        differ = sorted(k for k in set(s_vocab) | set(t_vocab) if s_vocab.get(k) != t_vocab.get(k))
        shown = ", ".join(f"{k!r}: {s_vocab.get(k)} vs {t_vocab.get(k)}" for k in differ[:3])
        return (f"the vocabularies differ in {len(differ)} tokens (student vs teacher id: {shown}"
                f"{', ...' if len(differ) > 3 else ''})")
    specials = [(name, getattr(student, name, None), getattr(teacher, name, None)) for name in SPECIAL_TOKEN_ATTRIBUTES]
    specials += [("special tokens", sorted(student.all_special_tokens), sorted(teacher.all_special_tokens))]
    differ = [f"{name} {s!r} vs {t!r}" for name, s, t in specials if s != t]
    return f"the special tokens differ (student vs teacher: {'; '.join(differ)})" if differ else None


def teacher_problems(teacher_path: str, student_tokenizer: str | None) -> list[str]:
    """The teacher (``teacher_path``) is a causal LM whose weights match its config.json, and its tokenizer loads
    and equals the student's (``student_tokenizer``: its directory); one line per problem."""
    from transformers import AutoTokenizer

    p = model_config_problems(TEACHER_KEY, teacher_path) or model_weight_problems(TEACHER_KEY, teacher_path, "lm")
    arch = (read_config(teacher_path) or {}).get("architectures") or []
    if not p and not any(str(a).endswith("ForCausalLM") for a in arch):
        p.append(f"{TEACHER_KEY}={teacher_path!r} is a {arch or 'model without architectures'}; a teacher is a causal "
                 f"LM (an AutoModelForCausalLM checkpoint with lm_head) whose next-token log-probs score the student")
    loaded = {}
    for key, path in ((TEACHER_KEY, teacher_path), (STUDENT_KEY, student_tokenizer)):
        try:
            loaded[key] = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - whatever the loader raises, named with the key
            p.append(f"{key}={path!r}: the tokenizer cannot be loaded ({type(e).__name__}: {e}); the teacher and the "
                     f"student must each have tokenizer.json / tokenizer_config.json")
    if len(loaded) == 2 and (why := tokenizer_difference(loaded[STUDENT_KEY], loaded[TEACHER_KEY])):
        p.append(f"{TEACHER_KEY}={teacher_path!r}: its tokenizer is not the student's "
                 f"({STUDENT_KEY}={student_tokenizer!r}): {why}; the teacher scores the student's token ids, so give "
                 f"a teacher trained with the student's tokenizer")
    return p
