"""A slow, obviously-right reference for sampling log-probs, shared by the rollout backend tests.

Import as ``from logprob_reference import teacher_forced_logprobs`` (``tests`` is on pytest's path).
"""

from __future__ import annotations

import torch
from transformers import TopPLogitsWarper


def teacher_forced_logprobs(model, prompt_ids, response_ids, temperature, top_p) -> torch.Tensor:
    """Log-prob of each response token under temperature + top-p, from one uncached forward."""
    seq = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0, len(prompt_ids) - 1 : -1].float()
    if temperature > 0:
        logits = logits / temperature
        if top_p < 1.0:
            logits = TopPLogitsWarper(top_p=top_p)(seq, logits)
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(response_ids)[:, None]).squeeze(1)
