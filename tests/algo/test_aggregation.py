import pytest
import torch

from medsrl.algo import LOSS_AGG_MODES, aggregate_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1+2+4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 seqs
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2 seqs
        ("seq-mean-token-sum-norm", 7 / 6),  # 7 / (2 seqs * T=3)
    ],
)
def test_hand_computed(mode, expected):
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, mode), torch.tensor(expected))


def test_explicit_normalisers():
    # token-mean / 10 tokens = .7 ; seq-sum / 4 seqs = 7/4 ; Dr.GRPO 7 / (4 * 5) = .35
    torch.testing.assert_close(
        aggregate_loss(LOSS, MASK, "token-mean", num_tokens=10), torch.tensor(0.7)
    )
    torch.testing.assert_close(aggregate_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=4),
                               torch.tensor(1.75))
    torch.testing.assert_close(
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", num_seqs=4, norm_length=5),
        torch.tensor(0.35))


def test_empty_sequence_contributes_zero_and_padding_nan_ignored():
    loss = LOSS.clone()
    loss[1] = float("nan")  # fully masked row, e.g. NaN garbage in padding
    loss[0, 2] = float("inf")
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    # seq-mean-token-mean: (1.5 + 0) / 2 = .75 ; token-mean: 3 / 2
    out = aggregate_loss(loss, mask, "seq-mean-token-mean")
    torch.testing.assert_close(out, torch.tensor(0.75))
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-mean"), torch.tensor(1.5))
    assert aggregate_loss(loss, torch.zeros(2, 3), "token-mean").item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_accumulation_equals_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 7, generator=g, requires_grad=True)
    lengths = torch.tensor([7, 2, 5, 1, 6, 3])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    full = aggregate_loss(loss, mask, mode)
    totals = dict(num_tokens=mask.sum().item(), num_seqs=6, norm_length=7)
    # micro-batches of 2 and 4 sequences, padded to different lengths
    parts = [aggregate_loss(loss[:2], mask[:2], mode, **totals),
             aggregate_loss(loss[2:, :6], mask[2:, :6], mode, **totals)]
    torch.testing.assert_close(sum(parts), full)
    g_full, = torch.autograd.grad(full, loss)
    g_acc, = torch.autograd.grad(sum(parts), loss)
    torch.testing.assert_close(g_acc, g_full)


def test_micro_batch_without_totals_differs_for_token_mean():
    # guards the test above: per-micro-batch defaults are NOT exact
    lengths = torch.tensor([7, 1])
    mask = torch.arange(7)[None, :] < lengths[:, None]
    loss = torch.arange(14.0).reshape(2, 7)
    full = aggregate_loss(loss, mask, "token-mean")
    naive = (aggregate_loss(loss[:1], mask[:1], "token-mean")
             + aggregate_loss(loss[1:], mask[1:], "token-mean")) / 2
    assert abs(full - naive) > 0.1


def test_unknown_mode_lists_valid():
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm"):
        aggregate_loss(LOSS, MASK, "sum")
