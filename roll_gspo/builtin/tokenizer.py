"""The built-in character-level tokenizer: every character one token, ids fixed forever."""
from __future__ import annotations

import string
from typing import List

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN]
# Renders chat `messages` by plain concatenation: the tiny model has no chat format, but chat-style
# data should still load.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def char_vocab() -> List[str]:
    """Token strings in id order: specials, then arithmetic characters, letters, other ASCII.

    Printable ASCII is covered fully so any English/ASCII prompt round-trips; the order is fixed
    because token ids are baked into saved models.
    """
    chars = list("0123456789+-*/=() ") + list(string.ascii_lowercase) + list(string.ascii_uppercase)
    chars += list(".,:?!")
    chars += [c for c in string.printable if c not in chars and c not in "\r\x0b\x0c"]
    return SPECIAL_TOKENS + chars


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (every character is one token, no bos)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(char_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # [\s\S] rather than "." so newlines are split too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN,
        model_max_length=256)
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok
