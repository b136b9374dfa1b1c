"""Staged, stateless prompt schedule for RL training.

The prompts of training step ``s`` are a pure function of ``(seed, s)``:

- the stage is the one whose ``start_step`` is the largest ``<= s``;
- each dataset ``d`` of the stage has a fixed quota ``q_d`` of ``prompts_per_step`` (largest
  remainder rounding of the weights; every dataset gets at least one slot when there are enough);
- at stage-local step ``k = s - stage.start_step`` dataset ``d`` contributes items
  ``k*q_d ... k*q_d + q_d - 1`` of an infinite sequence made of per-epoch permutations of ``d``,
  each seeded by ``(seed, stage name, dataset name, epoch)``: epochs without replacement.

There is no iterator state to save: resuming at ``trainer.global_step`` reproduces the run, and
Lightning's one-batch prefetch is harmless.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import lightning
import numpy as np

from medsrl.data.example import MathExample, Prompt, prompt_key
from medsrl.data.template import PromptTemplate

__all__ = ["DatasetSpec", "MathDataModule", "StageSpec", "largest_remainder_quotas"]

log = logging.getLogger(__name__)

ExampleSource = Sequence[MathExample] | Callable[[], Sequence[MathExample]]


@dataclass
class DatasetSpec:
    """A named dataset of a stage. ``source`` is a list of examples or a zero-arg callable
    returning one (resolved on first use, then cached)."""

    name: str
    weight: float = 1.0
    source: ExampleSource | None = None
    _examples: list[MathExample] | None = field(default=None, init=False, repr=False)

    @property
    def examples(self) -> list[MathExample]:
        if self._examples is None:
            src = self.source
            if src is None:
                raise ValueError(f"dataset {self.name!r}: no source")
            if callable(src) and not isinstance(src, Sequence):
                src = src()
            examples = [_as_example(e, self.name, i) for i, e in enumerate(src)]
            if not examples:
                raise ValueError(f"dataset {self.name!r} is empty: {describe_source(self.source)} gave no examples")
            self._examples = examples
        return self._examples

    @property
    def is_loaded(self) -> bool:
        return self._examples is not None or (
            isinstance(self.source, Sequence) and not callable(self.source)
        )


@dataclass
class StageSpec:
    name: str
    start_step: int
    datasets: list[DatasetSpec]


def describe_source(source: Any) -> str:
    """Where a dataset's examples come from, for an error message: the loader or generator and
    its arguments (a file's path among them) when the source is a callable, else its type."""
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
        d = dict(item)
        if "key" not in d and "problem" in d:
            d["key"] = prompt_key(str(d["problem"]))
        d.setdefault("source", dataset)
        d.setdefault("row", i)
        try:
            return MathExample(**d)
        except TypeError as e:
            raise ValueError(f"dataset {dataset!r} item {i}: not a MathExample: {e}") from e
    raise ValueError(
        f"dataset {dataset!r} item {i}: expected a MathExample, got {type(item).__name__}"
    )


def _plain(obj: Any) -> Any:
    """An OmegaConf container -> plain python, leaving instantiated objects alone."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=True)
    return obj


def _check_unique(names: list[str], what: str) -> None:
    if len(set(names)) != len(names):
        raise ValueError(f"{what} must be unique, got {names}")


def _fields(obj: Any, where: str, what: str, keys: set[str]) -> dict[str, Any]:
    """``obj`` as a dict, refusing anything but a mapping with known keys."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected {what}, got {type(obj).__name__}")
    unknown = set(obj) - keys
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return dict(obj)


def _dataset_spec(obj: Any, where: str) -> DatasetSpec:
    if isinstance(obj, DatasetSpec):
        return obj
    d = _fields(obj, where, "a dataset mapping", {"name", "weight", "source"})
    if "name" not in d:
        raise ValueError(f"{where}: dataset needs a 'name'")
    source = d.get("source")
    if source is None:
        raise ValueError(
            f"{where} ({d['name']!r}): dataset needs a 'source' (examples or callable)"
        )
    source = _plain(source)
    if isinstance(source, Mapping):
        raise ValueError(
            f"{where} ({d['name']!r}): 'source' is a mapping; was its _target_ instantiated?"
        )
    return DatasetSpec(name=str(d["name"]), weight=float(d.get("weight", 1.0)), source=source)


def _stage_spec(obj: Any, i: int) -> StageSpec:
    if isinstance(obj, StageSpec):
        return obj
    d = _fields(obj, f"stage {i}", "a mapping", {"name", "start_step", "datasets"})
    for k in ("name", "start_step", "datasets"):
        if k not in d:
            raise ValueError(f"stage {i}: missing {k!r}")
    if isinstance(d["datasets"], Mapping) or not isinstance(d["datasets"], Sequence):
        raise ValueError(f"stage {d['name']!r}: 'datasets' must be a list")
    where = f"stage {d['name']!r} dataset"
    datasets = [_dataset_spec(ds, f"{where} {j}") for j, ds in enumerate(d["datasets"])]
    return StageSpec(str(d["name"]), int(d["start_step"]), datasets)


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


# iterables handed to Lightning (not lists: Lightning would read a list as several loaders)


class _TrainSteps:
    """Infinite iterable of ``{"step", "stage", "prompts"}``, starting at the trainer's
    ``global_step`` (read when iteration starts, so a resumed run continues exactly) or 0."""

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
    """Prompts for RL training, in stages, as a stateless function of ``(seed, step)``.

    ``stages``: :class:`StageSpec` s or mappings ``{name, start_step, datasets: [{name, weight,
    source}]}`` (a source: see :class:`DatasetSpec`). ``val``: datasets ``{name, source}`` whose
    union, shuffled with the seed and cut to ``val_size``, is the held-out set. ``template``:
    ``PromptTemplate`` settings. ``Prompt.source`` is the dataset's name in this config.
    """

    def __init__(
        self,
        stages: Sequence[Mapping[str, Any] | StageSpec],
        val: Sequence[Mapping[str, Any] | DatasetSpec] | None = None,
        prompts_per_step: int = 16,
        val_size: int | None = 64,  # None: every held-out prompt
        template: Mapping[str, Any] | None = None,
        seed: int = 0,
    ):
        super().__init__()
        if int(prompts_per_step) < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if val_size is not None and int(val_size) < 1:
            raise ValueError(f"val_size must be >= 1 or None, got {val_size}")
        self.prompts_per_step = int(prompts_per_step)
        self.val_size = None if val_size is None else int(val_size)
        self.seed = int(seed)

        self.template = PromptTemplate.from_config(_plain(template))
        self.tokenizer = None  # the policy's, for kind=chat (use_tokenizer)

        stages = _plain(stages)
        if not stages or isinstance(stages, Mapping) or not isinstance(stages, Sequence):
            raise ValueError("stages must be a non-empty list of stages")
        self.stages: list[StageSpec] = [_stage_spec(s, i) for i, s in enumerate(stages)]
        self._validate_stages()
        self._quotas: dict[str, list[int]] = {}
        for s in self.stages:
            quotas = largest_remainder_quotas([d.weight for d in s.datasets], self.prompts_per_step)
            self._quotas[s.name] = quotas
            starved = [d.name for d, q in zip(s.datasets, quotas, strict=True) if q == 0]
            if starved:
                log.warning("stage %s: prompts_per_step=%d is too small to give datasets %s a slot",
                            s.name, self.prompts_per_step, starved)

        val = _plain(val)
        self.val: list[DatasetSpec] | None = None
        if val is not None:
            if isinstance(val, Mapping) or not isinstance(val, Sequence):
                raise ValueError("val must be a list of datasets or None")
            self.val = [_dataset_spec(d, f"val dataset {j}") for j, d in enumerate(val)]
            _check_unique([d.name for d in self.val], "val dataset names")
            for d in self.val:
                if d.is_loaded:
                    _ = d.examples  # eager sources: an empty one fails now, not at validation
        self._val_prompts: list[Prompt] | None = None

    def _validate_stages(self) -> None:
        _check_unique([s.name for s in self.stages], "stage names")
        if self.stages[0].start_step != 0:
            raise ValueError(
                f"the first stage ({self.stages[0].name!r}) must start at step 0, "
                f"got start_step={self.stages[0].start_step}"
            )
        for prev, cur in zip(self.stages, self.stages[1:], strict=False):
            if cur.start_step <= prev.start_step:
                raise ValueError(
                    "stage start_steps must be strictly increasing: "
                    f"{prev.name!r} starts at {prev.start_step}, {cur.name!r} at {cur.start_step}"
                )
        for s in self.stages:
            if not s.datasets:
                raise ValueError(f"stage {s.name!r} has no datasets")
            _check_unique([d.name for d in s.datasets], f"stage {s.name!r}: dataset names")
            for d in s.datasets:
                if not (math.isfinite(d.weight) and d.weight > 0):
                    raise ValueError(
                        f"stage {s.name!r} dataset {d.name!r}: weight must be > 0, got {d.weight}"
                    )
                if d.is_loaded:
                    _ = d.examples  # eager sources: check they are non-empty now

    def use_tokenizer(self, tokenizer) -> None:
        """The policy's tokenizer: ``template.kind=chat`` renders prompts with its chat template."""
        self.tokenizer = tokenizer
        self._val_prompts = None

    def render(self, problem: str) -> str:
        """The prompt text of ``problem`` in this data's format."""
        return self.template.render(problem, self.tokenizer)

    def _render(self, ex: MathExample, source: str) -> Prompt:
        return Prompt(ex.key, self.render(ex.problem), ex.problem, ex.answer, source)

    def _item(self, stage: StageSpec, ds: DatasetSpec, i: int) -> int:
        """Index (into ``ds.examples``) of item ``i`` of the dataset's infinite sequence."""
        n = len(ds.examples)
        epoch, pos = divmod(i, n)
        return int(_permutation(n, self.seed, stage.name, ds.name, epoch)[pos])

    def _step_indices(self, step: int) -> tuple[StageSpec, list[tuple[DatasetSpec, list[int]]]]:
        stage = self.stage_at(step)
        k = step - stage.start_step
        quotas = zip(stage.datasets, self._quotas[stage.name], strict=True)
        return stage, [(ds, [self._item(stage, ds, k * q + j) for j in range(q)]) for ds, q in quotas]

    def stage_at(self, step: int) -> StageSpec:
        """The stage whose ``start_step`` is the largest ``<= step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return [s for s in self.stages if s.start_step <= step][-1]  # start steps increase from 0

    def prompts_for_step(self, step: int) -> list[Prompt]:
        """The prompts of training step ``step`` (a pure function of ``seed`` and ``step``)."""
        _, parts = self._step_indices(step)
        return [self._render(ds.examples[i], ds.name) for ds, idx in parts for i in idx]

    def extra_prompts(self, step: int, round: int, n: int) -> list[Prompt]:
        """``n`` more prompts of ``step``'s stage for DAPO dynamic sampling round ``round``,
        deterministic in ``(seed, step, round)``; none repeats ``prompts_for_step(step)`` or the
        call's others while the datasets are large enough. Slots are shared by weight."""
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
            size = len(ds.examples)
            perm = np.random.default_rng(
                _seed_int(self.seed, "extra", stage.name, ds.name, step, round)
            ).permutation(size)
            used_set = set(used)
            order = sorted(perm.tolist(), key=used_set.__contains__)  # used ones: if too small
            picks = [order[j % size] for j in range(q)]
            out.extend(self._render(ds.examples[i], ds.name) for i in picks)
        return out

    def train_dataloader(self) -> _TrainSteps:
        """The steps from ``trainer.global_step`` on (:class:`_TrainSteps`)."""
        return _TrainSteps(self)

    def val_prompts(self) -> list[Prompt]:
        """The held-out prompts: the union of the val datasets, shuffled with the seed, cut to
        ``val_size``. Empty when ``val`` is None."""
        if self.val is None:
            return []
        if self._val_prompts is None:
            pool = [(ex, ds.name) for ds in self.val for ex in ds.examples]
            perm = np.random.default_rng(_seed_int(self.seed, "val")).permutation(len(pool))
            self._val_prompts = [self._render(*pool[int(i)]) for i in perm[: self.val_size]]
        return self._val_prompts

    # checkpointing: the schedule is stateless; this only detects a changed schedule

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "stages": [(s.name, s.start_step) for s in self.stages]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        saved_seed = state_dict.get("seed")
        saved_stages = [tuple(s) for s in state_dict.get("stages", [])]
        current = [(s.name, s.start_step) for s in self.stages]
        if saved_seed != self.seed:
            log.warning("data seed changed since the checkpoint: %s -> %s (the prompt order differs)",
                        saved_seed, self.seed)
        if saved_stages != current:
            log.warning("stage schedule changed since the checkpoint: %s -> %s", saved_stages, current)
