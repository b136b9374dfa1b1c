"""LoRA through PEFT: the policy wrapped in low-rank adapters over a frozen base, and the helpers
around it (checkpoints hold the adapters only, the KL reference is the policy with its adapters
off, vLLM and the export get merged weights)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from medsrl.models.settings import LoraSettings

# The adapters' initialisation is drawn from this seed in a forked generator: the same adapters
# whether or not the warm start was cached, the run's other draws unchanged by turning LoRA on.
INIT_SEED = 0


def is_lora(model: nn.Module) -> bool:
    """Sharded or not: FSDP2 keeps the module's class."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a ``PeftModel`` (the same modules, adapters injected), else ``model``."""
    return model.get_base_model() if is_lora(model) else model


def target_problems(model: nn.Module, targets: Sequence[str] | str) -> list[str]:
    """The ``target_modules`` names that match no module of ``model``: PEFT silently skips such a
    name when another one matches, and the run would train fewer layers than asked for."""
    if isinstance(targets, str):  # "all-linear" or a regex: PEFT resolves (and checks) those
        return []
    names = [name for name, _ in model.named_modules()]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
    return [f"model.lora.target_modules: {target!r} matches no module of {type(model).__name__} "
            f"(its linear layers: {', '.join(linear)})"
            for target in targets if not any(n == target or n.endswith("." + target) for n in names)]


def apply_lora(policy: nn.Module, settings: LoraSettings, adapter_dtype: torch.dtype | str | None = None) -> nn.Module:
    """``policy`` wrapped in LoRA adapters when enabled. Call it after activation checkpointing is set
    up (PEFT then makes the embeddings' output require grad). The adapters are made in ``adapter_dtype``
    whatever the base's: they are the master weights, whose small updates must not round away."""
    if not settings.enabled:
        return policy
    from peft import LoraConfig, get_peft_model

    problems = target_problems(policy, settings.target_modules)
    if problems:
        raise ValueError("; ".join(problems))
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules if isinstance(settings.target_modules, str)
        else list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # PEFT reads transformers' deprecated is_gradient_checkpointing to decide the above
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
        torch.manual_seed(INIT_SEED)
        wrapped = get_peft_model(policy, config)
    if isinstance(adapter_dtype, torch.dtype):
        adapters_to(wrapped, adapter_dtype)
    return wrapped


def adapters_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the trained parameters (the adapters) in place, the frozen base left as it is."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)


def is_adapter_key(key: str) -> bool:
    return "lora_" in key


def checkpoint_state(state: Mapping[str, torch.Tensor], lora: bool) -> dict[str, torch.Tensor]:
    """Everything, or with LoRA the adapters only (the frozen base is rebuilt from the model config)."""
    return dict(state) if not lora else {k: v for k, v in state.items() if is_adapter_key(k)}


def mismatch_message(missing: Sequence[str], unexpected: Sequence[str], lora: bool) -> str:
    """Why a checkpoint does not fit the policy, saying so plainly when one side has LoRA adapters."""
    base = f"checkpoint does not match the policy: missing {list(missing)[:5]}, unexpected {list(unexpected)[:5]}"
    if (lora and unexpected and not any(is_adapter_key(k) for k in unexpected)
            and all(is_adapter_key(k) for k in missing)):
        return (f"{base}. This run trains LoRA adapters (model.lora.r > 0) but the checkpoint holds full "
                "weights (a run with model.lora.r=0): resume it with model.lora.r=0, or export its "
                "policy and start a LoRA run from it (model.name_or_path=<run>/policy)")
    if not lora and any(is_adapter_key(k) for k in unexpected):
        return (f"{base}. The checkpoint holds LoRA adapter weights (a run with model.lora.r > 0): "
                "resume it with the same model.lora settings")
    return base


@contextlib.contextmanager
def reference_policy(policy: nn.Module, copy: nn.Module | None) -> Iterator[nn.Module]:
    """The frozen KL reference: ``copy`` (full fine-tune), else ``policy`` with its adapters disabled."""
    if copy is not None:
        yield copy
        return
    with policy.disable_adapter():
        yield policy


@torch.no_grad()
def merged_weights(
    model: nn.Module, dtype: torch.dtype | None = None, *, copy: bool = False,
    gather: Callable[[torch.Tensor, torch.dtype | None], torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The state a plain model would hold with the adapters merged, under the base model's names, one
    module at a time: no more than one merged weight exists at once. ``copy``: always a fresh tensor;
    ``gather(tensor, dtype)``: how a sharded parameter becomes whole (``models/sharding.py``)."""
    from peft.tuners.lora import LoraLayer

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype or t.dtype, copy=copy)

    def param(t: torch.Tensor) -> torch.Tensor:
        return cast(t) if gather is None else gather(t.detach(), dtype)

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(module, LoraLayer):
            yield from _merged_layer(module, prefix, dtype, gather)
            return
        for name, t in module._parameters.items():
            if t is not None:
                yield prefix + name, param(t)
        for name, t in module._buffers.items():
            if t is not None and name not in module._non_persistent_buffers_set:
                yield prefix + name, cast(t)
        for name, child in module._modules.items():
            if child is not None:
                yield from walk(child, f"{prefix}{name}.")

    yield from walk(unwrap_peft(model), "")


def _merged_layer(layer, prefix: str, dtype: torch.dtype | None, gather=None) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA layer's base tensors, the weight with the active adapters' deltas added in its own dtype.
    Sharded (``gather``): the delta made from the gathered adapters as PEFT's ``get_delta_weight``."""
    base = layer.get_base_layer()
    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    for name, t in base.named_parameters(recurse=False):
        merge = name == "weight" and adapters and not layer.merged and not layer.disable_adapters
        t = t.detach() if gather is None else gather(t.detach(), None if merge else dtype)
        if merge:
            deltas = [layer.get_delta_weight(a) if gather is None else _gathered_delta(layer, a, gather)
                      for a in adapters]
            t = t + sum(deltas).to(t.dtype)
            del deltas
        yield prefix + name, t.to(dtype or t.dtype, copy=True)


def _gathered_delta(layer, adapter: str, gather) -> torch.Tensor:
    """``scaling * B @ A`` (transposed for ``fan_in_fan_out``) from the gathered adapter weights."""
    a = gather(layer.lora_A[adapter].weight.detach(), None)
    b = gather(layer.lora_B[adapter].weight.detach(), None)
    delta = (b @ a) * layer.scaling[adapter]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(merged_weights(model))


def export_view(policy: nn.Module, merge: bool) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
    """What to call ``save_pretrained`` on, and its state dict (None: the module's own); a
    ``PeftModel`` not merged saves its adapter alone."""
    if merge and is_lora(policy):
        return unwrap_peft(policy), merged_state_dict(policy)
    return policy, None


def targeted_linears(model: nn.Module, targets: Sequence[str] | str) -> list[nn.Linear]:
    """The linear layers LoRA adapts (on the ``meta`` device too): ``targets`` by name, or for
    "all-linear" every one but the LM head. For the memory plan."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [m for name, m in model.named_modules() if isinstance(m, nn.Linear)
            and (m is not head if isinstance(targets, str) else name.rsplit(".", 1)[-1] in targets)]


def trainable_params(model: nn.Module, settings: LoraSettings) -> int:
    """``r * (in + out)`` per targeted linear layer."""
    return sum(settings.r * (m.in_features + m.out_features) for m in targeted_linears(model, settings.target_modules))
