"""What every reward worker applies around its own score: the text it scores, a format check,
a length penalty."""
from __future__ import annotations

import re
from typing import List, Optional, Sequence


def think_token_ids(tokenizer) -> set:
    """Ids of added tokens that mark reasoning (``<think>``, ``</think>`` and the like)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {i for i, tok in added.items() if "think" in str(getattr(tok, "content", tok)).lower()}


def decode_for_reward(tokenizer, sequences: Sequence[Sequence[int]]) -> List[str]:
    """Response texts as a reward must see them: special tokens dropped (eos, pad, chat markers)
    except reasoning markers. A tokenizer that registers ``<think>`` as a special token would
    otherwise lose it in ``skip_special_tokens=True`` decoding, and a reward could no longer tell
    an answer from unfinished reasoning."""
    keep = think_token_ids(tokenizer)
    if not keep:
        return tokenizer.batch_decode(sequences, skip_special_tokens=True)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    drop = set(tokenizer.all_special_ids) | {i for i, tok in added.items() if getattr(tok, "special", False)}
    drop -= keep
    return tokenizer.batch_decode([[t for t in seq if t not in drop] for seq in sequences],
                                  skip_special_tokens=False)


def matches_format(response: str, pattern: Optional[str]) -> bool:
    """ROLL's format check: the whole response must match ``pattern`` (``re.match``, DOTALL and
    MULTILINE). No pattern: every response passes."""
    if not pattern:
        return True
    return re.match(pattern, str(response or ""), re.DOTALL | re.MULTILINE) is not None


def length_penalty(num_response_tokens: int, max_response_tokens: int, coef: float) -> float:
    """``coef * tokens / max_tokens``: a response of the full length pays ``coef``, an empty one 0."""
    if not coef:
        return 0.0
    return float(coef) * num_response_tokens / max(1, max_response_tokens)
