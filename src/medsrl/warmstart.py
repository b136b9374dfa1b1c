"""Supervised warm start of the tiny preset on worked solutions, cached on disk: a random tiny model
earns no reward, so RL would have no signal. Measured with RL validation's own sampler and grader.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from filelock import FileLock
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader

import medsrl
from medsrl.data.arithmetic import GENERATOR_VERSION, generate_arithmetic
from medsrl.data.example import MathExample
from medsrl.data.template import IM_END, render_prompt
from medsrl.models.char_tokenizer import build_char_tokenizer, char_vocab
from medsrl.models.settings import ModelConfig, WarmStartConfig
from medsrl.models.tiny import build_tiny_model, tiny_qwen2_config

log = logging.getLogger(__name__)

# Bump when the training recipe changes in a way the config does not capture.
WARMSTART_VERSION = 2
PAD_ID = 0
EOS_ID = 2
IGNORE = -100
# Shared prompt prefixes shorter than this are not worth a separate forward pass.
_MIN_SHARED_PREFIX = 16


def task_examples(ws: WarmStartConfig, num: int, split: str) -> list[MathExample]:
    """The warm start's problems (with worked solutions) of one split."""
    if ws.task == "arithmetic":
        return generate_arithmetic(num, level=ws.level, seed=ws.seed, split=split, **ws.task_options)
    from medsrl.data.precedence import generate_precedence_mix  # task=precedence, the schema's other

    options = dict(ws.task_options)
    if split != "train":  # the planted shortcut is a habit of the corpus, not of the answers
        options.pop("shortcut_rate", None)
    return generate_precedence_mix(num, seed=ws.seed, split=split, **options)


def warm_start_key(model_config: dict, ws: WarmStartConfig) -> str:
    resolved = tiny_qwen2_config(**model_config).to_dict()
    resolved.pop("transformers_version", None)
    payload = {
        "model": resolved, "warm_start": ws.model_dump(), "medsrl": medsrl.__version__,
        "generator": GENERATOR_VERSION, "warmstart": WARMSTART_VERSION,
        "template": render_prompt("{problem}", system_prompt=ws.system_prompt),
        "tokenizer": char_vocab(),  # the saved tokenizer must match the code's
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def warm_start_dir(cache_root: str | Path, model_config: dict, ws: WarmStartConfig) -> Path:
    return Path(cache_root) / warm_start_key(model_config, ws)[:12]


def _is_complete(path: Path) -> bool:
    return (path / "metrics.json").is_file() and (path / "config.json").is_file()


def ensure_warm_start(cache_root: str | Path, model_config: dict, ws: WarmStartConfig, *,
                      log_every: int = 50, num_threads: int | None = None) -> Path:
    """The cache entry (model, char tokenizer, ``metrics.json``), trained if missing: one writer at a
    time (a ``FileLock`` the OS releases when a writer dies), built in a temp dir moved into place."""
    target = warm_start_dir(cache_root, model_config, ws)
    if _is_complete(target):  # no lock needed: entries only ever appear complete
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if not _is_complete(target):  # else another writer built it while we waited
            _remove_leftovers(target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            try:
                _build(tmp, model_config, ws, log_every, num_threads)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def warm_started(model: ModelConfig, cache_dir: str | Path) -> ModelConfig:
    """``model`` pointed at the warm-started tiny preset when it names no model and sets ``warm_start``."""
    if model.name_or_path is not None or model.warm_start is None:
        return model
    path = ensure_warm_start(cache_dir, dict(model.tiny or {}), model.warm_start)
    log.info("tiny preset: warm-started policy at %s", path)
    return model.model_copy(update={"name_or_path": str(path)})


def _remove_leftovers(target: Path) -> None:
    """Under the lock no other writer runs: temp dirs and incomplete entries are a crash's."""
    for path in [target, *target.parent.glob(f".{target.name}.tmp-*")]:
        if path.exists():
            log.warning("warm start: removing %s left by a crashed writer", path)
            shutil.rmtree(path)


@dataclass
class Encoded:
    """A shared prompt prefix (may be empty), then per example its suffix and first response token."""

    prefix: list[int]
    suffixes: list[list[int]]
    response_starts: list[int]


def encode_examples(tokenizer, examples: list[MathExample], system_prompt: str | None,
                    max_length: int) -> Encoded:
    """Tokenise ``render_prompt(problem) + solution + <|im_end|>`` and split off the shared prefix."""
    prompts = [render_prompt(ex.problem, system_prompt=system_prompt) for ex in examples]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    responses = tokenizer([ex.solution + IM_END for ex in examples], add_special_tokens=False)
    pairs = [(p, r) for p, r in zip(prompt_ids, responses["input_ids"], strict=True)
             if len(p) + len(r) <= max_length]
    if len(pairs) < len(examples):
        log.warning("warm start: dropped %d of %d examples longer than max_length=%d",
                    len(examples) - len(pairs), len(examples), max_length)
    if not pairs:
        raise ValueError(f"no training example fits in max_length={max_length}")
    common = os.path.commonprefix([p for p, _ in pairs])
    shared = min(len(common), min(len(p) for p, _ in pairs) - 1)  # >= 1 prompt token per suffix
    shared = shared if shared >= _MIN_SHARED_PREFIX else 0
    return Encoded(list(common[:shared]), [p[shared:] + r for p, r in pairs],
                   [len(p) - shared for p, _ in pairs])


def collate(enc: Encoded, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded suffix ids and labels (-100 on prompt tokens and padding)."""
    width = max(len(enc.suffixes[i]) for i in indices)
    ids = torch.full((len(indices), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(indices), width), IGNORE, dtype=torch.long)
    for row, i in enumerate(indices):
        seq = enc.suffixes[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        start = enc.response_starts[i]
        labels[row, start : len(seq)] = torch.tensor(seq[start:])
    return ids, labels


def sequence_loss(model, prefix: torch.Tensor | None, ids: torch.Tensor, labels: torch.Tensor):
    """Mean next-token cross entropy on the labelled tokens; the shared ``prefix`` (1, P) runs once,
    its KV cache repeated over the batch: the full sequences' loss at about half the cost."""
    batch, width = ids.shape
    if prefix is not None and prefix.shape[1] > 0:
        p = prefix.shape[1]
        cache = model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(batch)
        position_ids = torch.arange(p, p + width).unsqueeze(0).expand(batch, -1)
        logits = model(input_ids=ids, past_key_values=cache, position_ids=position_ids).logits
    else:
        logits = model(input_ids=ids, use_cache=False).logits
    # Token t predicts token t + 1; the first suffix token is never a response token.
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=IGNORE)


def lr_factor(step: int, ws: WarmStartConfig) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``ws.steps``."""
    if ws.warmup_steps > 0 and step < ws.warmup_steps:
        return (step + 1) / ws.warmup_steps
    span = max(1, ws.steps - ws.warmup_steps)
    progress = min(1.0, (step - ws.warmup_steps) / span)
    return ws.min_lr_ratio + (1 - ws.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class SupervisedWarmStart(L.LightningModule):
    """Teacher forcing on the response tokens; keeps the loss curve ``metrics.json`` reports."""

    def __init__(self, model, enc: Encoded, ws: WarmStartConfig, log_every: int = 50) -> None:
        super().__init__()
        self.model = model
        self.prefix = torch.tensor([enc.prefix], dtype=torch.long) if enc.prefix else None
        self.ws, self.log_every = ws, log_every
        self.curve: list[dict] = []
        self._window: list[float] = []
        self._lr = ws.lr
        self._t0 = time.perf_counter()

    def training_step(self, batch, batch_idx):
        self._lr = self.trainer.optimizers[0].param_groups[0]["lr"]  # before the scheduler moves it
        return sequence_loss(self.model, self.prefix, *batch)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._window.append(float(outputs["loss"]))
        step = self.global_step
        if step % self.log_every == 0 or step == self.ws.steps:
            loss = sum(self._window) / len(self._window)
            elapsed = round(time.perf_counter() - self._t0, 2)
            self.curve.append({"step": step, "loss": loss, "lr": self._lr, "elapsed_s": elapsed})
            self._window = []
            log.info("warm start step %d/%d loss %.4f lr %.2e (%.0fs)",
                     step, self.ws.steps, loss, self._lr, elapsed)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Clip in the model's parameter order: Lightning's rounds differently, changing the run."""
        if self.ws.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.ws.grad_clip)

    def configure_optimizers(self):
        """AdamW (no decay on norms and biases), linear warm-up then cosine, stepped per step."""
        named = list(self.model.named_parameters())
        decay = {n for n, p in named if p.ndim >= 2 and "norm" not in n}
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.ws.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.ws.lr, betas=(0.9, 0.98))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_factor, ws=self.ws))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def train_model(model, enc: Encoded, ws: WarmStartConfig, *, log_every: int = 50) -> list[dict]:
    """Train ``model`` for ``ws.steps`` steps; the loss curve (mean loss, lr, seconds per ``log_every``)."""
    loader = DataLoader(range(len(enc.suffixes)), batch_sampler=batch_indices(len(enc.suffixes), ws),
                        collate_fn=functools.partial(collate, enc))
    module = SupervisedWarmStart(model, enc, ws, log_every)
    with _quiet_lightning():
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=ws.steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, loader)
    model.eval()
    return module.curve


def batch_indices(n: int, ws: WarmStartConfig) -> list[list[int]]:
    """``ws.steps`` batches of back-to-back shuffled epochs: the order the recipe was measured with."""
    gen = torch.Generator().manual_seed(ws.seed)
    epochs = -(-ws.steps * ws.batch_size // n)
    order = torch.cat([torch.randperm(n, generator=gen) for _ in range(epochs)]).tolist()
    return [order[i : i + ws.batch_size] for i in range(0, ws.steps * ws.batch_size, ws.batch_size)]


@contextlib.contextmanager
def _quiet_lightning():
    """No device banners or "few dataloader workers" hints: the RL run prints its own."""
    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PossibleUserWarning)
            yield
    finally:
        logger.setLevel(level)


def evaluate(model, tokenizer, ws: WarmStartConfig) -> dict[str, Any]:
    """Sampled (T=1) and greedy accuracy on ``ws.eval_examples`` val problems, as RL validation measures."""
    from medsrl.evaluation.responses import SamplingSpec, problems_from, sample_problems
    from medsrl.reward.grader import MathGrader
    from medsrl.rollout.hf import HFRolloutEngine

    examples = task_examples(ws, ws.eval_examples, "val")
    problems = problems_from(examples, {"system_prompt": ws.system_prompt})
    engine = HFRolloutEngine(model, tokenizer, max_batch_size=128)
    result: dict[str, Any] = {"eval_examples": len(problems)}
    with MathGrader(num_workers=1) as grader:  # its worker starts only if an answer needs sympy
        for name, temperature in (("sampled", 1.0), ("greedy", 0.0)):
            settings = SamplingSpec(n=1, temperature=temperature, max_new_tokens=ws.eval_max_new_tokens,
                                    seed=ws.seed + 1, batch_size=128, features=None)
            t0 = time.perf_counter()
            records = sample_problems(model, tokenizer, engine, grader, problems, settings)
            result.update(_summary(name, records, time.perf_counter() - t0))
    return result


def _summary(name: str, records: list[dict], seconds: float) -> dict[str, Any]:
    """One decoding mode's accuracy, response length, time and first few responses."""
    texts = [rec["responses"][0]["text"] for rec in records]
    correct = sum(rec["responses"][0]["score"] for rec in records)
    examples = [{"problem": rec["problem"], "answer": rec["gold"], "response": text}
                for rec, text in list(zip(records, texts, strict=True))[:4]]
    return {f"val_{name}_accuracy": correct / max(1, len(records)),
            f"{name}_mean_response_chars": sum(map(len, texts)) / max(1, len(texts)),
            f"{name}_generate_s": round(seconds, 2), f"{name}_examples": examples}


def _build(out_dir: Path, model_config: dict, ws: WarmStartConfig, log_every: int,
           num_threads: int | None) -> None:
    """Train, evaluate and save into ``out_dir``; ``metrics.json`` last: it marks completion."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    previous_threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(num_threads or cores or 1)
    try:
        tokenizer = build_char_tokenizer()
        enc = encode_examples(tokenizer, task_examples(ws, ws.num_examples, "train"),
                              ws.system_prompt, ws.max_length)
        model = build_tiny_model(seed=ws.seed, **model_config)
        num_params = sum(p.numel() for p in model.parameters())
        log.info("warm start: %d params, %d examples (%s %s), %d steps x %d -> %s", num_params,
                 len(enc.suffixes), ws.task, ws.task_options or f"level {ws.level}", ws.steps,
                 ws.batch_size, out_dir)
        curve = train_model(model, enc, ws, log_every=log_every)
        train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        ev = evaluate(model, tokenizer, ws)
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    final_loss = curve[-1]["loss"] if curve else None
    log.info("warm start done: loss %s, val sampled acc %.3f, greedy acc %.3f (%.0fs)", final_loss,
             ev["val_sampled_accuracy"], ev["val_greedy_accuracy"], time.perf_counter() - t0)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    built_from = {"warm_start": ws.model_dump(), "model_config": model_config,
                  "key": warm_start_key(model_config, ws)}
    (out_dir / "warmstart.json").write_text(json.dumps(built_from, indent=2))
    metrics = {
        "loss_curve": curve, "final_loss": final_loss, **ev,
        "train_wall_s": round(train_s, 2), "train_cpu_s": round(train_cpu_s, 2),
        "wall_s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - cpu0, 2),
        "num_threads": threads, "num_params": num_params, "train_examples": len(enc.suffixes),
        "shared_prefix_tokens": len(enc.prefix),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
