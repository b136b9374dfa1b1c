"""A Lightning callback for tests: how many policy parameters FSDP holds gathered at once during
the update's forward and backward passes (``tests/test_distributed.py``).

It samples every time autograd saves a tensor (forward) and reads one back (backward), which
happens inside each layer's computation, and counts the parameters of every FSDP unit whose
unsharded buffer is allocated at that moment. Written per rank to
``<run>/gather_probe_rank<r>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch


def gathered_units(policy) -> list[tuple[str, int, torch.dtype | None]]:
    """``(unit name, parameters, dtype of its gathered buffer or None)`` for every FSDP unit of
    ``policy``: the compute buffer a forward gathers into, or the full-precision one that
    ``summon_full_params`` gathers into under mixed precision."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = []
    for name, unit in policy.named_modules():
        handle = getattr(unit, "_handle", None) if isinstance(unit, FSDP) else None
        if handle is None:
            continue
        flat = handle.flat_param
        buffers = [getattr(flat, a, None) for a in ("_full_param_padded", "_full_prec_full_param_padded")]
        full = next((b for b in buffers if b is not None and b.untyped_storage().size() > 0), None)
        units.append((name or "root", int(flat._unpadded_unsharded_size.numel()), None if full is None else full.dtype))
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
