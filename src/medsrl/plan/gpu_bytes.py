"""Memory per GPU and per phase of a training step, by arithmetic from the run's settings (``medsrl-plan``).

Every figure is computed from the model's parameter counts (``plan/model_size.py``) and the run's
batch, precision and sharding; what a CPU can measure is checked in ``tests/plan/test_gpu_bytes.py``,
the rest are estimates with their formulas. The phases and what each holds: docs/GPU.md. Only the
update and the optimizer step hold gradients: they are set to None after each step (``step/update.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from medsrl.algo.logprobs import CHUNK_TOKENS
from medsrl.callbacks.milestones import WeightMilestones
from medsrl.callbacks.pass_at_k import PassAtKValidation
from medsrl.models.loading import resolve_dtype
from medsrl.plan.model_size import ModelSize
from medsrl.run_config import RunConfig
from medsrl.settings import settings_model

GIB = 2**30
# PyTorch's caching allocator never hands out all of a GPU: blocks are rounded and split. The
# plan calls a phase fitting when it needs at most this fraction of the GPU.
USABLE_FRACTION = 0.90
RUNTIME_BYTES = 1 * GIB  # CUDA context, cuBLAS workspaces (and NCCL buffers with several ranks): assumed
DEFAULT_PROMPT_TOKENS = 1024  # the reference run's longest prompt (docs/REFERENCE.md)
SHARD_KNOB = "trainer=fsdp trainer.devices=N"  # what shrinks a replicated holder
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


@dataclass(frozen=True)
class RunShape:
    """The settings of a run that decide its memory (see :func:`run_shape`)."""

    devices: int
    sharded: bool  # FSDP: weights, gradients and AdamW states split over the ranks
    ddp: bool  # several ranks, replicated weights
    master_bytes: int  # bytes of a parameter (4: fp32 master weights)
    compute_bytes: int  # bytes of an activation (2 under bf16 compute)
    gradient_checkpointing: bool
    backend: str  # hf | vllm
    sequences_per_rank: int  # responses a rank holds in a step (its prompts x n)
    prompt_tokens: int
    response_tokens: int
    generate_rows: int  # HF: sequences per generate call
    micro_batch: int
    reference_model: bool  # KL on: a full frozen copy of the policy on every rank
    vllm_fraction: float | None
    vllm_kv_bytes: int | None
    vllm_weight_bytes: int
    vllm_sleep: bool
    gpu_bytes: int | None  # the declared hardware's memory per GPU; None: not declared
    hardware: str | None = None
    on_gpu: bool = True  # trainer.accelerator is not cpu: the CUDA runtime's own memory counts
    chunk_tokens: int = CHUNK_TOKENS
    max_tokens: int | None = None  # algorithm.max_tokens_per_microbatch: padded tokens per forward
    validation: bool = False  # callbacks.pass_at_k runs (every_n_steps > 0)
    val_generate_rows: int = 0  # HF: sequences per generate call in validation (its chunk, capped by the engine's)
    val_response_tokens: int = 0  # callbacks.pass_at_k.max_new_tokens (null: rollout.max_new_tokens)
    val_features: bool = False  # callbacks.pass_at_k.features not null: one feature forward after sampling
    base_bytes: int = 0  # LoRA: bytes of a frozen base weight (model.lora.base_dtype); 0: the master's
    milestone_bytes: int = 0  # callbacks.milestones on: bytes of a saved parameter (its dtype); 0: off

    @property
    def weight_bytes(self) -> int:
        """The master's, or with LoRA the frozen base's."""
        return self.base_bytes or self.master_bytes

    def budget_tokens(self, row_tokens: int) -> int:
        """Padded tokens of the largest forward, cut by rows and the token budget as
        ``step/micro_batches.py`` cuts them (a longer row still runs alone)."""
        full = self.micro_batch * row_tokens
        return full if self.max_tokens is None else max(row_tokens, min(full, self.max_tokens))

    @property
    def shards(self) -> int:
        return self.devices if self.sharded else 1

    @property
    def autocast(self) -> bool:
        """Weights wider than the compute: every op casts its weight (Lightning: ``cache_enabled=False``)."""
        return self.weight_bytes > self.compute_bytes

    @property
    def tokens_per_row(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @property
    def resid_bytes(self) -> int:
        """The residual stream: fp32 under autocast over fp32 weights, else (FSDP) the compute dtype."""
        return self.compute_bytes if self.sharded or not self.autocast else 4


@dataclass(frozen=True)
class Item:
    """One holder of memory in a phase: its bytes, how they were computed, and the setting that shrinks it."""

    name: str
    bytes: int
    how: str
    knob: str = ""


@dataclass
class Phase:
    name: str
    items: list[Item] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(i.bytes for i in self.items)


@dataclass
class MemoryPlan:
    run: RunShape
    size: ModelSize
    phases: list[Phase]
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def usable_bytes(self) -> int | None:
        return None if self.run.gpu_bytes is None else int(self.run.gpu_bytes * USABLE_FRACTION)

    @property
    def fits(self) -> bool | None:
        """None when no hardware is declared."""
        usable = self.usable_bytes
        return None if usable is None else all(p.total <= usable for p in self.phases)

    def hints(self) -> list[str]:
        """For each phase over the GPU: its largest holders and the settings that shrink them."""
        usable = self.usable_bytes
        out = []
        for phase in self.phases:
            if usable is None or phase.total <= usable:
                continue
            top = sorted((i for i in phase.items if i.knob), key=lambda i: -i.bytes)[:3]
            knobs = "; ".join(f"{i.name} ({gib(i.bytes)}): {i.knob}" for i in top)
            out.append(f"{phase.name} is {gib(phase.total - usable)} over: {knobs}")
        return out


def gib(n: float) -> str:
    """Bytes for people: GiB, or MiB below a tenth of one."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def run_shape(run: RunConfig, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> RunShape:
    trainer, rollout, algo, model = run.trainer, run.rollout, run.algorithm, run.model
    devices = _count(trainer.devices) * trainer.num_nodes
    strategy = trainer.strategy  # a name, or a node with a _target_
    target = strategy.get("_target_", "") if isinstance(strategy, Mapping) else strategy
    sharded = "fsdp" in str(target).lower()
    precision = str(trainer.precision)
    master = DTYPE_BYTES.get(model.dtype.lower(), 4)
    compute = 2 if ("bf16" in precision or "16" in precision.split("-")[0]) else master
    n = rollout.n
    seqs = math.ceil(run.data.prompts_per_step / devices) * n
    rows = max(rollout.max_batch_size // n, 1) * n
    vllm, hardware = rollout.vllm, run.hardware
    # "auto" is the policy's dtype (rollout/vllm.py _engine_dtype)
    engine_bytes = DTYPE_BYTES.get(vllm.dtype, master)
    response_tokens = rollout.max_new_tokens
    val = callback_settings(run, "pass_at_k", PassAtKValidation)
    val_n = val.n
    # HF: a chunk of batch_size // n problems, which the engine cuts by its own rows per call
    val_prompts = min(max(1, val.batch_size // val_n), max(1, rollout.max_batch_size // val_n))
    base = dtype_bytes(model.weights_dtype(precision), master) if model.lora.enabled else 0
    milestones = callback_settings(run, "milestones", WeightMilestones)
    return RunShape(
        devices=devices,
        sharded=sharded,
        ddp=devices > 1 and not sharded,
        master_bytes=master,
        compute_bytes=compute,
        gradient_checkpointing=model.gradient_checkpointing,
        backend=rollout.backend,
        sequences_per_rank=seqs,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        generate_rows=min(rows, seqs),
        micro_batch=algo.micro_batch_size,
        max_tokens=algo.max_tokens_per_microbatch,
        # LoRA: the reference is the policy with its adapters off, no copy (models/lora.py)
        reference_model=algo.kl_coef > 0 and not model.lora.enabled,
        vllm_fraction=vllm.gpu_memory_utilization,
        vllm_kv_bytes=vllm.kv_cache_memory_bytes,
        vllm_weight_bytes=engine_bytes,
        vllm_sleep=vllm.enable_sleep_mode,
        gpu_bytes=None if hardware is None else int(hardware.gpu_memory_gib * GIB),
        hardware=None if hardware is None else hardware.name,
        on_gpu=trainer.accelerator != "cpu",
        validation=val.every_n_steps > 0,
        val_generate_rows=val_prompts * val_n,
        val_response_tokens=val.max_new_tokens or response_tokens,
        val_features=val.features is not None,
        base_bytes=base,
        milestone_bytes=dtype_bytes(milestones.dtype, master) if milestones.every_n_steps > 0 else 0,
    )


def dtype_bytes(name: str, default: int) -> int:
    """``default`` for "auto" (the checkpoint's own dtype, which the plan does not read)."""
    dtype = resolve_dtype(name)
    return default if isinstance(dtype, str) else dtype.itemsize


def callback_settings(run: RunConfig, key: str, callback: type) -> Any:
    """``callbacks.<key>``'s settings; every_n_steps 0 (off) when the run builds no such callback."""
    built = run.callbacks.get(key)
    return settings_model(callback)(every_n_steps=0) if built is None else built.settings


def _count(v: Any) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, (list, tuple)):
        return len(v)
    raise ValueError(f"medsrl-plan needs a number of devices, got {v!r} (set trainer.devices=N)")


def layer_forward_bytes(size: ModelSize, tokens: int, compute_bytes: int, resid_bytes: int = 4) -> int:
    """One decoder layer's no-grad forward: the residual stream and the norm's fp32 upcast, q/k/v
    and the attention output, the MLP's gate, up and product (sdpa: no ``T x T`` scores)."""
    H, inter = size.hidden_size, size.intermediate_size
    per_token = (H + 2 * size.q_width + 2 * size.kv_width + 3 * inter) * compute_bytes + H * resid_bytes + H * 4
    return tokens * per_token


def layer_saved_bytes(size: ModelSize, tokens: int, compute_bytes: int) -> int:
    """What one decoder layer saves for its backward under autocast, as measured on CPU: four fp32
    ``H`` tensors (each norm's input and output), six ``H``-wide casts (autocast's cache is off),
    q, k, v, gate, up, act(gate) and their product. Without autocast: an upper bound."""
    H, inter = size.hidden_size, size.intermediate_size
    per_token = (6 * H + size.q_width + 2 * size.kv_width + 4 * inter) * compute_bytes + 4 * H * 4
    return tokens * per_token


def kv_cache_bytes(size: ModelSize, rows: int, tokens: int, compute_bytes: int) -> int:
    return rows * tokens * size.kv_bytes_per_token * compute_bytes


def head_chunk_bytes(size: ModelSize, chunk: int, compute_bytes: int, backward: bool) -> int:
    """The fused log-prob head (``algo/logprobs.py``): a chunk's logits, two fp32 ``[chunk, V]``
    buffers and in the backward the gradient at the logits."""
    per_row = size.vocab_size * (compute_bytes + 8 + (compute_bytes if backward else 0))
    return chunk * per_row


def head_weight_grad_items(size: ModelSize, run: RunShape) -> list[Item]:
    """``_FusedHeadLogprob.backward``'s buffers for the LM head's weight gradient (none with LoRA:
    the head is frozen): the fp32 sum, a chunk's product when the compute is not fp32, the cast."""
    if size.lora:
        return []
    V, H, c = size.vocab_size, size.hidden_size, run.compute_bytes
    weight_bytes = c if run.sharded else run.master_bytes
    items = [Item("head grad accumulator", V * H * 4, f"the fused head's fp32 weight-gradient sum: {V} x {H} x 4 B")]
    if c < 4:
        items.append(Item("head grad product", V * H * c, f"a chunk's g.t() @ h before it is added: {V} x {H} x {c} B"))
    if weight_bytes != 4:
        whose = "the gathered weight's" if run.sharded else "the weight's"
        items.append(Item("head grad cast", V * H * weight_bytes,
                          f"the sum returned in {whose} dtype: {V} x {H} x {weight_bytes} B"))
    return items


def sync_items(size: ModelSize, run: RunShape) -> list[Item]:
    """The weight sync's transient (``streamed_weights``): a parameter made whole at a time under
    FSDP, one vLLM layer's fresh copies (its layerwise reload holds them), a LoRA module's merge."""
    w, e = run.weight_bytes, run.vllm_weight_bytes
    items = gathered_parameter(size, run, e) if run.sharded else []
    if run.sharded and size.lora:
        n = size.lora_largest_matrix
        items.append(Item("gathered base weight", n * w, f"the largest adapted weight whole: {n:,} x {w} B",
                          "model.lora.target_modules"))
    if run.sharded or size.lora or w != e:
        items.append(Item("engine-dtype copies", max(size.root_params, size.layer_params) * e,
                          f"one layer's tensors held until vLLM's layer is complete: max(root, layer) x {e} B"))
    if size.lora:
        items.append(lora_merge_item(size, run))
    return items


def gathered_parameter(size: ModelSize, run: RunShape, dtype_bytes: int) -> list[Item]:
    """``models/sharding.py`` ``whole`` of the largest parameter: its shard cast, the all-gather's
    padded copy, and the whole tensor."""
    L, N, d = size.largest_param, run.shards, dtype_bytes
    shard = -(-L // N)
    return [Item("gathered parameter", L * d, f"the largest parameter, {L:,} elements, whole on every rank "
                 f"(DTensor.full_tensor) in {d} B"),
            Item("shard copies", 2 * shard * d, f"its shard cast and padded for the all-gather: 2 x {shard:,} x {d} B")]


def lora_merge_item(size: ModelSize, run: RunShape) -> Item:
    """``merged_weights``: a module's delta in the adapters' dtype, added in the base's dtype."""
    n, m, w = size.lora_largest_matrix, run.master_bytes, run.weight_bytes
    if w == m:
        return Item("LoRA merge", 2 * n * m, f"one module's delta and merged weight: 2 x {n:,} x {m} B",
                    "model.lora.target_modules")
    return Item("LoRA merge", n * (m + 2 * w), f"one module's delta, its cast to the base's dtype and the merged "
                f"weight: {n:,} x ({m} + 2 x {w}) B", "model.lora.target_modules")


def hf_generation_items(size: ModelSize, run: RunShape, rows: int, response_tokens: int, rows_knob: str) -> list[Item]:
    """HF ``generate`` of ``rows`` sequences a call; under FSDP on the whole policy (``full_weights``)."""
    c, w, P = run.compute_bytes, run.weight_bytes, size.params
    V, H = size.vocab_size, size.hidden_size
    T = run.prompt_tokens + response_tokens
    # K and V come out fp32 under autocast over fp32 weights (the rotary cos/sin follow the fp32
    # residual stream): measured on CPU, tests/plan/test_gpu_bytes.py
    kv = 4 if run.autocast else c
    items = []
    if run.sharded:
        items.append(Item("policy gathered whole", w * P, f"a plain model filled from the stream: {P:,} x {w} B",
                          "rollout.backend=vllm (HF generate runs on the whole policy)"))
    items += [
        Item("KV cache", kv_cache_bytes(size, rows, T, kv) * (size.num_layers + 1) // size.num_layers,
             f"{rows} rows x {T} tokens x {size.kv_bytes_per_token} x {kv} B (+1 layer: the cache grows by copy)",
             rows_knob),
        Item("prefill activations", layer_forward_bytes(size, rows * run.prompt_tokens, c, 4 if run.autocast else c),
             f"one layer over {rows} x {run.prompt_tokens} prompt tokens", rows_knob),
        Item("sampling logits", rows * V * 4 * 3, f"{rows} x {V} fp32: logits, probabilities, a copy"),
    ]
    if run.autocast:
        items.append(Item("bf16 cast of a weight", V * H * c, f"the largest matrix ({V} x {H}) cast per op"))
    return items


def resident_items(size: ModelSize, run: RunShape) -> list[Item]:
    """What every phase holds."""
    P, Pt, shards = size.params, size.trained, run.shards
    m, w = run.master_bytes, run.weight_bytes
    share = f" / {shards} ranks" if shards > 1 else ""
    shard_knob = "" if run.sharded else SHARD_KNOB
    base = " (the frozen base: model.lora.base_dtype)" if size.lora else ""
    items = [Item("weights", w * P // shards, f"{P:,} params x {w} B{share}{base}", shard_knob)]
    if size.lora:
        items.append(Item("adapter weights", m * Pt // shards, f"{Pt:,} x {m} B{share}"))
    items.append(Item("AdamW moments", 2 * m * Pt // shards, f"2 x {Pt:,} x {m} B{share}", shard_knob))
    if run.on_gpu:
        items.append(Item("runtime", RUNTIME_BYTES, "CUDA context, cuBLAS, NCCL (assumed)"))
    if run.reference_model:
        items.append(Item("KL reference model", w * P, f"a full copy on every rank: {P:,} x {w} B",
                          "algorithm.kl_coef=0"))
    return items


def plan_memory(size: ModelSize, run: RunShape) -> MemoryPlan:
    """The bytes per GPU of every phase, in the order a run meets them."""
    resident = resident_items(size, run)
    engine = _engine_item(size, run)
    engines = [engine] if engine is not None else []
    awake = engines if not run.vllm_sleep else []  # in every later phase
    held = [*resident, rollout_item(run)]
    phases = [resume_phase(size, run, resident, engines)]
    if engine is not None:  # at train start the engine was just built: awake whole (weights and KV cache)
        phases.append(Phase("first weight sync", [*resident, engine, *sync_items(size, run)]))
    phases += [generation_phase(size, run, [*resident, *engines]), scoring_phase(size, run, [*held, *awake]),
               *update_phases(size, run, held, awake)]
    if engine is not None:  # after each update; a sleeping engine wakes its weights alone
        woken = engine if not run.vllm_sleep else Item(
            "vLLM weights (woken)", size.params * run.vllm_weight_bytes,
            f"{size.params:,} x {run.vllm_weight_bytes} B; the KV cache stays asleep until generation")
        phases.append(Phase("weight sync", [*held, woken, *sync_items(size, run)]))
    if run.validation:
        phases += validation_phases(size, run, held, engines, awake)
    if run.milestone_bytes:
        phases.append(milestone_phase(size, run, [*held, *awake]))
    return MemoryPlan(run, size, phases, plan_notes(size, run, engine))


def rollout_item(run: RunShape) -> Item:
    """Held from scoring to the next generation."""
    T = run.tokens_per_row
    return Item("rollout tensors", run.sequences_per_rank * (T * 3 * 8 + run.response_tokens * 4 * 4),
                f"{run.sequences_per_rank} rows x {T} tokens: ids, mask, positions (int64); log-probs, stats (fp32)",
                "data.prompts_per_step")


def forward_items(size: ModelSize, run: RunShape) -> tuple[list[Item], list[Item]]:
    """``(units, cast)`` of every forward but HF generation: FSDP's gathered units, or autocast's cast."""
    V, H, c = size.vocab_size, size.hidden_size, run.compute_bytes
    units = [Item("gathered units", (size.root_params + 2 * size.layer_params) * c, f"root {size.root_params:,} + "
                  f"2 layers x {size.layer_params:,} (one computing, one prefetched) x {c} B")] if run.sharded else []
    cast = [Item("bf16 cast of a weight", V * H * c, f"the largest matrix ({V} x {H}) cast per op")
            ] if run.autocast and not run.sharded else []
    return units, cast


def _micro_batch_knob(run: RunShape) -> str:
    return "algorithm.micro_batch_size" if run.max_tokens is None else "algorithm.max_tokens_per_microbatch"


def generation_phase(size: ModelSize, run: RunShape, held: list[Item]) -> Phase:
    generation = Phase("generation", list(held))
    if run.backend == "hf":
        generation.items += hf_generation_items(size, run, run.generate_rows, run.response_tokens,
                                                "rollout.max_batch_size (rows per generate call)")
    return generation


def scoring_phase(size: ModelSize, run: RunShape, held: list[Item]) -> Phase:
    c = run.compute_bytes
    head = Item("log-prob head chunk", head_chunk_bytes(size, run.chunk_tokens, c, backward=False),
                f"{run.chunk_tokens} tokens x {size.vocab_size} x ({c} + 8) B")
    items = no_grad_forward_items(size, run, run.tokens_per_row, "", _micro_batch_knob(run), head)
    return Phase("scoring", [*held, *items])


def no_grad_forward_items(size: ModelSize, run: RunShape, row_tokens: int, how: str, knob: str,
                          *head: Item) -> list[Item]:
    units, cast = forward_items(size, run)
    tokens = run.budget_tokens(row_tokens)
    over = f"{run.micro_batch} x {row_tokens}" if tokens == run.micro_batch * row_tokens else f"a budget of {tokens}"
    return [*units, Item("activations (no grad)", layer_forward_bytes(size, tokens, run.compute_bytes, run.resid_bytes),
                         f"one layer over {over} tokens{how}", knob), *head, *cast]


def update_phases(size: ModelSize, run: RunShape, held: list[Item], awake: list[Item]) -> list[Phase]:
    """The update and the optimiser step, both beside the gradients (and DDP's buckets)."""
    Pt, m, shards = size.trained, run.master_bytes, run.shards
    share = f" / {shards} ranks" if shards > 1 else ""
    grads = Item("gradients", m * Pt // shards, f"{Pt:,} x {m} B{share}", "" if run.sharded else SHARD_KNOB)
    buckets = [Item("DDP gradient buckets", m * Pt, f"{Pt:,} x {m} B", "trainer=fsdp")] if run.ddp else []
    beside = [*held, grads, *awake, *buckets]
    temporaries = Item("AdamW temporaries", m * Pt // shards,
                       f"foreach: one fp32 list the size of the {'shards' if shards > 1 else 'params'}")
    return [Phase("update", [*beside, *backward_items(size, run)]), Phase("optimizer step", [*beside, temporaries])]


def backward_items(size: ModelSize, run: RunShape) -> list[Item]:
    V, H, c, tokens = size.vocab_size, size.hidden_size, run.compute_bytes, run.budget_tokens(run.tokens_per_row)
    items = []
    if run.sharded:
        items += [*forward_items(size, run)[0],
                  Item("unsharded gradients", (size.root_params + size.layer_params) * c
                       + max(size.root_params, size.layer_params) * 4,
                       f"root + 1 layer x {c} B, the larger as fp32 for the reduce-scatter")]
    elif run.autocast:
        saved = (V * H + size.layer_params) if run.gradient_checkpointing else size.params
        items.append(Item("bf16 weight casts", saved * c, "the LM head's and the recomputed layer's"
                          if run.gradient_checkpointing else "every layer's, saved for backward",
                          "" if run.gradient_checkpointing else "model.gradient_checkpointing=true"))
    if run.gradient_checkpointing:  # keeps the residual stream per layer
        acts = size.num_layers * tokens * H * run.resid_bytes + 2 * layer_saved_bytes(size, tokens, c)
        how = (f"{size.num_layers} layer inputs x {tokens} tokens x {H} x {run.resid_bytes} B, and one layer "
               "recomputed with its gradients (2x its saved tensors)")
        knob = _micro_batch_knob(run)
    else:
        acts = (size.num_layers + 1) * layer_saved_bytes(size, tokens, c)
        how = f"{size.num_layers} layers' saved tensors over {tokens} tokens, and one layer's gradients"
        knob = f"model.gradient_checkpointing=true, {_micro_batch_knob(run)}"
    return [*items, Item("activations", acts, how, knob),
            Item("log-prob head chunk", head_chunk_bytes(size, run.chunk_tokens, c, backward=True),
                 f"{run.chunk_tokens} tokens x {V} x (2 x {c} + 8) B (recomputed in backward)"),
            *head_weight_grad_items(size, run)]


def plan_notes(size: ModelSize, run: RunShape, engine: Item | None) -> list[str]:
    """What the tables leave out."""
    P, Pt, m = size.params, size.trained, run.master_bytes
    notes = []
    if size.trainable_params is not None:
        notes.append(f"LoRA: {Pt:,} adapter parameters train in {m} B (gradients and AdamW states for "
                     f"those only); the {P:,} base weights are frozen, in {run.weight_bytes} B")
    if run.milestone_bytes:
        notes.append(f"milestone: rank 0's host memory gathers the whole policy in {run.milestone_bytes} B, "
                     f"{gib(P * run.milestone_bytes)}, before save_pretrained writes it")
    if engine is not None:
        kv = engine.bytes - size.params * run.vllm_weight_bytes - RUNTIME_BYTES
        per_row = run.tokens_per_row * size.kv_bytes_per_token * run.vllm_weight_bytes
        notes.append(f"vLLM KV cache about {gib(kv)}: {max(kv, 0) // per_row} sequences of {run.tokens_per_row} "
                     "tokens at once (vLLM pages the rest)")
    if run.backend == "hf":
        fill = math.ceil(run.sequences_per_rank / run.generate_rows)
        notes.append(f"HF generate: {run.sequences_per_rank} responses per rank in {fill} calls of "
                     f"{run.generate_rows} rows")
    if run.validation:
        rows = f", HF {run.val_generate_rows} rows a call" if run.backend == "hf" else ""
        notes.append(f"validation: responses of <= {run.prompt_tokens} + {run.val_response_tokens} tokens{rows}, "
                     f"features {'on' if run.val_features else 'off'}, beside the last step's rollout "
                     "tensors; callbacks.pass_at_k.every_n_steps=0 turns it off")
    return notes


def milestone_phase(size: ModelSize, run: RunShape, held: list[Item]) -> Phase:
    """``callbacks.milestones``, the engine released first: under FSDP a parameter made whole at a
    time to rank 0's host (``host_weights``); else ``save_policy`` casts the state dict on the GPU."""
    d, w, P = run.milestone_bytes, run.weight_bytes, size.params
    items = list(held)
    if run.sharded:
        items += gathered_parameter(size, run, d)
        if size.lora:
            n = size.lora_largest_matrix
            items += [Item("gathered base weight", n * w, f"the largest adapted weight whole: {n:,} x {w} B",
                           "model.lora.target_modules"), lora_merge_item(size, run)]
        return Phase("milestone", items)
    if size.lora:
        items.append(Item("merged state dict", P * w, f"every adapted weight merged (at most {P:,} x {w} B)"))
    if d != w:
        items.append(Item("state dict cast", P * d, f"save_policy casts the state dict on the GPU: {P:,} x {d} B",
                          "callbacks.milestones.every_n_steps=0"))
    return Phase("milestone", items)


def resume_phase(size: ModelSize, run: RunShape, resident: list[Item], engines: list[Item]) -> Phase:
    """``ckpt_path=``, the engine awake: reads land in host memory; under FSDP the AdamW states are
    first made by a zero-lr step (``_init_optim_state``): its gradients and temporaries."""
    Pt, m, shards = size.trained, run.master_bytes, run.shards
    share = f" / {shards} ranks" if shards > 1 else ""
    items = [*resident, *engines]
    if run.sharded:
        items += [
            Item("zero gradients", m * Pt // shards, f"the state init's zero-lr step: {Pt:,} x {m} B{share}"),
            Item("AdamW temporaries", m * Pt // shards, f"that step's foreach list: {Pt:,} x {m} B{share}"),
            Item("checkpoint reads", 0, "host memory, one saved tensor at a time, copied into its shard"),
        ]
    else:
        items.append(Item("checkpoint reads", 0, "host memory (the whole checkpoint), copied into the weights"))
    return Phase("resume", items)


def validation_phases(size: ModelSize, run: RunShape, held: list[Item], engines: list[Item],
                      awake: list[Item]) -> list[Phase]:
    """``callbacks/pass_at_k.py``: sampling, the engine released, then the feature forward."""
    sampling = Phase("validation sampling", [*held, *engines])
    if run.backend == "hf":
        sampling.items += hf_generation_items(
            size, run, run.val_generate_rows, run.val_response_tokens,
            "callbacks.pass_at_k.batch_size, rollout.max_batch_size (rows per generate call)")
    if not run.val_features:
        return [sampling]
    features = no_grad_forward_items(size, run, run.prompt_tokens + run.val_response_tokens,
                                     " (logits_to_keep=1: no head chunk)",
                                     f"{_micro_batch_knob(run)}, callbacks.pass_at_k.features=null")
    return [sampling, Phase("validation features", [*held, *awake, *features])]


def _engine_item(size: ModelSize, run: RunShape) -> Item | None:
    if run.backend != "vllm":
        return None
    if run.vllm_kv_bytes:
        weights = size.params * run.vllm_weight_bytes
        total = weights + int(run.vllm_kv_bytes) + RUNTIME_BYTES
        return Item("vLLM engine", total, f"weights {gib(weights)} + kv_cache_memory_bytes + 1 GiB activations",
                    "rollout.vllm.kv_cache_memory_bytes")
    if run.gpu_bytes is None:
        return None
    total = int(run.gpu_bytes * float(run.vllm_fraction or 0.9))
    return Item("vLLM engine", total, f"gpu_memory_utilization {run.vllm_fraction} x the GPU",
                "rollout.vllm.gpu_memory_utilization, rollout.vllm.enable_sleep_mode=true")


def format_plan(plan: MemoryPlan) -> str:
    run, size = plan.run, plan.size
    lines = [
        f"model: {size.params / 1e9:.2f}B params ({size.num_layers} layers of {size.layer_params:,}, "
        f"root {size.root_params:,}), vocabulary {size.vocab_size:,}",
        f"run: {run.devices} {'GPU(s)' if run.on_gpu else 'CPU process(es)'}"
        f"{' FSDP per layer' if run.sharded else ' DDP' if run.ddp else ''}, "
        f"master {run.master_bytes} B / compute {run.compute_bytes} B"
        f"{f' / LoRA base {run.weight_bytes} B' if size.lora else ''}, {run.backend} rollouts, "
        f"{run.sequences_per_rank} responses per rank of <= {run.prompt_tokens} + {run.response_tokens} tokens, "
        f"micro-batch {run.micro_batch}{'' if run.max_tokens is None else f' rows / {run.max_tokens} tokens'}, "
        f"gradient checkpointing {'on' if run.gradient_checkpointing else 'off'}",
        "every figure is computed (arithmetic below), per device",
        "",
    ]
    for phase in plan.phases:
        lines.append(f"{phase.name}: {gib(phase.total)}")
        for item in phase.items:
            lines.append(f"  {item.name:<24} {gib(item.bytes):>10}   {item.how}")
        lines.append("")
    lines += [f"note: {n}" for n in plan.notes]
    peak = plan.peak
    if plan.fits is None:
        lines.append(f"peak: {peak.name}, {gib(peak.total)} per GPU; "
                     "no hardware declared (hardware.gpu_memory_gib): not checked")
    else:
        usable = plan.usable_bytes
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        lines.append(f"{verdict} {run.hardware or ''}: peak {peak.name} {gib(peak.total)} of {gib(usable)} usable "
                     f"({USABLE_FRACTION:.0%} of {gib(run.gpu_bytes)})")
        lines += [f"  {h}" for h in plan.hints()]
    return "\n".join(lines)
