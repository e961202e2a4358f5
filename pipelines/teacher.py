"""What the `teacher` role (on-policy distillation, `use_opd` / `is_pure_opd`) scores each step: the
trainer's view of the sampled sequences, or with `opsd` (self-distillation) the same responses after
a privileged prompt: `opsd_template` holding the row's reference answer, then the prompt the student
sampled from. The response tokens and their mask are the student's, so the teacher's (B, T)
log-probs line up with the old policy's token for token."""
from __future__ import annotations

from typing import Any, Sequence

from roll_gspo.algorithms.distillation import opsd_hint, privileged_prompts
from roll_gspo.distributed.batch import Batch
from roll_gspo.models.causal_lm import build_sequences
from roll_gspo.schema.config import PipelineConfig


def teacher_view(cfg: PipelineConfig, tokenizer: Any, batch: Batch, trainer_view: Batch) -> Batch:
    """`trainer_view` unchanged without opsd; with it, a copy whose input_ids, attention_mask,
    prompt_lengths and response_mask lay out each row's hint ids + prompt ids + response ids (the
    hint: `opsd_template` with the row's reference answer, encoded without special tokens)."""
    if not cfg.opsd:
        return trainer_view
    hints = hint_ids(tokenizer, cfg.opsd_template, batch["ground_truth"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids, attention, prompt_lengths, response_mask = build_sequences(
        privileged_prompts(batch["prompt_ids"], hints), batch["response_ids"], pad)
    view = Batch(dict(trainer_view.tensors), dict(trainer_view.meta))
    view["input_ids"], view["attention_mask"] = input_ids, attention
    view["prompt_lengths"], view["response_mask"] = prompt_lengths, response_mask
    return view


def hint_ids(tokenizer: Any, template: str, ground_truths: Sequence[Any]) -> list:
    """Each row's privileged context as token ids: the template holding the row's reference answer
    (a task row's JSON `answer`, else the ground truth as written; none: empty). Special tokens
    written in the template (e.g. ChatML's <|im_start|>) encode as themselves."""
    from roll_gspo.tasks import reference_answer

    return [tokenizer.encode(opsd_hint(template, "" if truth is None else reference_answer(truth)),
                             add_special_tokens=False) for truth in ground_truths]
