"""``data``: the prompt schedule's stages and datasets, the held-out set and the prompt format,
read by ``MathDataModule``. Hydra instantiates each dataset's ``source`` (a loader or generator):
the keys named here are checked at start, with their dataset named."""

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field, model_validator

from medsrl.data.template import PromptTemplate
from medsrl.settings import (
    Finite,
    Open,
    Positive,
    PositiveInt,
    Seed,
    Settings,
    Text,
    kind,
    must,
    non_empty,
    nullable,
    one_of,
    raise_problems,
)


class Source(Open):
    """A file, hub data set or generator source (``load_math_file``, ``load_math_hub``,
    ``generate_arithmetic``, ...): its ``_target_`` and the arguments it takes."""

    path: nullable(Text) = None
    """A JSON / JSONL / parquet file (load_math_file)."""
    hub: nullable(Text) = None
    """A hub data set (or "parquet" / "json" with data_files) instead of a path."""
    subset: nullable(Text) = None
    """The hub data set's configuration."""
    revision: nullable(Text) = None
    """The hub revision (a commit for a reproducible run)."""
    name: nullable(Text) = None
    """The name its rows carry (default: from the file or hub name)."""
    num: PositiveInt = None  # the loader's own default when not given (defaults are not checked)
    """Problems a generator makes."""
    limit: nullable(PositiveInt) = None
    """The first N rows; null: all."""
    on_bad_row: one_of(("skip", "raise")) = None
    """skip (counted and logged, the file and row named) or raise."""
    problem_field: nullable(Text) = None
    """The problem's column when it is not a known one."""
    answer_field: nullable(Text) = None
    """The answer's column when it is not a known one."""
    split: Text = None
    """The split (hub data sets, generators)."""


class Dataset(Settings):
    name: Text
    """The dataset's name (Prompt.source; unique in its stage)."""
    weight: Positive = 1.0
    """Its share of a stage's prompts (largest-remainder quotas)."""
    source: kind(lambda v: "node" if isinstance(v, dict) else "examples" if isinstance(v, list) else "callable",
                  node=Source, examples=list, callable=Callable[[], Any])
    """A loader or generator (_target_ and its arguments); from Python, examples or a callable."""


class Stage(Settings):
    name: Text
    """The stage's name (unique)."""
    start_step: Annotated[int, Field(ge=0), must("an int >= 0")]
    """The step it starts at: the first stage at 0, then strictly increasing."""
    datasets: Annotated[list[Dataset], non_empty("a non-empty list of datasets")]
    """Its datasets, each drawn by its weight."""


class DataConfig(Settings):
    """The prompts of each step, a pure function of ``(seed, step)`` (data/datamodule.py)."""

    prompts_per_step: PositiveInt = 16
    """Prompts of each RL step (each sampled rollout.n times), split between a stage's datasets by weight."""
    val_size: nullable(PositiveInt) = 64
    """Held-out prompts: the val datasets' union, shuffled with the seed and cut to this; null: all."""
    seed: Seed = 0
    """The schedule's seed (the run's seed by default): per-epoch permutations of each dataset."""
    stages: Annotated[list[Stage], non_empty("a non-empty list of stages")]
    val: list[Dataset] | None = None
    """The held-out datasets (validation: callbacks.pass_at_k); null: none."""
    template: PromptTemplate = Field(default_factory=PromptTemplate)
    """The prompt format (presets: prompt=r1_distill, qwen3_thinking, plain)."""
    max_dropped_prompt_share: Annotated[Finite, Field(ge=0, le=1), must("a number in [0, 1]")] = 0.01
    """The largest share of a dataset dropped as longer than the engine takes before the run
    refuses to start (MathDataModule.limit_prompt_tokens); 0: none may be dropped."""

    @model_validator(mode="after")
    def _schedule(self) -> "DataConfig":
        found = _unique([s.name for s in self.stages], "data.stages: stage names")
        if self.stages[0].start_step != 0:
            found.append(f"data.stages.0.start_step must be 0 (the first stage must start at step 0), "
                         f"got {self.stages[0].start_step}")
        for i, (prev, cur) in enumerate(zip(self.stages, self.stages[1:], strict=False), 1):
            if cur.start_step <= prev.start_step:
                found.append(f"data.stages.{i}.start_step must be above the previous stage's ({prev.start_step}): "
                             f"start steps are strictly increasing, got {cur.start_step}")
        for i, s in enumerate(self.stages):
            found += _unique([d.name for d in s.datasets], f"data.stages.{i}: dataset names")
        found += _unique([d.name for d in self.val or []], "data.val: dataset names")
        raise_problems(found)
        return self


def _unique(names: list[str], what: str) -> list[str]:
    return [] if len(set(names)) == len(names) else [f"{what} must be unique, got {names}"]
