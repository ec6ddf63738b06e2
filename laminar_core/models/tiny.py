"""A tiny Qwen2-style model and character-level tokenizer, built locally (no model hub).

:func:`build_tiny_model` writes a Hugging Face-format directory that
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM load like any hub model:

- ``config.json`` -- ``Qwen2ForCausalLM``, tied embeddings, float32, vocab padded to 64;
- ``model.safetensors`` -- seeded random init (transformers' own ``_init_weights``);
- ``generation_config.json``;
- ``tokenizer.json`` + ``tokenizer_config.json`` -- a byte-level BPE without merges, i.e. one
  token per character of :data:`ALPHABET` (printable ASCII, tab, newline), three special
  tokens, and reserved filler tokens so that *every* id the model can sample decodes to
  something (vLLM samples from the full, padded vocabulary). It is built exactly like Qwen2's
  own tokenizer, because transformers rebuilds any ``model_type: qwen2`` tokenizer that way.
  The first two reserved tokens are Qwen's chat markers ``<|im_start|>`` / ``<|im_end|>``
  (ids 100, 101) and the tokenizer carries a Qwen-style chat template with tool calls
  (:data:`CHAT_TEMPLATE`), which the agent gateway renders conversations with. Nothing else
  uses them: the tasks' prompts are plain text, and the model's end of sequence stays
  ``<|eos|>``.

Sizes come in presets (:data:`PRESETS`, ``laminar tiny-model DIR --preset NAME``): ``tiny``
(0.3M parameters: the quickstart, the tests) and ``small`` (3.2M: big enough that compute,
not per-call overhead, dominates a step on a CPU; the long-tail workload's model,
``examples/longtail.yaml``). Explicit sizes override the preset's.

transformers, tokenizers and safetensors are imported lazily: core does not depend on them.
"""

from __future__ import annotations

import json
from pathlib import Path

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2
# Qwen's chat-turn markers: the first two reserved ids (100, 101), special like Qwen's own.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TOKENS = (IM_START, IM_END)
# The characters the tokenizer knows: printable ASCII plus tab and newline. Bytes outside it
# are dropped by the (byte-level, merge-free) BPE; keeping the alphabet small keeps the vocab
# at 128, which is what lets a randomly initialised model find the right letters by sampling.
ALPHABET = "\t\n" + "".join(chr(c) for c in range(32, 127))
# Qwen2's pre-tokenizer split (transformers rebuilds the tokenizer with it for model_type
# qwen2, so ours must match it to behave identically everywhere).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character map used by byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


# A Qwen2.5-style chat template (``<|im_start|>role\n...<|im_end|>\n`` turns; tools listed
# in the system turn as JSON; calls as ``<tool_call>{"name": ..., "arguments": {...}}
# </tool_call>``; tool results in a user turn inside ``<tool_response>``), kept short: every
# character is a token of the tiny model's context.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>"
    '{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'<tool_call>{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def char_vocab() -> list[str]:
    """Token strings in id order: the specials, then one byte-level token per ALPHABET char."""
    table = _bytes_to_unicode()
    return [*SPECIAL_TOKENS, *(table[ord(c)] for c in ALPHABET)]


# name -> sizes (hidden_size / heads = head dim: 64 for both, what vLLM's CPU attention takes)
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "layers": 2, "heads": 2, "kv_heads": 1},  # 0.3M
    "small": {  # 3.2M
        "hidden_size": 256,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "intermediate_size": 768,
    },
}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _build_tokenizer(vocab_size: int):
    """A byte-level BPE with no merges (one token per character), as Qwen2's tokenizer is built.

    Ids past the alphabet up to ``vocab_size`` are reserved special tokens, so every id the
    model can sample decodes.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tokens = char_vocab()
    fill = vocab_size - len(tokens) - len(CHAT_TOKENS)
    reserved = [*CHAT_TOKENS, *(f"<|reserved_{i}|>" for i in range(fill))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(
        BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix="")
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in (*SPECIAL_TOKENS, *reserved)])
    return tok


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    preset: str = "tiny",
    hidden_size: int | None = None,
    layers: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.02,
) -> Path:
    """Write a randomly initialised (seeded) Qwen2-style model + char tokenizer to ``out_dir``.

    Sizes are ``preset``'s (:data:`PRESETS`) unless given. ``hidden_size / heads`` is the
    head dim; keep it 64 or 32 (what vLLM's CPU attention supports). ``intermediate_size``
    defaults to the preset's, else ``2 * hidden_size``. The same arguments give
    byte-identical weights. Returns ``out_dir`` as a ``Path``.

    Raises ``ValueError`` for an unknown preset or inconsistent sizes, ``ImportError``
    naming the package to install when transformers/tokenizers/safetensors are missing.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    size = PRESETS[preset]
    hidden_size = hidden_size or size["hidden_size"]
    layers = layers or size["layers"]
    heads = heads or size["heads"]
    kv_heads = kv_heads or size["kv_heads"]
    intermediate_size = intermediate_size or size.get("intermediate_size")
    if hidden_size % heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if min(hidden_size, layers, heads, kv_heads, max_position_embeddings) < 1:
        raise ValueError("model sizes must be >= 1")
    try:
        import torch
        from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"building the tiny model needs transformers and tokenizers ({e}); "
            "pip install transformers tokenizers safetensors"
        ) from e

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = _round_up(len(char_vocab()), 64)
    pad_id, bos_id, eos_id = 0, 1, 2
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        architectures=["Qwen2ForCausalLM"],
    )
    config.dtype = torch.float32

    # Seed around construction so the init is a pure function of the arguments.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float()
    model.generation_config.update(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True
    )
    save_model(model, out)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=_build_tokenizer(vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # Qwen2Tokenizer defaults unk to a new "<|endoftext|>" (id 128, outside the model's
        # vocab); naming an existing token keeps len(tokenizer) == vocab_size.
        unk_token=PAD,
        model_max_length=max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out


def save_model(model, out: Path) -> None:
    """Write ``model`` (weights, config, generation config) to ``out`` as vLLM reads it."""
    model.save_pretrained(out, safe_serialization=True)
    # Older readers (and vLLM's config parsing) look for ``torch_dtype``; newer ones ``dtype``.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", "float32")
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
