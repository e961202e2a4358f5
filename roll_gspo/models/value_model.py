"""The critic's value model (PPO with `adv_estimator: gae`): the policy's architecture with a scalar
head, loaded from any Hugging Face causal-LM folder, and its per-token values on response positions.

The model is transformers' `AutoModelForTokenClassification` with `num_labels=1`: the decoder body
loads from the causal LM's weights (its LM head is left out) and the head, `score`
(Linear(hidden, 1)), starts from transformers' initialisation. It is a `PreTrainedModel`, so
gradient checkpointing, ZeRO-3's partitioned loading and FSDP2's layer units work as for the policy.

Alignment: the value of response position t is read from the hidden state that predicts response
token t (sequence position prompt_len - 1 + t), the state in which the policy chose token t, as
`response_token_log_probs` aligns log-probs.
"""
from __future__ import annotations

from typing import Optional

import torch

from roll_gspo.models.causal_lm import TORCH_DTYPES


def load_value_model(path: str, dtype: str = "fp32", attn_implementation: Optional[str] = None):
    """A value model (scalar head over the causal LM's body) from a causal-LM folder `path`."""
    import logging

    from transformers import AutoModelForTokenClassification

    kwargs = {"dtype": TORCH_DTYPES[dtype], "num_labels": 1}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    # The missing `score` head is expected (it is new); transformers would log it as a warning.
    log = logging.getLogger("transformers.modeling_utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return AutoModelForTokenClassification.from_pretrained(path, **kwargs)
    finally:
        log.setLevel(level)


def response_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: torch.Tensor,
                    response_len: int) -> torch.Tensor:
    """Values of the response positions under `model` (a value model, possibly engine-wrapped).

    input_ids, attention_mask: (B, L), right-padded prompt+response; prompt_lengths: (B,).
    Returns (B, response_len) fp32 values (with grad when the model has it); positions past a row's
    response hold garbage and must be masked by the caller's response_mask.
    """
    length = input_ids.shape[1]
    device = input_ids.device
    position = (prompt_lengths.to(device)[:, None] - 1 + torch.arange(response_len, device=device)[None, :])
    position = position.clamp(min=0, max=max(length - 1, 0))  # (B, T)
    scores = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, L, 1)
    return torch.gather(scores[..., 0].float(), 1, position)


def value_padding_pass(model) -> torch.Tensor:
    """One forward pass on two tokens (what a rank with fewer micro-batches than its peers runs so
    that collective passes pair up); returns the (1, 1) value, with its graph."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(iter(getattr(model, "module", model).parameters())).device)
    return response_values(model, ids, torch.ones_like(ids), torch.ones(1, dtype=torch.long), 1)
