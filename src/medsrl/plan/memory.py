"""Memory per GPU and per phase of a training step, by arithmetic from the run's settings.

What ``medsrl-plan`` prints (docs/GPU.md). Every figure is computed from the model's parameter
counts (``plan/model_size.py``) and the run's batch, precision and sharding; what a CPU can
measure is checked in ``tests/plan/test_memory_plan.py``, the rest (activations, KV cache, the
engine) are estimates with their formulas. Phases, as ``module.py`` runs them: generation (the
policy gathered whole under FSDP; HF's KV cache or vLLM's reservation), scoring (no-grad
forward per micro-batch), update (forward + backward of one micro-batch, the step's gradients
alive), optimizer step. A vLLM engine without sleep mode keeps its reservation throughout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from medsrl.algo.logprobs import CHUNK_TOKENS
from medsrl.models.lora import lora_settings
from medsrl.plan.model_size import ModelSize

GIB = 2**30
# PyTorch's caching allocator never hands out all of a GPU: blocks are rounded and split. The
# plan calls a phase fitting when it needs at most this fraction of the GPU.
USABLE_FRACTION = 0.90
RUNTIME_BYTES = 1 * GIB  # CUDA context, cuBLAS workspaces (and NCCL buffers with several ranks): assumed
DEFAULT_PROMPT_TOKENS = 1024  # the reference run's longest prompt (PAPER.md)
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


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

    @property
    def micro_batch_tokens(self) -> int:
        """Padded tokens of the largest forward/backward: ``micro_batch`` rows of the longest
        prompt + response, or the token budget when smaller (a longer row still runs alone)."""
        full = self.micro_batch * self.tokens_per_row
        return full if self.max_tokens is None else max(self.tokens_per_row, min(full, self.max_tokens))

    @property
    def shards(self) -> int:
        return self.devices if self.sharded else 1

    @property
    def autocast(self) -> bool:
        """fp32 masters computed in bf16: every op casts its weight (Lightning: ``cache_enabled=False``)."""
        return self.master_bytes > self.compute_bytes

    @property
    def tokens_per_row(self) -> int:
        return self.prompt_tokens + self.response_tokens


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
        """Whether every phase fits the declared GPU; None when no hardware is declared."""
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


def run_shape(cfg: Mapping[str, Any], prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> RunShape:
    """The :class:`RunShape` of a composed training config (``configs/train.yaml`` + overrides)."""
    trainer, rollout, algo, model = cfg["trainer"], cfg["rollout"], cfg["algorithm"], cfg["model"]
    devices = _count(trainer.get("devices", 1)) * _count(trainer.get("num_nodes", 1))
    strategy = trainer.get("strategy") or ""  # a name, or a node with a _target_
    target = strategy.get("_target_", "") if isinstance(strategy, Mapping) else strategy
    sharded = "fsdp" in str(target).lower()
    precision = str(trainer.get("precision", "32-true"))
    master = DTYPE_BYTES.get(str(model.get("dtype", "float32")).lower().removeprefix("torch."), 4)
    compute = 2 if ("bf16" in precision or "16" in precision.split("-")[0]) else master
    prompts = int(cfg["data"].get("prompts_per_step") or 1)
    n = int(rollout.get("n", 1))
    seqs = math.ceil(prompts / devices) * n
    rows = max(int(rollout.get("max_batch_size", 64)) // n, 1) * n
    vllm = rollout.get("vllm") or {}
    hardware = cfg.get("hardware") or None
    engine_dtype = str(vllm.get("dtype", "auto"))
    engine_bytes = DTYPE_BYTES.get(engine_dtype, compute if engine_dtype == "auto" and master == compute else master)
    return RunShape(
        devices=devices,
        sharded=sharded,
        ddp=devices > 1 and not sharded,
        master_bytes=master,
        compute_bytes=compute,
        gradient_checkpointing=bool(model.get("gradient_checkpointing")),
        backend=str(rollout.get("backend", "hf")),
        sequences_per_rank=seqs,
        prompt_tokens=prompt_tokens,
        response_tokens=int(rollout.get("max_new_tokens")),
        generate_rows=min(rows, seqs),
        micro_batch=int(algo.get("micro_batch_size")),
        max_tokens=None if algo.get("max_tokens_per_microbatch") is None else int(algo.get("max_tokens_per_microbatch")),
        # LoRA: the reference is the policy with its adapters off, no copy (models/lora.py)
        reference_model=float(algo.get("kl_coef") or 0.0) > 0 and not lora_settings(model).enabled,
        vllm_fraction=vllm.get("gpu_memory_utilization"),
        vllm_kv_bytes=vllm.get("kv_cache_memory_bytes"),
        vllm_weight_bytes=engine_bytes,
        vllm_sleep=bool(vllm.get("enable_sleep_mode")),
        gpu_bytes=None if hardware is None else int(float(hardware["gpu_memory_gib"]) * GIB),
        hardware=None if hardware is None else str(hardware.get("name", "")),
        on_gpu=str(trainer.get("accelerator", "cpu")) != "cpu",
    )


def _count(v: Any) -> int:
    if isinstance(v, int):
        return v
    if isinstance(v, (list, tuple)):
        return len(v)
    raise ValueError(f"medsrl-plan needs a number of devices, got {v!r} (set trainer.devices=N)")


def layer_forward_bytes(size: ModelSize, tokens: int, compute_bytes: int) -> int:
    """The working set of one decoder layer's no-grad forward over ``tokens``: the fp32
    residual stream and norm upcast, q/k/v and the attention output, the MLP's gate, up and
    product (sdpa attention: no ``T x T`` scores)."""
    H, inter = size.hidden_size, size.intermediate_size
    per_token = (H + 2 * size.q_width + 2 * size.kv_width + 3 * inter) * compute_bytes + 2 * H * 4
    return tokens * per_token


def layer_saved_bytes(size: ModelSize, tokens: int, compute_bytes: int) -> int:
    """What one decoder layer saves for its backward over ``tokens`` under autocast, as measured
    on CPU (``tests/plan/test_memory_plan.py``): four fp32 ``H`` tensors (each norm's input and its
    fp32 normalised output); six ``H``-wide casts (each of q/k/v/o/gate/up casts its input
    itself: autocast's cache is off); q, k, v; gate, up, act(gate) and their product. Without
    autocast (inputs already in the compute dtype) the casts are shared: an upper bound."""
    H, inter = size.hidden_size, size.intermediate_size
    per_token = (6 * H + size.q_width + 2 * size.kv_width + 4 * inter) * compute_bytes + 4 * H * 4
    return tokens * per_token


def kv_cache_bytes(size: ModelSize, rows: int, tokens: int, compute_bytes: int) -> int:
    """K and V of every layer for ``rows`` sequences of ``tokens``."""
    return rows * tokens * size.kv_bytes_per_token * compute_bytes


def head_chunk_bytes(size: ModelSize, chunk: int, compute_bytes: int, backward: bool) -> int:
    """The fused log-prob head's vocabulary-wide buffers (``algo/logprobs.py``): one chunk's
    logits in the compute dtype and two fp32 ``[chunk, V]`` buffers; the backward adds the
    gradient at the logits, in the compute dtype."""
    per_row = size.vocab_size * (compute_bytes + 8 + (compute_bytes if backward else 0))
    return chunk * per_row


def plan_memory(size: ModelSize, run: RunShape) -> MemoryPlan:
    """The bytes per GPU of every phase of a step (see the module docstring)."""
    P, shards = size.params, run.shards
    Pt = size.trained  # with gradients and AdamW states: all, or with LoRA the adapters
    c, m = run.compute_bytes, run.master_bytes
    V, H = size.vocab_size, size.hidden_size
    share = f" / {shards} ranks" if shards > 1 else ""
    T = run.tokens_per_row
    mb_tokens = run.micro_batch_tokens
    mb_how = (f"{run.micro_batch} x {T}" if mb_tokens == run.micro_batch * T
              else f"a budget of {mb_tokens}")
    mb_knob = "algorithm.micro_batch_size" if run.max_tokens is None else "algorithm.max_tokens_per_microbatch"

    shard_knob = "" if run.sharded else "trainer=fsdp trainer.devices=N"
    resident = [
        Item("weights", m * P // shards, f"{P:,} params x {m} B{share}", shard_knob),
        Item("AdamW moments", 2 * m * Pt // shards, f"2 x {Pt:,} x {m} B{share}", shard_knob),
    ]
    if run.on_gpu:
        resident.append(Item("runtime", RUNTIME_BYTES, "CUDA context, cuBLAS, NCCL (assumed)"))
    if run.reference_model:
        resident.append(Item("KL reference model", m * P, f"a full copy on every rank: {P:,} x {m} B",
                             "algorithm.kl_coef=0"))
    engine = _engine_item(size, run)
    awake = [engine] if engine is not None and not run.vllm_sleep else []  # in every later phase
    rollouts = Item(
        "rollout tensors",
        run.sequences_per_rank * (T * 3 * 8 + run.response_tokens * 4 * 4),
        f"{run.sequences_per_rank} rows x {T} tokens: ids, mask, positions (int64); log-probs, stats (fp32)",
        "data.prompts_per_step",
    )
    gathered = [Item("policy gathered whole", m * P, f"summon_full_params: {P:,} x {m} B",
                     "none yet: HF generation, scoring and the vLLM sync gather the policy")] if run.sharded else []
    cast = [Item("bf16 cast of a weight", V * H * c, f"the largest matrix ({V} x {H}) cast per op")] if run.autocast else []

    generation = Phase("generation", [*resident, *([engine] if engine else [])])
    if run.backend == "hf":  # the policy generates (vLLM: the engine, from its own copy)
        rows = run.generate_rows
        # K and V come out fp32 under autocast over fp32 weights (the rotary cos/sin follow the
        # fp32 residual stream): measured on CPU, tests/plan/test_memory_plan.py
        kv = 4 if run.autocast else c
        generation.items += [
            *gathered,
            Item("KV cache", kv_cache_bytes(size, rows, T, kv) * (size.num_layers + 1) // size.num_layers,
                 f"{rows} rows x {T} tokens x {size.kv_bytes_per_token} x {kv} B (+1 layer: the cache grows by copy)",
                 "rollout.max_batch_size (rows per generate call)"),
            Item("prefill activations", layer_forward_bytes(size, rows * run.prompt_tokens, c),
                 f"one layer over {rows} x {run.prompt_tokens} prompt tokens", "rollout.max_batch_size"),
            Item("sampling logits", rows * V * 4 * 3, f"{rows} x {V} fp32: logits, probabilities, a copy"),
            *cast,
        ]

    scoring = Phase("scoring", [
        *resident, rollouts, *awake, *gathered,
        Item("activations (no grad)", layer_forward_bytes(size, mb_tokens, c),
             f"one layer over {mb_how} tokens", mb_knob),
        Item("log-prob head chunk", head_chunk_bytes(size, run.chunk_tokens, c, backward=False),
             f"{run.chunk_tokens} tokens x {V} x ({c} + 8) B"),
        *cast,
    ])

    grads = Item("gradients", m * Pt // shards, f"{Pt:,} x {m} B{share}", shard_knob)
    buckets = [Item("DDP gradient buckets", m * Pt, f"{Pt:,} x {m} B", "trainer=fsdp")] if run.ddp else []
    update = Phase("update", [*resident, rollouts, grads, *awake, *buckets])
    if run.sharded:
        units = size.root_params + 2 * size.layer_params
        update.items += [
            Item("gathered units", units * c, f"root {size.root_params:,} + 2 layers x {size.layer_params:,} "
                 f"(one computing, one prefetched) x {c} B"),
            Item("unsharded gradients", (size.root_params + size.layer_params) * c
                 + max(size.root_params, size.layer_params) * 4,
                 f"root + 1 layer x {c} B, the larger as fp32 for the reduce-scatter"),
        ]
    elif run.autocast:
        saved = (V * H + size.layer_params) if run.gradient_checkpointing else P
        update.items.append(Item("bf16 weight casts", saved * c, "the LM head's and the recomputed layer's"
                                 if run.gradient_checkpointing else "every layer's, saved for backward",
                                 "" if run.gradient_checkpointing else "model.gradient_checkpointing=true"))
    # the residual stream (what checkpointing keeps per layer) is fp32 under autocast over fp32
    # weights; FSDP's bf16 gathered weights make it bf16
    resid = 4 if run.autocast and not run.sharded else c
    if run.gradient_checkpointing:
        checkpoints = size.num_layers * mb_tokens * H * resid
        acts = checkpoints + 2 * layer_saved_bytes(size, mb_tokens, c)
        how = (f"{size.num_layers} layer inputs x {mb_tokens} tokens x {H} x {resid} B, and one layer "
               "recomputed with its gradients (2x its saved tensors)")
        knob = mb_knob
    else:
        acts = (size.num_layers + 1) * layer_saved_bytes(size, mb_tokens, c)
        how = f"{size.num_layers} layers' saved tensors over {mb_tokens} tokens, and one layer's gradients"
        knob = f"model.gradient_checkpointing=true, {mb_knob}"
    update.items += [
        Item("activations", acts, how, knob),
        Item("log-prob head chunk", head_chunk_bytes(size, run.chunk_tokens, c, backward=True),
             f"{run.chunk_tokens} tokens x {V} x (2 x {c} + 8) B (recomputed in backward)"),
    ]

    temporaries = Item("AdamW temporaries", m * Pt // shards,
                       f"foreach: one fp32 list the size of the {'shards' if shards > 1 else 'params'}")
    step = Phase("optimizer step", [*resident, rollouts, grads, *awake, *buckets, temporaries])

    phases = [generation, scoring, update, step]
    if engine is not None:  # the weights copied into the engine (its KV cache asleep when it sleeps)
        held = engine if not run.vllm_sleep else Item(
            "vLLM weights (woken)", size.params * run.vllm_weight_bytes,
            f"{P:,} x {run.vllm_weight_bytes} B; the KV cache stays asleep until generation")
        phases.append(Phase("weight sync", [*resident, rollouts, held, *gathered]))
    plan = MemoryPlan(run, size, phases)
    if size.trainable_params is not None:
        plan.notes.append(f"LoRA: {Pt:,} adapter parameters train (gradients and AdamW states for those "
                          f"only, their weights not counted above); the {P:,} base weights are frozen")
    if engine is not None:
        plan.notes.append(_engine_note(size, run, engine))
    if run.backend == "hf":
        fill = math.ceil(run.sequences_per_rank / run.generate_rows)
        plan.notes.append(f"HF generate: {run.sequences_per_rank} responses per rank in {fill} calls of "
                          f"{run.generate_rows} rows")
    return plan


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


def _engine_note(size: ModelSize, run: RunShape, engine: Item) -> str:
    kv = engine.bytes - size.params * run.vllm_weight_bytes - RUNTIME_BYTES
    per_row = run.tokens_per_row * size.kv_bytes_per_token * run.vllm_weight_bytes
    return (f"vLLM KV cache about {gib(kv)}: {max(kv, 0) // per_row} sequences of {run.tokens_per_row} tokens "
            "at once (vLLM pages the rest)")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as text: one table per phase, the verdict and the knobs to turn."""
    run, size = plan.run, plan.size
    lines = [
        f"model: {size.params / 1e9:.2f}B params ({size.num_layers} layers of {size.layer_params:,}, "
        f"root {size.root_params:,}), vocabulary {size.vocab_size:,}",
        f"run: {run.devices} {'GPU(s)' if run.on_gpu else 'CPU process(es)'}{' FSDP per layer' if run.sharded else ' DDP' if run.ddp else ''}, "
        f"master {run.master_bytes} B / compute {run.compute_bytes} B, {run.backend} rollouts, "
        f"{run.sequences_per_rank} responses per rank of <= {run.prompt_tokens} + {run.response_tokens} tokens, "
        f"micro-batch {run.micro_batch}{'' if run.max_tokens is None else f' rows / {run.max_tokens} tokens'}, gradient checkpointing {'on' if run.gradient_checkpointing else 'off'}",
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
        lines.append(f"peak: {peak.name}, {gib(peak.total)} per GPU; no hardware declared (hardware.gpu_memory_gib): not checked")
    else:
        usable = plan.usable_bytes
        verdict = "FITS" if plan.fits else "DOES NOT FIT"
        lines.append(f"{verdict} {run.hardware or ''}: peak {peak.name} {gib(peak.total)} of {gib(usable)} usable "
                     f"({USABLE_FRACTION:.0%} of {gib(run.gpu_bytes)})")
        lines += [f"  {h}" for h in plan.hints()]
    return "\n".join(lines)
