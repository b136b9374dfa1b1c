import math

import pytest
import torch

from medsrl.algo import logprobs as lp_mod
from medsrl.algo import masked_mean, token_entropy, token_logprobs


def _ref_logprobs(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


@pytest.fixture(params=[512, 3], ids=["one-chunk", "many-chunks"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(lp_mod, "CHUNK_TOKENS", request.param)
    return request.param


def _data(dtype=torch.float32, b=3, t=5, v=11):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(b, t, v, generator=g)).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    return logits, labels


def test_hand_computed():
    # logits [0, ln 3] -> softmax [.25, .75]: log p = [ln .25, ln .75]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    out = token_logprobs(logits, torch.tensor([[0, 1]]))
    torch.testing.assert_close(out, torch.tensor([[math.log(0.25), math.log(0.75)]]))


def test_matches_log_softmax_and_gradient(chunk):
    logits, labels = _data()
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    w = torch.randn(3, 5)
    out = token_logprobs(a, labels)
    ref = _ref_logprobs(b, labels)
    torch.testing.assert_close(out, ref)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_gradcheck_float64(chunk):
    logits, labels = _data(torch.float64, b=2, t=3, v=4)
    assert torch.autograd.gradcheck(token_logprobs, (logits.requires_grad_(True), labels))


def test_bf16_input(chunk):
    logits, labels = _data(torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    out = token_logprobs(x, labels)
    assert out.dtype == torch.float32
    # exact fp32 math on the bf16 values (not bf16 log_softmax, which is off by ~1e-2)
    torch.testing.assert_close(out, _ref_logprobs(logits, labels))
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    y = logits.float().requires_grad_(True)
    _ref_logprobs(y, labels).sum().backward()
    torch.testing.assert_close(x.grad.float(), y.grad, atol=1e-2, rtol=1e-2)


def test_non_contiguous_logits_and_2d(chunk):
    logits, labels = _data(t=6)
    sliced = logits[:, :-1]  # the usual shift: drop the last position
    torch.testing.assert_close(token_logprobs(sliced, labels[:, 1:]),
                               _ref_logprobs(sliced, labels[:, 1:]))
    flat, flat_lab = logits.reshape(-1, 11), labels.reshape(-1)
    torch.testing.assert_close(token_logprobs(flat, flat_lab), _ref_logprobs(flat, flat_lab))
    with pytest.raises(ValueError):
        token_logprobs(logits, labels[:, :-1])


def test_entropy_uniform_and_reference(chunk):
    v = 7
    uniform = torch.full((2, 3, v), 1.7)
    torch.testing.assert_close(token_entropy(uniform), torch.full((2, 3), math.log(v)))
    # one dominant logit -> near-zero entropy
    peaked = torch.zeros(1, 1, v)
    peaked[..., 0] = 50.0
    assert abs(token_entropy(peaked).item()) < 1e-6
    logits, _ = _data(torch.bfloat16)
    p = torch.softmax(logits.float(), -1)
    ref = -(p * p.log()).sum(-1)
    out = token_entropy(logits)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]])
    # (1 + 3 + 4) / 3 ; per row: [2, 4]; the NaN sits under the mask
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(8 / 3))
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(masked_mean(x, mask.bool(), dim=0), torch.tensor([2.5, 0.0, 3.0]))


def test_masked_mean_empty_mask_is_zero_with_finite_grad():
    x = torch.randn(2, 3, requires_grad=True)
    out = masked_mean(x, torch.zeros(2, 3))
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(x.grad, torch.zeros(2, 3))


def test_chunks_bound_fp32_working_set(monkeypatch):
    # [B=4, T=1000, V]: 512-token chunks -> 128 positions per chunk (4 * 128 = 512 tokens)
    monkeypatch.setattr(lp_mod, "CHUNK_TOKENS", 512)
    assert lp_mod._chunk_rows(torch.empty(4, 1000, 2)) == 128
    assert lp_mod._chunk_rows(torch.empty(1000, 2)) == 512  # [N,V]: 512 rows
    assert lp_mod._chunk_rows(torch.empty(1024, 3, 2)) == 1  # never below one position
