"""Sampling and log-probs for the pure-torch GRPO loops (task_learnability, algorithms)."""

from __future__ import annotations

import torch


def sample(model, tok, prompts: list[list[int]], temperature: float, max_tokens: int, greedy=False):
    """``(ids, attn, resp, mask)``: the left-padded prompts, their attention mask, the sampled
    (``greedy``: argmax-decoded) responses ``[N, T]`` and their mask (up to and including the
    first EOS, what a rollout engine returns)."""
    plen = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (plen - len(p)) + p for p in prompts])
    attn = (torch.arange(plen) >= torch.tensor([plen - len(p) for p in prompts])[:, None]).long()
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=max_tokens,
            **({"do_sample": False} if greedy else
               {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}),
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    resp = out[:, plen:]
    is_eos = resp == tok.eos_token_id
    mask = ~((is_eos.cumsum(1) - is_eos.long()) > 0)
    return ids, attn, resp, mask


def logprobs(model, ids, attn, resp, mask, temperature: float):
    """Each response token's log-prob under ``model`` at ``temperature`` (with gradients)."""
    full = torch.cat([ids, resp], 1)
    full_mask = torch.cat([attn, mask.long()], 1)
    pos = (full_mask.cumsum(1) - 1).clamp_min(0)
    logits = model(input_ids=full, attention_mask=full_mask, position_ids=pos).logits
    logits = logits[:, ids.shape[1] - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, resp[..., None])[..., 0]


def texts(tok, resp, mask) -> list[str]:
    """The decoded responses (special tokens skipped), what a reward reads."""
    return [tok.decode(r[m].tolist(), skip_special_tokens=True) for r, m in zip(resp, mask)]
