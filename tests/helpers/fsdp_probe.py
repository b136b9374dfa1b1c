"""A Lightning callback for tests: how many policy parameters FSDP2 holds gathered at once during
the update's forward and backward passes (``tests/e2e/test_distributed.py``).

It samples every time autograd saves a tensor (forward) and reads one back (backward), which
happens inside each layer's computation, and counts the parameters of every FSDP2 unit whose
parameters are unsharded at that moment. Written per rank to
``<run>/gather_probe_rank<r>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch


def gathered_units(policy) -> list[tuple[str, int, torch.dtype | None]]:
    """``(unit name, parameters, dtype of its gathered parameters or None)`` for every FSDP2 unit
    of ``policy``: a unit's parameters are gathered while they are unsharded (its
    ``FSDPParam``s' state), in the all-gather's dtype (``param_dtype`` under mixed precision)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    units = []
    for name, unit in policy.named_modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        if group is None:
            continue
        params = group.fsdp_params
        size = sum(p._orig_size.numel() for p in params)
        gathered = [p for p in params if p.sharded_state == ShardedState.UNSHARDED]
        dtype = (gathered[0].param_dtype or gathered[0].orig_dtype) if gathered else None
        units.append((name or "root", int(size), dtype))
    return units


def gathered_now(policy) -> int:
    """Parameters of ``policy`` held gathered at this moment, over all its FSDP units."""
    return sum(n for _, n, dtype in gathered_units(policy) if dtype is not None)


class GatherProbe(L.Callback):
    def __init__(self) -> None:
        self.max_gathered = 0
        self.max_units: list[str] = []
        self.samples = 0
        self.gathered_dtypes: set[str] = set()
        self._hooks = None
        self._policy = None

    def _sample(self) -> None:
        units = gathered_units(self._policy)
        now = sum(n for _, n, g in units if g is not None)
        self.gathered_dtypes |= {str(g) for _, _, g in units if g is not None}
        self.samples += 1
        if now > self.max_gathered:
            self.max_gathered, self.max_units = now, [u for u, _, g in units if g is not None]

    def _pack(self, t):
        self._sample()
        return t

    def _unpack(self, t):
        self._sample()
        return t

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._policy = pl_module.policy
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._hooks.__exit__(None, None, None)

    def on_train_end(self, trainer, pl_module) -> None:
        units = gathered_units(pl_module.policy)
        out = {
            "max_gathered": self.max_gathered,
            "max_units": self.max_units,
            "samples": self.samples,
            "gathered_dtypes": sorted(self.gathered_dtypes),
            "units": {name: n for name, n, _ in units},
            "param_dtypes": sorted({str(p.dtype) for p in pl_module.policy.parameters()}),
            "optim_state_dtypes": sorted({str(v.dtype) for st in trainer.optimizers[0].state.values()
                                          for k, v in st.items() if torch.is_tensor(v) and k != "step"}),
        }
        path = Path(trainer.default_root_dir) / f"gather_probe_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(out, indent=2))
