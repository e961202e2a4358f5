"""Named chat templates (`data_args.template`, ROLL's names): chat messages -> prompt text.

Each template takes the tokenizer and a list of ``{"role", "content"}`` messages and returns the
text the model sees, ending with the opening of the assistant turn. The ChatML-based ones are
written out here, so they give the same text whatever the tokenizer (a model trained on
another format can still be fed Qwen's); `native` and `longcot_V3` use the tokenizer's own.
"""
from __future__ import annotations

from typing import Callable, Dict, List

Messages = List[Dict[str, str]]
QWEN2_5_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _chatml(messages: Messages, default_system: str = "") -> str:
    turns = list(messages)
    if default_system and (not turns or turns[0].get("role") != "system"):
        turns = [{"role": "system", "content": default_system}] + turns
    body = "".join(f"<|im_start|>{m.get('role', 'user')}\n{m.get('content', '')}<|im_end|>\n" for m in turns)
    return body + "<|im_start|>assistant\n"


def _native(tokenizer, messages: Messages) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("template `native` uses the tokenizer's own chat template, and this tokenizer "
                         "has none; name one (`qwen2_5`, `chatml`) in data_args.template")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


def _single_user_turn(tokenizer, messages: Messages) -> str:
    if len(messages) != 1 or messages[0].get("role") != "user":
        raise ValueError(f"template `empty` takes exactly one user message, got roles "
                         f"{[m.get('role') for m in messages]}")
    return _chatml(messages)


CHAT_TEMPLATES: Dict[str, Callable[..., str]] = {
    "native": _native,
    "qwen2_5": lambda tokenizer, messages: _chatml(messages, QWEN2_5_DEFAULT_SYSTEM),
    "qwen3": lambda tokenizer, messages: _chatml(messages),
    "chatml": lambda tokenizer, messages: _chatml(messages),
    "empty": _single_user_turn,
    "longcot_V3": lambda tokenizer, messages: _native(tokenizer, messages) + "<think>\n",
}


def render_chat(template: str, tokenizer, messages: Messages) -> str:
    """The prompt text of `messages` under the named template."""
    if template not in CHAT_TEMPLATES:
        raise ValueError(f"unknown chat template {template!r}; valid: {', '.join(CHAT_TEMPLATES)}")
    return CHAT_TEMPLATES[template](tokenizer, messages)
