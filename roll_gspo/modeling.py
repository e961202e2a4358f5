"""Model-side helpers shared by the trainer, the reference and the hf_infer rollout: loading a
causal LM, laying out prompt+response batches, and per-token log-probs of sampled tokens."""
from __future__ import annotations

from contextlib import nullcontext
from typing import List, Optional, Sequence, Tuple

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_causal_lm(path: str, dtype: str = "fp32", attn_implementation: Optional[str] = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": TORCH_DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def pad_2d(rows: Sequence[Sequence[int]], pad_value: int = 0, width: Optional[int] = None) -> torch.Tensor:
    """Right-pad ragged integer rows into a (len(rows), width) tensor."""
    width = width if width is not None else max((len(r) for r in rows), default=0)
    # One tensor built from padded lists: a copy per row costs ~30 us each, on the step's critical path.
    padded = [list(row)[:width] + [pad_value] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.long).reshape(len(rows), width)


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) long mask, 1 on the first lengths[i] positions of row i."""
    return (torch.arange(width)[None, :] < lengths[:, None]).long()


def build_sequences(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                    pad_token_id: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out prompt+response rows, right-padded.

    Returns input_ids (B, L), attention_mask (B, L), prompt_lengths (B,), and response_mask (B, T)
    with T the longest response: 1 on real response tokens.
    """
    input_ids = pad_2d([list(p) + list(r) for p, r in zip(prompt_ids, response_ids)], pad_token_id)
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    response_lengths = torch.tensor([len(r) for r in response_ids], dtype=torch.long)
    attention_mask = length_mask(prompt_lengths + response_lengths, input_ids.shape[1])
    response_mask = length_mask(response_lengths, int(response_lengths.max()) if len(response_ids) else 0).float()
    return input_ids, attention_mask, prompt_lengths, response_mask


def response_token_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             prompt_lengths: torch.Tensor, response_len: int, temperature: float = 1.0,
                             with_entropy: bool = False, entropy_grad: bool = False,
                             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and optionally entropies) of the response tokens under `model`.

    input_ids, attention_mask: (B, L), right-padded prompt+response. prompt_lengths: (B,).
    Returns (log_probs (B, response_len), entropy (B, response_len) or None); positions past a
    row's response hold garbage and must be masked by the caller's response_mask.
    Logits are divided by `temperature` so the scored policy is the one the rollout sampled.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    next_tokens = input_ids[:, 1:]
    # Position p-1 predicts token p; response token t of row i sits at prompt_len_i + t.
    offsets = torch.arange(response_len, device=input_ids.device)
    index = (prompt_lengths.to(input_ids.device)[:, None] - 1 + offsets[None, :]).clamp(max=logits.shape[1] - 1)
    picked_logits = torch.gather(logits, 1, index[:, :, None].expand(-1, -1, logits.shape[-1]))
    log_softmax = torch.log_softmax(picked_logits, dim=-1)
    targets = torch.gather(next_tokens, 1, index)
    log_probs = torch.gather(log_softmax, 2, targets[:, :, None]).squeeze(-1)
    entropy = None
    if with_entropy:  # a metric (no autograd graph) unless an entropy bonus is trained on
        with (nullcontext() if entropy_grad else torch.no_grad()):
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def micro_batches(size: int, micro: int) -> List[slice]:
    return [slice(i, min(i + micro, size)) for i in range(0, size, micro)]
