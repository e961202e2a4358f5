"""A sequence-classification reward model scoring prompt + response (e.g. a Bradley-Terry model
trained on preferences): `AutoModelForSequenceClassification` with one output, batched."""
from __future__ import annotations

from typing import List, Sequence

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class SequenceRewardModel:
    """``score(prompts, responses)``: the model's scalar for each ``prompt + response`` text.

    The texts are tokenized with the reward model's own tokenizer (it need not share the policy's),
    right-padded in batches of ``batch_size``; the pooled logit of a one-label head is the score.
    """

    def __init__(self, path: str, *, dtype: str = "fp32", batch_size: int = 8, max_length: int = 4096,
                 device: str = "cpu"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=_DTYPES[dtype]).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward model {path} has {self.model.config.num_labels} labels; a reward model has "
                             f"one output (num_labels=1)")
        pad = self.tokenizer.pad_token_id
        if pad is None:  # the head pools the last non-pad token: it must know the pad id
            pad = self.tokenizer.eos_token_id
            self.tokenizer.pad_token_id = pad
        self.model.config.pad_token_id = pad
        self.tokenizer.padding_side = "right"
        self.batch_size, self.max_length, self.device = int(batch_size), int(max_length), device

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> List[float]:
        texts = [f"{p}{r}" for p, r in zip(prompts, responses)]
        out: List[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.max_length).to(self.device)
            out += self.model(**enc).logits[:, 0].float().tolist()
        return out
