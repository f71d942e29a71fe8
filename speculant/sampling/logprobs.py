"""Log-probabilities of emitted tokens and their top alternatives.

They are the **raw** distribution of the target model: ``log_softmax`` of the target's fp32 logits at the
position, before temperature, penalties, logit bias, min-p/top-k/top-p and any grammar mask (vLLM's
default, ``logprobs_mode="raw_logprobs"``).  So they say how likely the model found a token, whatever
the controls made of it, and they are meaningful under greedy decoding too.  Under speculation they come
from the verification rows, which carry the bits of the one-token step at the same position (batch
invariance, see README "Exactness"), so they equal ``ar``'s bit for bit for the same emitted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
"""Largest number of alternatives per position (OpenAI's limit for ``top_logprobs``)."""


@dataclass
class TokenLogprob:
    """One emitted token's log-probability [nats] and the ``k`` most likely tokens at its position.

    Attributes:
        token_id: the emitted token.
        logprob: its log-probability under the raw target distribution [nats].
        top: ``(token id, log-probability)`` of the ``k`` most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The :class:`TokenLogprob` of ``token`` from one row of raw logits ``[V]``, with ``k`` alternatives.

    The row is processed alone (``[1, V]``), so the result depends only on that row's bits.
    """
    logp = torch.log_softmax(logits.float().reshape(1, -1), dim=-1)[0]
    top = []
    if k > 0:
        values, ids = torch.topk(logp, min(k, logp.shape[0]))
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(int(token), float(logp[token]), top)
