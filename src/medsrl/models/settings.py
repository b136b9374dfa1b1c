"""``model``: which policy a run trains (a Hugging Face name or path, or the tiny CPU preset),
its dtype, LoRA and the tiny preset's warm start."""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from medsrl.data.template import QWEN_MATH_SYSTEM_PROMPT
from medsrl.settings import (
    Count,
    Finite,
    Flag,
    NonEmpty,
    Positive,
    PositiveInt,
    Seed,
    Settings,
    Text,
    listed,
    must,
    nullable,
    one_of,
)

# The names a dtype setting takes, by torch dtype (models/loading.py maps them)
DTYPE_NAMES = {
    "float32": ("float32", "fp32", "float", "32"),
    "bfloat16": ("bfloat16", "bf16", "bf16-mixed", "bf16-true"),
    "float16": ("float16", "fp16", "half", "16", "16-mixed", "16-true"),
}
DTYPE_CHOICES = ("auto", *sorted(n for names in DTYPE_NAMES.values() for n in names))
ModelDtype = one_of(DTYPE_CHOICES)
# "compute": the dtype trainer.precision computes in (compute_dtype), else the master's
BaseDtype = one_of(("compute", *DTYPE_CHOICES))


def compute_dtype(precision: str | int) -> str | None:
    """The dtype a 16-bit ``trainer.precision`` computes in, else None (the weights' own)."""
    value = str(precision).lower()
    if value.startswith("bf16"):
        return "bfloat16"
    return "float16" if value.split("-")[0] == "16" else None


# The attention and MLP projections of Qwen2 / Qwen3 / Llama: every linear map of a decoder layer.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(Settings):
    """``model.lora`` (models/lora.py). ``dropout`` 0 by default: a dropout mask is drawn from the
    global generator, which a resumed run does not continue."""

    model_config = ConfigDict(frozen=True)

    r: Count = 0
    """Adapter rank; 0: off (full fine-tune)."""
    alpha: Positive = 16.0
    """Adapter scale numerator (PEFT's lora_alpha): B @ A is multiplied by alpha / r."""
    dropout: Annotated[Finite, Field(ge=0, lt=1), must("a number in [0, 1)")] = 0.0
    """Adapter input dropout; 0 keeps a resumed run equal to the uninterrupted one."""
    target_modules: Annotated[Literal["all-linear"] | listed(NonEmpty),
                              must("a non-empty list of module names (q_proj, ...) or 'all-linear'")] = DEFAULT_TARGETS
    """Module names (checked against the model before weights load), or PEFT's every linear layer."""
    merge_on_export: Flag = True
    """The exported policy is a plain model with the adapters merged (false: the adapter alone)."""
    base_dtype: BaseDtype = "compute"
    """The frozen base weights' dtype. compute: the dtype trainer.precision computes in (bfloat16
    under bf16-mixed: 2 bytes a parameter, which autocast would cast every weight to anyway;
    model.dtype under 32-true); float32: an fp32 base. The adapters, the only trained weights,
    are in model.dtype (float32), so no update is lost (docs/LORA.md)."""

    @property
    def enabled(self) -> bool:
        return self.r > 0

    def base_dtype_for(self, master: str, precision: str | int) -> str:
        if self.base_dtype != "compute":
            return self.base_dtype
        return compute_dtype(precision) or master


TASKS = ("arithmetic", "precedence")


class WarmStartConfig(Settings):
    """How the tiny model is warm-started (every field is part of the cache key). The defaults
    are the recipe measured in docs/WARMSTART.md; lr matters most (1.5e-3 and above stall)."""

    steps: PositiveInt = 1000
    """Supervised steps."""
    batch_size: PositiveInt = 16
    """Sequences per step."""
    lr: Positive = 1e-3
    """Peak learning rate (1.5e-3 and above stall)."""
    warmup_steps: Count = 20
    """Linear warm-up steps."""
    weight_decay: Annotated[Finite, Field(ge=0), must("a number >= 0")] = 0.0
    """AdamW weight decay (not on norms and biases)."""
    min_lr_ratio: Annotated[Finite, Field(ge=0, le=1), must("a number in [0, 1]")] = 0.1
    """Cosine decay from lr to lr * min_lr_ratio."""
    grad_clip: Annotated[Finite, Field(ge=0), must("a number >= 0")] = 1.0
    """Gradient-norm clip; 0: none."""
    level: PositiveInt = 1
    """The arithmetic generator's level (task=arithmetic)."""
    num_examples: PositiveInt = 20000
    """Worked solutions generated to learn from."""
    seed: Seed = 0
    """Its seed (data, initialisation, batch order)."""
    system_prompt: nullable(Text) = QWEN_MATH_SYSTEM_PROMPT
    """The prompt's system turn (the Qwen-Math template)."""
    max_length: PositiveInt = 320
    """Training sequences (prompt + solution) longer than this are dropped."""
    eval_examples: PositiveInt = 128
    """Val problems for the final sampled / greedy accuracy."""
    eval_max_new_tokens: PositiveInt = 96
    """Tokens a response may have in that evaluation."""
    task: one_of(TASKS) = "arithmetic"
    """The problems it learns from: arithmetic (generate_arithmetic at level) or precedence (the
    study task: generate_precedence_mix with task_options, which holds its levels shares,
    shortcut_rate and trap_fraction; level is unused)."""
    task_options: dict[str, Any] = {}
    """The task generator's options (task=precedence: levels, shortcut_rate, trap_fraction, wrong_routes)."""


class ModelConfig(Settings):
    """The policy. The master weights (and AdamW's states) stay float32 by default;
    ``trainer.precision=bf16-mixed`` computes in bf16 over them."""

    name_or_path: nullable(Text) = None
    """A hub name or a local directory with the weights; null: the tiny preset."""
    tokenizer: nullable(Text) = None
    """A tokenizer name or path; 'char': the tiny preset's character tokenizer; null: the model's own."""
    dtype: ModelDtype = "float32"
    """The master weights' dtype (with LoRA the adapters'; the frozen base's is lora.base_dtype).
    bfloat16 trains in pure bf16, which loses most updates at lr 1e-6 (docs/GPU.md): refused
    unless allow_16bit_weights is true."""
    allow_16bit_weights: Flag = False
    """Pure 16-bit training, asked for by name."""
    attn_implementation: nullable(Text) = None
    """transformers' attention kernel (sdpa, flash_attention_2, eager); null: its default."""
    gradient_checkpointing: Flag = False
    """Recompute each decoder layer's activations in the backward."""
    trust_remote_code: Flag = False
    """Let transformers run the checkpoint's own model code."""
    random_init: Flag = False
    """True: architecture at shape with random weights (smoke runs: benchmarks/gpu_check.py)."""
    architecture: nullable(Text) = None
    """The model type (qwen2, qwen3, llama): tests and random_init build a small random model of it."""
    shape: dict[str, Any] | None = None
    """The checkpoint's config.json numbers, for medsrl-plan without the weights and for random
    models of this architecture (a local name_or_path's config.json wins in the plan)."""
    tiny: dict[str, Any] | None = None
    """The tiny preset's Qwen2 config (hidden_size, num_hidden_layers, ...)."""
    warm_start: WarmStartConfig | None = None
    """The tiny preset's supervised warm start (cached under paths.cache_dir); null: none."""
    lora: LoraSettings = Field(default_factory=LoraSettings)

    def weights_dtype(self, precision: str | int) -> str:
        """The dtype the policy's weights load in: with LoRA the frozen base's."""
        return self.lora.base_dtype_for(self.dtype, precision) if self.lora.enabled else self.dtype
