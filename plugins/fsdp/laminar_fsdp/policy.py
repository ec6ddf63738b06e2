"""The policy as FSDP sees it: a transformers causal LM whose forward ends in the chunked
log-prob head instead of full logits.

``PolicyModel`` is the root module handed to ``fully_shard``. Inside the root's forward FSDP
holds the root's parameters (embeddings, final norm, LM head) unsharded, which is what lets
the head use the LM head's weight directly: the head never builds ``[tokens, vocab]`` logits
(``laminar_core.algorithms.chunked_logprobs``), and with ``chunk <= 0`` it is the plain
full-logits path (kept for comparison and as a fallback).
"""

from __future__ import annotations

from torch import Tensor, nn

from laminar_core.algorithms import chunked_logprobs
from laminar_fsdp.packed_row import PackedRow

# Config attributes of models whose head is more than ``hidden @ W.T (+ b)``.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")


class PolicyModel(nn.Module):
    """``forward(...) -> (logprobs, entropy)`` per position of ``labels`` (float32)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        for name in _HEAD_EXTRAS:
            if getattr(lm.config, name, None) not in (None, 1, 1.0):
                raise ValueError(
                    f"model.path: {type(lm).__name__} applies {name} to its logits, which the "
                    "FSDP trainer's log-prob head does not; use a model without it"
                )
        self.lm = lm

    @property
    def config(self):
        """The transformers config of the wrapped model."""
        return self.lm.config

    @property
    def base(self) -> nn.Module:
        return getattr(self.lm, self.lm.base_model_prefix)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        labels: Tensor,
        attention_mask: Tensor | None = None,
        *,
        temperature: float = 1.0,
        chunk: int = 1024,
        with_entropy: bool = False,
        row: PackedRow | None = None,
        compiled: bool | str = False,
    ) -> tuple[Tensor, Tensor | None]:
        kw = {"laminar_row": row} if row is not None else {}
        hidden = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **kw,
        ).last_hidden_state
        head = self.lm.get_output_embeddings()
        return chunked_logprobs(
            hidden,
            head.weight,
            labels,
            temperature,
            chunk,
            bias=getattr(head, "bias", None),
            with_entropy=with_entropy,
            compiled=compiled,
        )


def train_mode_without_dropout(model: nn.Module) -> None:
    """Put ``model`` in training mode with every dropout at 0.

    Training mode because transformers runs activation checkpointing (and other train-only
    paths) only when ``module.training`` is set: ``from_pretrained`` returns eval mode, which
    left ``gradient_checkpointing`` inert. Dropout off because RL trainers want it off: the
    PPO ratio compares the trainer's log-probs with the rollout engine's (which has no
    dropout), and ``compute_logprobs`` must give the numbers the update will start from. With
    dropout at 0 a forward is the same in either mode.
    """
    model.train()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    cfg = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop"):
        if isinstance(getattr(cfg, key, None), float):
            setattr(cfg, key, 0.0)
