"""Token-in, token-out conversations: the ids of a multi-turn episode, built turn by turn.

The rollout engine's generated ids are kept as they are; only the messages appended after a turn
(the environment's observation, a tool result) are rendered and tokenised, once. Generated text is
never decoded and re-tokenised, so the trainer scores exactly the ids the engine sampled (the drift
behind verl's tokenization sanity checks and multi-turn log-prob mismatches cannot happen).

What to append after a turn is the chat template's suffix: render a reference conversation with an
assistant message and the new messages, and keep what follows the assistant's content. When the
engine's turn ended with the end-of-turn token (EOS), the suffix starts after that token's text;
when it was cut at its token cap, the suffix keeps the template's closing of the assistant turn, so
the context stays well-formed (those ids are not generated and are masked out of the loss).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from roll_gspo.data.chat_templates import render_chat

Messages = List[Dict[str, str]]
# Reference conversation of the suffix computation: contents that no template rewrites.
_PROBE_USER = "roll-gspo-probe-user"
_PROBE_ASSISTANT = "roll-gspo-probe-assistant"


class ChatStitcher:
    """Renders and tokenises the non-generated parts of a conversation under one chat template
    (`data_args.template`; null: the tokenizer's own, `native`)."""

    def __init__(self, tokenizer, template: Optional[str] = None):
        self.tokenizer = tokenizer
        self.template = template or "native"
        self.eos_text = tokenizer.eos_token or ""
        self.eos_id = tokenizer.eos_token_id

    def render(self, messages: Messages) -> str:
        return render_chat(self.template, self.tokenizer, messages)

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def initial_ids(self, messages: Messages) -> List[int]:
        """(L0,) ids of the episode's opening (system and first user message), ending with the
        opening of the assistant turn."""
        return self.encode(self.render(messages))

    def suffix_text(self, new_messages: Messages, turn_finished: bool, system: Optional[str] = None) -> str:
        """Text to append after an assistant turn so that the next turn opens after `new_messages`.
        `turn_finished`: the turn's ids end with the end-of-turn token (its text is then dropped)."""
        head: Messages = [{"role": "system", "content": system}] if system else []
        head.append({"role": "user", "content": _PROBE_USER})
        opening = self.render(head)
        full = self.render(head + [{"role": "assistant", "content": _PROBE_ASSISTANT}] + list(new_messages))
        start = opening + _PROBE_ASSISTANT
        if not full.startswith(start):
            raise ValueError(f"chat template {self.template!r} does not render a conversation as a prefix of its "
                             f"continuation, so turns cannot be appended token by token; name a prefix-preserving "
                             f"template in actor_train.data_args.template (`chatml`, `qwen2_5`)")
        rest = full[len(start):]
        if turn_finished and self.eos_text and self.eos_text in rest:
            rest = rest[rest.index(self.eos_text) + len(self.eos_text):]
        return rest

    def suffix_ids(self, new_messages: Messages, turn_finished: bool, system: Optional[str] = None) -> List[int]:
        """(S,) ids appended after a turn: the new messages and the opening of the next assistant turn."""
        return self.encode(self.suffix_text(new_messages, turn_finished, system))

    def turn_finished(self, generated: Sequence[int]) -> bool:
        return bool(generated) and self.eos_id is not None and generated[-1] == self.eos_id
