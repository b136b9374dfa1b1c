"""``track_memory``, and with it the promise of the fused log-prob head at Qwen's vocabulary.

On CPU, a 151,936-token LM head over 2,048 tokens (one micro-batch's response positions): the
logits path (head, then log-softmax) holds ``[N, V]`` tensors in its forward and backward; the
fused path (``algo/logprobs.py`` ``head_logprobs``) never one larger than a chunk, and its peak
is several times lower, with the same log-probs and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from medsrl.algo import token_logprobs
from medsrl.algo.logprobs import head_logprobs
from medsrl.utils.memory_tracking import peak_live_bytes, track_memory

V = 151_936


def test_peak_live_bytes_is_the_largest_running_sum_in_time_order():
    assert peak_live_bytes([]) == 0
    assert peak_live_bytes([(0, 100), (1, -100), (2, 50)]) == 100
    assert peak_live_bytes([(2, 50), (0, 100), (1, -100)]) == 100  # sorted by time first
    assert peak_live_bytes([(0, -500), (1, 200)]) == 0  # above the start only: older tensors freed first
    assert peak_live_bytes([(0, 10), (1, 20), (2, -5), (3, 30)]) == 55


def test_track_memory_sees_allocations_and_vocabulary_wide_outputs():
    with track_memory(vocab_size=1000) as mem:
        a = torch.ones(256, 1000)  # 1 MB, vocabulary-wide
        b = torch.ones(1000, 10)  # not: last dim 10
        del a
        c = torch.zeros(64, 1000)
    assert mem.largest_vocab_shape == (256, 1000) and mem.largest_vocab_bytes == 256 * 1000 * 4
    assert mem.peak_bytes >= 256 * 1000 * 4 + 1000 * 10 * 4
    assert mem.net_bytes == b.nbytes + c.nbytes  # what the block left alive


def _head(n=2048, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = 0.02 * torch.randn(V, hidden, generator=g)
    y = torch.randint(0, V, (n,), generator=g)
    return h, w, y


def _measure(path, chunk=256):
    h, w, y = _head()
    h.requires_grad_(True)
    w.requires_grad_(True)
    scale = torch.linspace(0.5, 1.5, len(y))
    with track_memory(vocab_size=V) as mem:
        if path == "logits":
            logp = token_logprobs(F.linear(h, w).unsqueeze(0), y.unsqueeze(0)).squeeze(0)
        else:
            logp = head_logprobs(h, w, None, y, chunk_tokens=chunk).logp
        (logp * scale).sum().backward()
    return mem, logp.detach(), h.grad, w.grad


@pytest.mark.slow
def test_the_fused_head_never_holds_more_than_a_chunk_of_logits_at_151936_tokens():
    chunk = 256
    old, old_logp, old_gh, old_gw = _measure("logits")
    new, new_logp, new_gh, new_gw = _measure("fused", chunk)
    n = len(old_logp)
    # before: full [N, V] tensors (the logits, and their gradient) exist
    assert old.largest_vocab_numel >= n * V
    # after: nothing vocabulary-wide beyond one chunk, forward or backward
    assert 0 < new.largest_vocab_numel <= chunk * V
    # the peak above what the block leaves (the log-probs and the gradients of h and W)
    old_work, new_work = old.peak_bytes - old.net_bytes, new.peak_bytes - new.net_bytes
    assert new_work * 4 < old_work, (old_work, new_work)
    torch.testing.assert_close(new_logp, old_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_gh, old_gh, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(new_gw, old_gw, atol=1e-6, rtol=1e-4)
