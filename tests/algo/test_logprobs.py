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


# ------------------------------------------------------------------ the fused LM head (head_logprobs)


def _head_data(n=37, h=16, v=50, bias=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = (0.3 * torch.randn(v, h, generator=g)).to(dtype)
    b = (0.1 * torch.randn(v, generator=g)).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, labels


def _unfused(hidden, weight, bias, labels, entropy=False):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logp = token_logprobs(logits.unsqueeze(0), labels.unsqueeze(0)).squeeze(0)
    ent = token_entropy(logits.unsqueeze(0)).squeeze(0) if entropy else None
    return logp, ent


def _grads(fn, tensors, seed=1):
    """Values and gradients of ``fn(*leaves)`` under a random weighting of its outputs."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    outs = fn(*leaves)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs if o is not None)
    loss.backward()
    return [o.detach() for o in outs if o is not None], [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("chunk_tokens", [1, 5, 37, 1000], ids=["1", "5-uneven", "exact", "bigger-than-n"])
@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "logp+entropy"])
def test_head_logprobs_equal_the_unfused_head_in_values_and_gradients(chunk_tokens, entropy):
    hidden, weight, bias, labels = _head_data()

    def fused(h, w, b):
        out = lp_mod.head_logprobs(h, w, b, labels, entropy=entropy, chunk_tokens=chunk_tokens)
        return out.logp, out.entropy

    got, got_grads = _grads(fused, (hidden, weight, bias))
    want, want_grads = _grads(lambda h, w, b: _unfused(h, w, b, labels, entropy), (hidden, weight, bias))
    for a, b in zip(got + got_grads, want + want_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_head_logprobs_gradcheck_float64():
    hidden, weight, bias, labels = _head_data(n=6, h=3, v=5, dtype=torch.float64)

    def fn(h, w, b):
        out = lp_mod.head_logprobs(h, w, b, labels, entropy=True, chunk_tokens=4)
        return out.logp, out.entropy

    args = tuple(t.requires_grad_(True) for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "logp+entropy"])
def test_head_logprobs_under_bf16_autocast_equal_the_unfused_head_there(entropy):
    """bf16-mixed: fp32 hidden states and head, bf16 logits; the fused path rounds as autocast does."""
    hidden, weight, bias, labels = _head_data(n=40, h=32, v=300)

    def fused(h, w, b):
        out = lp_mod.head_logprobs(h, w, b, labels, entropy=entropy, chunk_tokens=16)
        return out.logp, out.entropy

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_grads = _grads(fused, (hidden, weight, bias))
        want, want_grads = _grads(lambda h, w, b: _unfused(h, w, b, labels, entropy), (hidden, weight, bias))
    assert all(g.dtype == torch.float32 for g in got_grads)  # the fp32 masters get fp32 gradients
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the same bf16 logits, fp32 after
    for a, b in zip(got_grads, want_grads, strict=True):
        # both sum bf16 products; the fused path's sums run over chunks: bf16 compute error
        assert (a - b).norm() <= 0.02 * b.norm()


def test_head_logprobs_entropy_without_grad_is_a_detached_metric():
    hidden, weight, bias, labels = _head_data()
    h = hidden.clone().requires_grad_(True)
    out = lp_mod.head_logprobs(h, weight, bias, labels, entropy=True, entropy_grad=False, chunk_tokens=8)
    assert out.logp.requires_grad and not out.entropy.requires_grad
    torch.testing.assert_close(out.entropy, _unfused(hidden, weight, bias, labels, True)[1], atol=1e-5, rtol=1e-5)
    out.logp.sum().backward()
    want = hidden.clone().requires_grad_(True)
    _unfused(want, weight, bias, labels)[0].sum().backward()
    torch.testing.assert_close(h.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_head_logprobs_reducers_read_each_chunk_and_equal_the_whole_logits():
    hidden, weight, bias, labels = _head_data()
    reducers = {"entropy": lambda logits, y: token_entropy(logits),
                "label_logit": lambda logits, y: logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)}
    with torch.no_grad():
        out = lp_mod.head_logprobs(hidden.view(1, 37, 16), weight, bias, labels.view(1, 37),
                                   reducers=reducers, chunk_tokens=10)
        logits = torch.nn.functional.linear(hidden, weight, bias).unsqueeze(0)
    assert out.stats["entropy"].shape == (1, 37)
    torch.testing.assert_close(out.stats["entropy"], token_entropy(logits), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.stats["label_logit"], logits.gather(-1, labels.view(1, 37, 1)).squeeze(-1))


def test_head_logprobs_refuses_reducers_with_grad_and_mismatched_labels():
    hidden, weight, bias, labels = _head_data()
    with pytest.raises(ValueError, match="no_grad"):
        lp_mod.head_logprobs(hidden.requires_grad_(True), weight, bias, labels, reducers={"e": lambda x, y: x[..., 0]})
    with pytest.raises(ValueError, match="labels"):
        lp_mod.head_logprobs(hidden, weight, bias, labels[:-1])


def test_head_logprobs_of_no_tokens_are_empty():
    _, weight, bias, _ = _head_data()
    h = torch.zeros(2, 0, 16, requires_grad=True)
    out = lp_mod.head_logprobs(h, weight, bias, torch.zeros(2, 0, dtype=torch.long), entropy=True)
    assert out.logp.shape == out.entropy.shape == (2, 0)
    (out.logp.sum() + out.entropy.sum()).backward()
    assert h.grad.shape == h.shape
