"""Staged, stateless prompt schedule for RL training.

The prompts of step ``s`` are a pure function of ``(seed, s)``: in the stage whose ``start_step`` is
the largest ``<= s``, dataset ``d`` with quota ``q_d`` (largest remainder of the weights) gives items
``k*q_d ... k*q_d + q_d - 1`` (``k = s - start_step``) of its per-epoch permutations, seeded by
``(seed, stage, dataset, epoch)``. No iterator state to save: a resume at ``trainer.global_step``
repeats the run. Prompts too long for the engine are dropped once, before any permutation is drawn.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import lightning
import numpy as np

from medsrl.data.example import MathExample, Prompt, prompt_key
from medsrl.data.settings import DataConfig, Dataset, Source, Stage

__all__ = ["MathDataModule", "PromptDrop", "largest_remainder_quotas", "prompt_token_counts"]

log = logging.getLogger(__name__)

ExampleSource = Sequence[MathExample] | Callable[[], Sequence[MathExample]]

PROMPT_TOKEN_BATCH = 1024  # prompts per tokenizer call when counting: bounded memory, fast-tokenizer batches
LIMIT_SETTINGS = "rollout.max_prompt_tokens / rollout.max_new_tokens / rollout.vllm.max_model_len"


def describe_source(source: Any) -> str:
    """Where a dataset's examples come from (a loader and its arguments), for an error message."""
    if isinstance(source, functools.partial):
        args = [repr(a) for a in source.args] + [f"{k}={v!r}" for k, v in source.keywords.items()]
        return f"{describe_source(source.func)}({', '.join(args)})"
    if callable(source) and hasattr(source, "__qualname__"):
        return f"{getattr(source, '__module__', '?')}.{source.__qualname__}"
    return f"its source (a {type(source).__name__})"


def _as_example(item: Any, dataset: str, i: int) -> MathExample:
    if isinstance(item, MathExample):
        return item
    if isinstance(item, Mapping):  # e.g. an OmegaConf node from Hydra
        d = {"source": dataset, "row": i, **item}
        if "key" not in d and "problem" in d:
            d["key"] = prompt_key(str(d["problem"]))
        try:
            return MathExample(**d)
        except TypeError as e:
            raise ValueError(f"dataset {dataset!r} item {i}: not a MathExample: {e}") from e
    raise ValueError(f"dataset {dataset!r} item {i}: expected a MathExample, got {type(item).__name__}")


def _source(d: Dataset) -> ExampleSource:
    """A dataset's examples, or a zero-arg callable returning them (a ``_target_`` built by Hydra)."""
    if isinstance(d.source, Source):
        from hydra.utils import instantiate

        return instantiate(d.source.model_dump(exclude_unset=True), _convert_="object")
    return d.source


def largest_remainder_quotas(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` slots in proportion to ``weights`` (largest remainder, ties to the earlier
    dataset); every positive weight gets at least one slot when ``total >= len(weights)``."""
    wsum = float(sum(weights))
    exact = [w / wsum * total for w in weights]
    quotas = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[: total - sum(quotas)]:
        quotas[i] += 1
    if total >= len(weights):
        for i in range(len(quotas)):
            if quotas[i] == 0:
                # take a slot from the dataset with the most slots above its exact share
                donor = max(
                    (j for j in range(len(quotas)) if quotas[j] > 1),
                    key=lambda j: (quotas[j] - exact[j], quotas[j], -j),
                )
                quotas[donor] -= 1
                quotas[i] += 1
    return quotas


def _seed_int(*parts: object) -> int:
    h = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "little")


@lru_cache(maxsize=64)
def _permutation(n: int, *seed_parts: object) -> np.ndarray:
    perm = np.random.default_rng(_seed_int(*seed_parts)).permutation(n)
    perm.setflags(write=False)
    return perm


def prompt_token_counts(tokenizer, texts: Sequence[str], batch_size: int = PROMPT_TOKEN_BATCH) -> list[int]:
    """Each text's token count as the rollout engines count it (``tokenizer(texts)["input_ids"]``,
    default special tokens: rollout/base.py ``tokenize_prompts``), a batch at a time."""
    counts: list[int] = []
    for i in range(0, len(texts), batch_size):
        counts.extend(len(ids) for ids in tokenizer(list(texts[i : i + batch_size]))["input_ids"])
    return counts


@dataclass(frozen=True)
class PromptDrop:
    """What :meth:`MathDataModule.limit_prompt_tokens` left out of one dataset."""

    where: str  # "stage 'B' dataset 'dapo_math_17k'" or "val dataset 'aime24'"
    dataset: str
    dropped: int
    total: int
    longest_kept: int  # tokens; 0 when nothing is kept

    @property
    def share(self) -> float:
        return self.dropped / self.total if self.total else 0.0

    def describe(self, limit: int) -> str:
        return (f"{self.where}: {self.dropped} of {self.total} prompts ({self.share:.2%}) longer than "
                f"{limit} tokens")


class _TrainSteps:
    """Infinite iterable of ``{"step", "stage", "prompts"}`` from the trainer's ``global_step`` (read
    when iteration starts: a resumed run continues exactly). Not a list: Lightning reads one as several loaders."""

    def __init__(self, dm: MathDataModule):
        self.dm = dm

    def __iter__(self) -> Iterator[dict[str, Any]]:
        step = int(getattr(self.dm.trainer, "global_step", 0) or 0)
        previous: str | None = None
        while True:
            stage = self.dm.stage_at(step)
            if stage.name != previous:
                if previous is None:
                    log.info("data: stage %s at step %d", stage.name, step)
                else:
                    log.info("stage switch %s -> %s at step %d", previous, stage.name, step)
                previous = stage.name
            yield {"step": step, "stage": stage.name, "prompts": self.dm.prompts_for_step(step)}
            step += 1


class MathDataModule(lightning.LightningDataModule):
    """Prompts for RL training from the run's ``data`` section (:class:`DataConfig`); ``Prompt.source``
    is the dataset's name in this config."""

    def __init__(self, config: DataConfig):
        super().__init__()
        self.config = config
        self.stages, self.seed, self.template = config.stages, config.seed, config.template
        self.prompt_token_limit: int | None = None  # set by limit_prompt_tokens
        self.prompt_drops: list[PromptDrop] = []
        self.tokenizer = None  # the policy's, for kind=chat (use_tokenizer)
        # by (stage name, or None for val; dataset name): its source, its examples, those kept
        self._sources = {key: _source(d) for key, d in self._datasets()}
        self._loaded: dict[tuple, list[MathExample]] = {}
        self._kept: dict[tuple, list[MathExample]] = {}
        self._quotas: dict[str, list[int]] = {}
        for s in self.stages:
            quotas = largest_remainder_quotas([d.weight for d in s.datasets], config.prompts_per_step)
            self._quotas[s.name] = quotas
            starved = [d.name for d, q in zip(s.datasets, quotas, strict=True) if q == 0]
            if starved:
                log.warning("stage %s: prompts_per_step=%d is too small to give datasets %s a slot",
                            s.name, config.prompts_per_step, starved)
        for key, source in self._sources.items():
            if not callable(source):
                self.loaded(key)  # eager sources: an empty one fails now, not at its first step
        self._val_prompts: list[Prompt] | None = None

    def _datasets(self) -> list[tuple[tuple[str | None, str], Dataset]]:
        """Every dataset the run reads, by its key: each stage's, then the val ones."""
        named = [((s.name, d.name), d) for s in self.stages for d in s.datasets]
        return named + [((None, d.name), d) for d in self.config.val or []]

    def loaded(self, key: tuple[str | None, str]) -> list[MathExample]:
        """Every example of a dataset (none dropped), loaded at its first use."""
        if key not in self._loaded:
            source = self._sources[key]
            examples = [_as_example(e, key[1], i) for i, e in enumerate(source() if callable(source) else source)]
            if not examples:
                raise ValueError(f"dataset {key[1]!r} is empty: {describe_source(source)} gave no examples")
            self._loaded[key] = examples
        return self._loaded[key]

    def examples(self, key: tuple[str | None, str]) -> list[MathExample]:
        """The examples the schedule draws from: :meth:`loaded`, less those too long."""
        return self._kept[key] if key in self._kept else self.loaded(key)

    def use_tokenizer(self, tokenizer) -> None:
        """The policy's tokenizer: ``template.kind=chat`` renders prompts with its chat template."""
        self.tokenizer = tokenizer
        self._val_prompts = None

    def limit_prompt_tokens(self, tokenizer, limit: int | None, why: str = "") -> list[PromptDrop]:
        """Drop from every dataset the rendered prompts longer than ``limit`` tokens, those the engine
        cannot take (as verl's ``filter_overlong_prompts``), before any permutation is drawn. A dataset
        losing more than ``max_dropped_prompt_share`` fails here (the limit, not a few outliers, is
        then wrong); ``why`` names where ``limit`` comes from. ``limit`` None keeps every prompt."""
        if limit is not None and int(limit) < 1:
            raise ValueError(f"the prompt token limit must be >= 1, got {limit} ({why or LIMIT_SETTINGS})")
        self.prompt_token_limit = limit = None if limit is None else int(limit)
        self._val_prompts = None
        self._kept.clear()
        keys = [] if limit is None else [key for key, _ in self._datasets()]
        self.prompt_drops = [self._drop_overlong(key, tokenizer, limit) for key in keys]
        for drop in self.prompt_drops:
            if drop.dropped:
                log.warning("%s, dropped; the longest kept has %d tokens", drop.describe(limit), drop.longest_kept)
            else:
                log.info("%s: all %d prompts within %d tokens (the longest has %d)",
                         drop.where, drop.total, limit, drop.longest_kept)
        self._check_drops(why)
        return self.prompt_drops

    def _drop_overlong(self, key: tuple[str | None, str], tokenizer, limit: int) -> PromptDrop:
        """Keep the dataset's examples whose rendered prompt has at most ``limit`` tokens."""
        examples = self.loaded(key)
        counts = prompt_token_counts(tokenizer, [self.render(ex.problem) for ex in examples])
        self._kept[key] = [ex for ex, n in zip(examples, counts, strict=True) if n <= limit]
        longest = max((n for n in counts if n <= limit), default=0)
        where = f"stage {key[0]!r} dataset {key[1]!r}" if key[0] is not None else f"val dataset {key[1]!r}"
        return PromptDrop(where, key[1], len(examples) - len(self._kept[key]), len(examples), longest)

    def _check_drops(self, why: str) -> None:
        """Refuse a dataset that lost more than the allowed share, or everything."""
        share = self.config.max_dropped_prompt_share
        bad = [d for d in self.prompt_drops if d.dropped and (d.share > share or d.dropped == d.total)]
        if bad:
            lost = "; ".join(d.describe(self.prompt_token_limit) for d in bad)
            raise ValueError(
                f"{lost}: more than data.max_dropped_prompt_share={share:g} of a dataset, or all of it. The limit "
                f"{self.prompt_token_limit} is {why or 'the engine max_model_len - rollout.max_new_tokens'}: "
                f"raise it with {LIMIT_SETTINGS} (the model's positions cap max_model_len), "
                "or allow the loss with data.max_dropped_prompt_share (++data.max_dropped_prompt_share=<share>)"
            )

    def render(self, problem: str) -> str:
        return self.template.render(problem, self.tokenizer)

    def _render(self, ex: MathExample, source: str) -> Prompt:
        return Prompt(ex.key, self.render(ex.problem), ex.problem, ex.answer, source)

    def _item(self, stage: Stage, ds: Dataset, i: int) -> int:
        """Index (into its examples) of item ``i`` of the dataset's infinite sequence."""
        n = len(self.examples((stage.name, ds.name)))
        epoch, pos = divmod(i, n)
        return int(_permutation(n, self.seed, stage.name, ds.name, epoch)[pos])

    def _step_indices(self, step: int) -> tuple[Stage, list[tuple[Dataset, list[int]]]]:
        stage = self.stage_at(step)
        k = step - stage.start_step
        quotas = zip(stage.datasets, self._quotas[stage.name], strict=True)
        return stage, [(ds, [self._item(stage, ds, k * q + j) for j in range(q)]) for ds, q in quotas]

    def stage_at(self, step: int) -> Stage:
        """The stage whose ``start_step`` is the largest ``<= step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return [s for s in self.stages if s.start_step <= step][-1]  # start steps increase from 0

    def prompts_for_step(self, step: int) -> list[Prompt]:
        """The prompts of training step ``step`` (a pure function of ``seed`` and ``step``)."""
        stage, parts = self._step_indices(step)
        return [self._render(self.examples((stage.name, ds.name))[i], ds.name) for ds, idx in parts for i in idx]

    def extra_prompts(self, step: int, round: int, n: int) -> list[Prompt]:
        """``n`` more prompts of ``step``'s stage for DAPO dynamic sampling round ``round``, deterministic
        in ``(seed, step, round)``; none repeats the step's or each other while the datasets suffice."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        stage, regular = self._step_indices(step)
        weights = np.array([d.weight for d in stage.datasets], dtype=float)
        exact = weights / weights.sum() * n
        counts = np.floor(exact).astype(int)
        rest = n - int(counts.sum())
        rng = np.random.default_rng(_seed_int(self.seed, "extra-quota", stage.name, step, round))
        if rest > 0:
            frac = exact - counts
            chosen = rng.choice(len(counts), size=rest, replace=False, p=frac / frac.sum())
            counts[chosen] += 1
        out: list[Prompt] = []
        for (ds, used), q in zip(regular, counts.tolist(), strict=True):
            if q == 0:
                continue
            examples = self.examples((stage.name, ds.name))
            size = len(examples)
            seed = _seed_int(self.seed, "extra", stage.name, ds.name, step, round)
            perm = np.random.default_rng(seed).permutation(size)
            order = sorted(perm.tolist(), key=set(used).__contains__)  # used ones last: if too small
            picks = [order[j % size] for j in range(q)]
            out.extend(self._render(examples[i], ds.name) for i in picks)
        return out

    def train_dataloader(self) -> _TrainSteps:
        return _TrainSteps(self)

    def val_prompts(self) -> list[Prompt]:
        """The union of the val datasets, shuffled with the seed, cut to ``val_size``."""
        if self.config.val is None:
            return []
        if self._val_prompts is None:
            pool = [(ex, ds.name) for ds in self.config.val for ex in self.examples((None, ds.name))]
            perm = np.random.default_rng(_seed_int(self.seed, "val")).permutation(len(pool))
            self._val_prompts = [self._render(*pool[int(i)]) for i in perm[: self.config.val_size]]
        return self._val_prompts

    def state_dict(self) -> dict[str, Any]:
        """The schedule is stateless: this only lets a resume detect a changed schedule."""
        state = {"seed": self.seed, "stages": [(s.name, s.start_step) for s in self.stages]}
        if self.prompt_token_limit is not None:
            state["prompt_token_limit"] = self.prompt_token_limit
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved_seed = state_dict.get("seed")
        saved_stages = [tuple(s) for s in state_dict.get("stages", [])]
        current = [(s.name, s.start_step) for s in self.stages]
        if saved_seed != self.seed:
            log.warning("data seed changed since the checkpoint: %s -> %s (the prompt order differs)",
                        saved_seed, self.seed)
        if saved_stages != current:
            log.warning("stage schedule changed since the checkpoint: %s -> %s", saved_stages, current)
        saved_limit = state_dict.get("prompt_token_limit")
        if saved_limit != self.prompt_token_limit:
            log.warning("prompt token limit changed since the checkpoint: %s -> %s (other prompts are "
                        "dropped, so the prompt order differs)", saved_limit, self.prompt_token_limit)
