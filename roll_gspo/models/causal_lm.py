"""Model-side helpers shared by the trainer, the reference and the hf_infer rollout: loading a
causal LM, laying out prompt+response batches, and per-token log-probs of sampled tokens."""
from __future__ import annotations

import inspect
from typing import List, Optional, Sequence, Tuple

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_causal_lm(path: str, dtype: str = "fp32", attn_implementation: Optional[str] = None):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": TORCH_DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    contiguous_head_input(model)
    return model


def _make_contiguous(module, args):
    return (args[0].contiguous(),) + tuple(args[1:])


def contiguous_head_input(model: torch.nn.Module) -> bool:
    """Hand the LM head a contiguous input; returns whether a head was found.

    `logits_to_keep` slices the hidden states (a strided view). With the head's weight frozen (LoRA,
    a reference or teacher) torch's matmul then expands the (vocabulary x hidden) weight once per
    row and copies it for a batched matmul instead of folding the rows into one: SmolLM2 in bf16,
    a LoRA scoring pass took 358 ms a row against 170 ms with a contiguous input (the copy of the
    (B, S, hidden) input is small), and a LoRA training micro-batch 5.8 s against 4.2 s."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        return False
    head.register_forward_pre_hook(_make_contiguous)
    return True


def sparse_tied_embedding_grad(model: torch.nn.Module) -> bool:
    """Let a trained input embedding that is tied to the LM head send a sparse gradient (only the
    rows of the batch's tokens); returns whether it did.

    Tied, the embedding's gradient meets the head's dense one in autograd's sum, so the parameter's
    gradient stays dense and equal (up to the order of adding a repeated token's rows); what goes is
    the embedding's own vocabulary x hidden dense gradient, zero-filled and added for every backward
    pass: memory traffic. At a 152k vocabulary (0.5B, fp32, 2 threads, a micro-batch of 2 x 144
    tokens; `benchmarks/bench_embedding_grad.py`) the backward took 3.23 -> 3.09 s on a quiet machine
    (-4 %) and 5.9 -> 4.5 s beside a learning run, where memory bandwidth is shared.
    Untied, the parameter's gradient would itself be sparse, which AdamW and the engines refuse:
    left dense."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not (isinstance(embedding, torch.nn.Embedding) and head is not None
            and head.weight is embedding.weight and embedding.weight.requires_grad):
        return False
    embedding.sparse = True
    return True


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


def _accepts_logits_to_keep(model) -> bool:
    """Whether the (possibly DeepSpeed-wrapped) causal LM's forward takes `logits_to_keep`."""
    module = getattr(model, "module", model)
    if hasattr(module, "get_base_model"):  # a PEFT model passes its keywords on to the base model's forward
        module = module.get_base_model()
    try:
        return "logits_to_keep" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def response_token_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             prompt_lengths: torch.Tensor, response_len: int, temperature: float = 1.0,
                             with_entropy: bool = False, entropy_grad: bool = False,
                             ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and optionally entropies) of the response tokens under `model`.

    input_ids, attention_mask: (B, L), right-padded prompt+response. prompt_lengths: (B,).
    Returns (log_probs (B, response_len), entropy (B, response_len) or None), fp32; positions past
    a row's response hold garbage and must be masked by the caller's response_mask.
    Logits are divided by `temperature` so the scored policy is the one the rollout sampled.

    Memory: the model computes logits only from the first response position on (`logits_to_keep`),
    and the log-softmax runs in chunks (`roll_gspo.algorithms.logprobs`), so one (B, S, V) logits
    tensor (and its gradient when training) is the only vocabulary-wide allocation.
    """
    from roll_gspo.algorithms.logprobs import sampled_token_log_probs

    batch, length = input_ids.shape
    device = input_ids.device
    prompt_lengths = prompt_lengths.to(device)
    # Position p-1 predicts token p; response token t of row i sits at prompt_len_i + t. Clamped at
    # the last predicting position: what lies past a row's response is garbage either way.
    offsets = torch.arange(response_len, device=device)
    position = (prompt_lengths[:, None] - 1 + offsets[None, :]).clamp(min=0, max=length - 2)  # (B, T)
    targets = torch.gather(input_ids, 1, position + 1)
    first = int(position.min()) if position.numel() else length - 1
    keep = length - first
    kwargs = {"logits_to_keep": keep} if _accepts_logits_to_keep(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
    logits = logits[:, logits.shape[1] - keep:]  # positions first..L-1 (a view)
    rows = torch.arange(batch, device=device).repeat_interleave(response_len)
    log_probs, entropy = sampled_token_log_probs(
        logits, rows, (position - first).reshape(-1), targets.reshape(-1),
        temperature if temperature not in (0.0, None) else 1.0, with_entropy and not entropy_grad)
    shape = (batch, response_len)
    if with_entropy and entropy_grad:
        # An entropy bonus is trained on: a differentiable (and vocabulary-wide) entropy, paid only
        # when `entropy_loss_coef > 0`.
        z = logits[rows, (position - first).reshape(-1)].float()
        if temperature not in (0.0, None, 1.0):
            z = z / temperature
        log_softmax = torch.log_softmax(z, dim=-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs.view(shape), entropy.view(shape) if entropy is not None else None


def micro_batches(size: int, micro: int) -> List[slice]:
    return [slice(i, min(i + micro, size)) for i in range(0, size, micro)]


def num_micro_batches(size: int, micro: int) -> int:
    return -(-size // micro)


def score_micro_batches(model, batch, plans, temperature: float, passes: Optional[int] = None) -> torch.Tensor:
    """(B, T) log-probs of `batch`'s responses (a `Batch` with input_ids, attention_mask,
    prompt_lengths, response_mask), one forward pass per micro-batch of `plans`
    (`roll_gspo.distributed.micro_batching`; each cut to its own longest row). Positions past a
    row's response hold zeros.

    `passes` (>= len(plans)) pads the work with forward passes whose output is dropped:
    under ZeRO-3 every forward all-gathers parameters, so each rank must run as many passes as its
    peers even when the shards are uneven (or one is empty), or the ranks deadlock.
    """
    from roll_gspo.distributed.micro_batching import scatter_rows, take

    width = batch["response_mask"].shape[1] if len(batch) else 0
    parts = []
    for plan in plans:
        micro_batch = take(batch, plan)
        log_probs, _ = response_token_log_probs(model, micro_batch["input_ids"], micro_batch["attention_mask"],
                                                micro_batch["prompt_lengths"], micro_batch["response_mask"].shape[1],
                                                temperature)
        parts.append(log_probs)
    padding_passes(model, (passes or 0) - len(parts), temperature)
    return scatter_rows(parts, plans, len(batch), width)


def padding_pass(model, temperature: float = 1.0) -> torch.Tensor:
    """One forward pass on one token of context, one scored: what a rank with fewer micro-batches
    than its peers runs so that collectives inside the passes (ZeRO-3 parameter gathers, ZeRO-2
    gradient reductions) pair up. Returns the log-prob (with its graph), for a zero-weight backward."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(iter(getattr(model, "module", model).parameters())).device)
    log_probs, _ = response_token_log_probs(model, ids, torch.ones_like(ids), torch.ones(1, dtype=torch.long), 1,
                                            temperature)
    return log_probs


def padding_passes(model, count: int, temperature: float) -> None:
    """`count` (<= 0: none) padding passes without gradient (scoring): they keep a rank with fewer
    micro-batches in step with its ZeRO-3 peers."""
    for _ in range(max(0, count)):
        padding_pass(model, temperature)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability in `model` to 0; returns how many were nonzero.

    RL forward passes must see one deterministic policy: old log-probs are scored in eval mode and
    new ones in train mode, so with dropout the importance ratio is not 1 before any update.
    Covers `nn.Dropout*` modules, float attributes named like `*dropout*` / `*pdrop*` that
    attention code reads at forward time (Qwen2's `attention_dropout`) and the same keys of the
    model's config. Callers that save the config copy it first.
    """
    changed, seen = 0, set()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p, changed = 0.0, changed + 1
        config = getattr(module, "config", None)
        targets = [module]
        if hasattr(config, "to_dict") and id(config) not in seen:
            seen.add(id(config))
            targets.append(config)
        for target in targets:
            for name, value in list(vars(target).items()):
                if (("dropout" in name or "pdrop" in name) and isinstance(value, float)
                        and not isinstance(value, bool) and value != 0.0):
                    setattr(target, name, 0.0)
                    changed += 1
    return changed
