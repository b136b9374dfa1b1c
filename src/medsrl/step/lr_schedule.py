"""The default lr schedule (``optim.scheduler``): linear warm-up, then constant."""

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def linear_warmup(optimizer: Optimizer, warmup_steps: int) -> LambdaLR:
    """The lr rises linearly over ``warmup_steps`` RL steps (the first at ``1 / warmup_steps`` of
    it), then stays; 0: constant from the start."""
    return LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
