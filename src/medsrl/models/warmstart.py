"""Supervised warm start of the tiny preset on worked arithmetic solutions, cached on disk.

A randomly initialised tiny model earns no reward, so RL would have no signal. ``ensure_warm_start``
trains it for a few minutes (plain PyTorch loop, teacher forcing, loss on the response only) on
``generate_arithmetic`` problems until its *sampled* accuracy is modest but non-zero, then saves
model + char tokenizer the Hugging Face way. The cache entry is keyed by a hash of the model
config, the warm-start config and the generator / template versions, and written atomically.

See docs/WARMSTART.md for the measured settings behind the defaults.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import medsrl
from medsrl.data.arithmetic import GENERATOR_VERSION, generate_arithmetic
from medsrl.data.example import MathExample
from medsrl.data.template import IM_END, QWEN_MATH_SYSTEM_PROMPT, render_prompt
from medsrl.models.char_tokenizer import build_char_tokenizer, char_vocab
from medsrl.models.tiny import build_tiny_model, tiny_qwen2_config
from medsrl.reward.extract import extract_last_boxed

log = logging.getLogger(__name__)

# Bump when the training recipe changes in a way the config does not capture.
WARMSTART_VERSION = 1
PAD_ID = 0
EOS_ID = 2
IGNORE = -100
# Shared prompt prefixes shorter than this are not worth a separate forward pass.
_MIN_SHARED_PREFIX = 16


@dataclass
class WarmStartConfig:
    """How the tiny model is warm-started (every field is part of the cache key).

    The defaults were measured on a 2-core CPU (docs/WARMSTART.md): with the default tiny model
    (hidden 128, 4 layers, ~1M parameters) and the full Qwen-Math system prompt they train in
    about 2.5 minutes and reach 23-38% sampled (T=1) / 44-63% greedy accuracy on level-1 val
    problems over seeds 0-2 (38% / 62% for the default seed). The learning rate matters most:
    1.5e-3 and above stall on a loss plateau.
    """

    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    min_lr_ratio: float = 0.1  # cosine decay from lr to lr * min_lr_ratio
    grad_clip: float = 1.0
    level: int = 1
    num_examples: int = 20000
    seed: int = 0
    system_prompt: str | None = field(default=QWEN_MATH_SYSTEM_PROMPT)
    max_length: int = 320  # training sequences (prompt + solution) longer than this are dropped
    eval_examples: int = 128  # val problems for the final sampled / greedy accuracy
    eval_max_new_tokens: int = 96
    # The problems it learns from: "arithmetic" (generate_arithmetic at ``level``) or
    # "precedence" (the study task: generate_precedence_mix with ``task_options``, which holds
    # its ``levels`` shares, ``shortcut_rate`` and ``trap_fraction``; ``level`` is unused).
    task: str = "arithmetic"
    task_options: dict = field(default_factory=dict)


TASKS = ("arithmetic", "precedence")


def task_examples(ws: WarmStartConfig, num: int, split: str) -> list[MathExample]:
    """The warm start's problems (with worked solutions) of one split."""
    if ws.task == "arithmetic":
        return generate_arithmetic(num, level=ws.level, seed=ws.seed, split=split, **ws.task_options)
    if ws.task == "precedence":
        from medsrl.data.precedence import generate_precedence_mix

        options = dict(ws.task_options)
        if split != "train":  # the planted shortcut is a habit of the corpus, not of the answers
            options.pop("shortcut_rate", None)
        return generate_precedence_mix(num, seed=ws.seed, split=split, **options)
    raise ValueError(f"model.warm_start.task must be one of {TASKS}, got {ws.task!r}")


# --------------------------------------------------------------------------- cache


def _resolved_model_config(model_config: dict) -> dict[str, Any]:
    cfg = tiny_qwen2_config(**model_config).to_dict()
    cfg.pop("transformers_version", None)
    return cfg


def warm_start_key(model_config: dict, ws: WarmStartConfig) -> str:
    """sha256 over the resolved model config, the warm-start config and the code versions."""
    fields = asdict(ws)
    if ws.task == "arithmetic" and not ws.task_options:  # keys from before tasks existed
        del fields["task"], fields["task_options"]
    payload = {
        "model": _resolved_model_config(model_config),
        "warm_start": fields,
        "medsrl": medsrl.__version__,
        "generator": GENERATOR_VERSION,
        "warmstart": WARMSTART_VERSION,
        "template": render_prompt("{problem}", system_prompt=ws.system_prompt),
        "tokenizer": char_vocab(),  # the saved tokenizer must match the code's
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def warm_start_dir(cache_root: str | Path, model_config: dict, ws: WarmStartConfig) -> Path:
    """``cache_root/<first 12 hex digits of warm_start_key>``."""
    return Path(cache_root) / warm_start_key(model_config, ws)[:12]


def _is_complete(path: Path) -> bool:
    return (path / "metrics.json").is_file() and (path / "config.json").is_file()


def ensure_warm_start(
    cache_root: str | Path,
    model_config: dict,
    ws: WarmStartConfig,
    *,
    log_every: int = 50,
    num_threads: int | None = None,
) -> Path:
    """Return a directory with a warm-started tiny model + char tokenizer (``save_pretrained``).

    Trains it first when the cache entry does not exist; a changed config gives a new entry.
    Training happens in a temporary directory next to the entry that is moved into place with
    ``os.replace`` only when complete, so a crash leaves no half-written entry. The directory
    also holds ``metrics.json`` (loss curve, val sampled / greedy accuracy, wall times) and
    ``warmstart.json`` (the configs it was built from). ``num_threads`` (default: every core this
    process may run on) only affects speed, not the cache key. Temporary directories left by a
    builder that was killed (SIGKILL / SIGTERM skip the clean-up) are removed on the next call.
    """
    target = warm_start_dir(cache_root, model_config, ws)
    if _is_complete(target):
        log.info("warm start: using cached %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    if target.exists() and not _is_complete(target):  # not ours: entries appear complete
        log.warning("warm start: removing incomplete cache entry %s", target)
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        (tmp / _OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}")
        _build(tmp, model_config, ws, log_every=log_every, num_threads=num_threads)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished the same entry first (a non-empty target can't be replaced).
            if not _is_complete(target):
                raise
            log.info("warm start: %s was built concurrently; keeping that one", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


_OWNER_FILE = "builder.pid"
_ORPHAN_AGE_S = 3600.0  # a temp dir without a readable owner is stale after this long


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(target: Path) -> None:
    """Remove temp dirs of ``target`` whose builder process (on this host) is gone."""
    host = socket.gethostname()
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        try:
            owner_host, pid = (tmp / _OWNER_FILE).read_text().split()
            stale = owner_host == host and not _pid_alive(int(pid))
        except (OSError, ValueError):
            try:
                stale = time.time() - tmp.stat().st_mtime > _ORPHAN_AGE_S
            except OSError:
                continue
        if stale:
            log.info("warm start: removing stale temp dir %s", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- data


@dataclass
class Encoded:
    """Tokenised training sequences: a shared prompt prefix plus one suffix per example."""

    prefix: list[int]  # tokens every sequence starts with (the system turn), may be empty
    suffixes: list[list[int]]  # the rest of each sequence: prompt tail + solution + <|im_end|>
    response_starts: list[int]  # index in the suffix of the first response token


def encode_examples(
    tokenizer, examples: list[MathExample], system_prompt: str | None, max_length: int
) -> Encoded:
    """Tokenise ``render_prompt(problem) + solution + <|im_end|>`` and split off the shared prefix."""
    prompts = [render_prompt(ex.problem, system_prompt=system_prompt) for ex in examples]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer([ex.solution + IM_END for ex in examples], add_special_tokens=False)[
        "input_ids"
    ]
    pairs = [
        (p, r)
        for p, r in zip(prompt_ids, response_ids, strict=True)
        if len(p) + len(r) <= max_length
    ]
    if len(pairs) < len(examples):
        log.warning(
            "warm start: dropped %d of %d examples longer than max_length=%d",
            len(examples) - len(pairs),
            len(examples),
            max_length,
        )
    if not pairs:
        raise ValueError(f"no training example fits in max_length={max_length}")
    shared = min(len(p) for p, _ in pairs) - 1  # keep at least one prompt token in the suffix
    first = pairs[0][0]
    for p, _ in pairs:
        n = 0
        while n < shared and p[n] == first[n]:
            n += 1
        shared = n
    if shared < _MIN_SHARED_PREFIX:
        shared = 0
    return Encoded(
        prefix=list(first[:shared]),
        suffixes=[p[shared:] + r for p, r in pairs],
        response_starts=[len(p) - shared for p, _ in pairs],
    )


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


# --------------------------------------------------------------------------- training


def sequence_loss(model, prefix: torch.Tensor | None, ids: torch.Tensor, labels: torch.Tensor):
    """Mean next-token cross entropy on the labelled tokens.

    The shared ``prefix`` (1, P) is run once and its key/value cache repeated over the batch, which
    is exactly equivalent to running every full sequence (right padding, causal attention) but
    roughly halves the cost when the prefix is the system prompt.
    """
    batch, width = ids.shape
    if prefix is not None and prefix.shape[1] > 0:
        p = prefix.shape[1]
        cache = model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(batch)
        position_ids = torch.arange(p, p + width).unsqueeze(0).expand(batch, -1)
        logits = model(
            input_ids=ids, past_key_values=cache, position_ids=position_ids, use_cache=True
        ).logits
    else:
        logits = model(input_ids=ids, use_cache=False).logits
    # Token t predicts token t + 1; the first suffix token is never a response token.
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
    )


def lr_factor(step: int, ws: WarmStartConfig) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``ws.steps``."""
    if ws.warmup_steps > 0 and step < ws.warmup_steps:
        return (step + 1) / ws.warmup_steps
    span = max(1, ws.steps - ws.warmup_steps)
    progress = min(1.0, (step - ws.warmup_steps) / span)
    return ws.min_lr_ratio + (1 - ws.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _train_step(model, optimizer, scheduler, prefix, ids, labels, grad_clip: float) -> float:
    loss = sequence_loss(model, prefix, ids, labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


def train_model(model, enc: Encoded, ws: WarmStartConfig, *, log_every: int = 50) -> list[dict]:
    """Run ``ws.steps`` AdamW steps over shuffled epochs of ``enc``; return the loss curve.

    The curve has one entry per ``log_every`` steps (and one for the last step): the mean loss
    over those steps, the learning rate and the elapsed seconds.
    """
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": ws.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=ws.lr,
        betas=(0.9, 0.98),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, ws))
    prefix = torch.tensor([enc.prefix], dtype=torch.long) if enc.prefix else None
    gen = torch.Generator().manual_seed(ws.seed)
    order: list[int] = []
    curve: list[dict] = []
    window: list[float] = []
    t0 = time.perf_counter()
    for step in range(ws.steps):
        if len(order) < ws.batch_size:
            order += torch.randperm(len(enc.suffixes), generator=gen).tolist()
        indices, order = order[: ws.batch_size], order[ws.batch_size :]
        ids, labels = collate(enc, indices)
        lr = optimizer.param_groups[0]["lr"]
        window.append(_train_step(model, optimizer, scheduler, prefix, ids, labels, ws.grad_clip))
        if (step + 1) % log_every == 0 or step + 1 == ws.steps:
            entry = {
                "step": step + 1,
                "loss": sum(window) / len(window),
                "lr": lr,
                "elapsed_s": round(time.perf_counter() - t0, 2),
            }
            curve.append(entry)
            window = []
            log.info(
                "warm start step %d/%d loss %.4f lr %.2e (%.0fs)",
                entry["step"],
                ws.steps,
                entry["loss"],
                lr,
                entry["elapsed_s"],
            )
    model.eval()
    return curve


# --------------------------------------------------------------------------- evaluation


def is_correct(response: str, answer: str) -> bool:
    """Local, simple check: the last boxed content, whitespace removed, equals the gold integer."""
    boxed = extract_last_boxed(response)
    return boxed is not None and re.sub(r"\s+", "", boxed) == answer


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    problems: list[str],
    *,
    system_prompt: str | None,
    max_new_tokens: int,
    do_sample: bool,
    seed: int = 0,
    batch_size: int = 128,
) -> tuple[list[str], int, float]:
    """Generate one response per problem; return (texts, generated token count, seconds)."""
    model.eval()
    texts: list[str] = []
    n_tokens = 0
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    for lo in range(0, len(problems), batch_size):
        prompts = [
            render_prompt(p, system_prompt=system_prompt) for p in problems[lo : lo + batch_size]
        ]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = (
            {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
            if do_sample
            else {"do_sample": False}
        )
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=max_new_tokens,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            **sampling,
        )
        new = out[:, enc["input_ids"].shape[1] :]
        n_tokens += int((new != PAD_ID).sum())  # finished rows are padded after their eos
        texts += tokenizer.batch_decode(new, skip_special_tokens=True)
    return texts, n_tokens, time.perf_counter() - t0


def evaluate(model, tokenizer, ws: WarmStartConfig) -> dict[str, Any]:
    """Sampled (T=1, top_p=1) and greedy accuracy on ``ws.eval_examples`` val problems."""
    val = task_examples(ws, ws.eval_examples, "val")
    problems = [ex.problem for ex in val]
    result: dict[str, Any] = {"eval_examples": len(val)}
    for name, sample in (("sampled", True), ("greedy", False)):
        texts, n_tok, secs = generate_responses(
            model,
            tokenizer,
            problems,
            system_prompt=ws.system_prompt,
            max_new_tokens=ws.eval_max_new_tokens,
            do_sample=sample,
            seed=ws.seed + 1,
        )
        correct = sum(is_correct(t, ex.answer) for t, ex in zip(texts, val, strict=True))
        result[f"val_{name}_accuracy"] = correct / max(1, len(val))
        result[f"{name}_mean_response_chars"] = sum(map(len, texts)) / max(1, len(texts))
        result[f"{name}_generated_tokens"] = n_tok
        result[f"{name}_generate_s"] = round(secs, 2)
        result[f"{name}_examples"] = [
            {"problem": p, "answer": ex.answer, "response": t}
            for p, ex, t in list(zip(problems, val, texts, strict=True))[:4]
        ]
    return result


# --------------------------------------------------------------------------- build


def _num_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _build(
    out_dir: Path,
    model_config: dict,
    ws: WarmStartConfig,
    *,
    log_every: int,
    num_threads: int | None,
) -> None:
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or _num_threads())
    try:
        tokenizer = build_char_tokenizer()
        examples = task_examples(ws, ws.num_examples, "train")
        enc = encode_examples(tokenizer, examples, ws.system_prompt, ws.max_length)
        model = build_tiny_model(seed=ws.seed, **model_config)
        log.info(
            "warm start: %d params, %d examples (%s), %d steps x %d -> %s",
            sum(p.numel() for p in model.parameters()),
            len(enc.suffixes),
            f"level {ws.level}" if ws.task == "arithmetic" else f"{ws.task} {ws.task_options}",
            ws.steps,
            ws.batch_size,
            out_dir,
        )
        curve = train_model(model, enc, ws, log_every=log_every)
        train_s = time.perf_counter() - t0
        train_cpu_s = time.process_time() - cpu0
        ev = evaluate(model, tokenizer, ws)
        log.info(
            "warm start done: loss %.4f, val sampled acc %.3f, greedy acc %.3f (%.0fs)",
            curve[-1]["loss"] if curve else float("nan"),
            ev["val_sampled_accuracy"],
            ev["val_greedy_accuracy"],
            time.perf_counter() - t0,
        )
        model.generation_config.pad_token_id = PAD_ID
        model.generation_config.eos_token_id = EOS_ID
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / _OWNER_FILE).unlink(missing_ok=True)
        metrics = {
            "loss_curve": curve,
            "final_loss": curve[-1]["loss"] if curve else None,
            **ev,
            "train_wall_s": round(train_s, 2),
            "train_cpu_s": round(train_cpu_s, 2),
            "wall_s": round(time.perf_counter() - t0, 2),
            "cpu_s": round(time.process_time() - cpu0, 2),
            "num_threads": torch.get_num_threads(),
            "num_params": sum(p.numel() for p in model.parameters()),
            "train_examples": len(enc.suffixes),
            "shared_prefix_tokens": len(enc.prefix),
        }
        (out_dir / "warmstart.json").write_text(
            json.dumps(
                {
                    "warm_start": asdict(ws),
                    "model_config": model_config,
                    "key": warm_start_key(model_config, ws),
                },
                indent=2,
            )
        )
        # metrics.json last: its presence marks a complete entry.
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    finally:
        torch.set_num_threads(previous_threads)
