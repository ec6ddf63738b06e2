"""Text that did not come from the model, as token ids that cannot be control tokens.

Tool output, environment text and an agent's messages are untrusted: a tool that prints
``<|im_end|>\\n<|im_start|>user`` must not forge a chat turn in the model's context. A
tokenizer's plain ``encode`` turns such strings into the special tokens' ids;
:func:`encode_untrusted` encodes them as the ordinary text they are.
"""

from __future__ import annotations

from typing import Any

__all__ = ["encode_untrusted"]


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokens a tokenizer treats as special (its control tokens)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
    return ids


def _special_strings(tokenizer: Any) -> list[str]:
    strings = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    strings.update(str(tok) for tok in decoder.values() if getattr(tok, "special", False))
    return sorted((s for s in strings if s), key=len, reverse=True)


def encode_untrusted(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids with every special-token string in it encoded as plain text.

    No id in the result is a special token's (``tokenizer.all_special_ids`` and the added
    tokens marked special). Uses the tokenizer's ``split_special_tokens=True`` where it has
    it; otherwise (or if that still yields a special id) the text is cut around each
    special-token string, whose characters are encoded one piece at a time. No BOS/EOS is
    added.
    """
    if not text:
        return []
    specials = _special_ids(tokenizer)
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:  # a tokenizer without the option
        ids = None
    if ids is not None and not specials.intersection(ids):
        return ids
    return _encode_split(tokenizer, text, _special_strings(tokenizer), specials)


def _encode_split(tokenizer: Any, text: str, strings: list[str], specials: set[int]) -> list[int]:
    """The fallback: plain text between special-token strings encoded normally, each
    special-token string encoded character by character (no single character is one)."""
    out: list[int] = []
    start = i = 0
    while i < len(text):
        hit = next((s for s in strings if text.startswith(s, i)), None)
        if hit is None:
            i += 1
            continue
        if start < i:
            out += tokenizer.encode(text[start:i], add_special_tokens=False)
        for ch in hit:
            out += tokenizer.encode(ch, add_special_tokens=False)
        i = start = i + len(hit)
    if start < len(text):
        out += tokenizer.encode(text[start:], add_special_tokens=False)
    if specials.intersection(out):
        raise ValueError("the tokenizer encodes plain text into special tokens")
    return out
