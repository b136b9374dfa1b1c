"""``medsrl-plan <the overrides of medsrl-train>``: the run's memory per GPU and phase, and whether it fits.

Composes the same config ``medsrl-train`` would (``configs/train.yaml`` + the overrides), builds
the model on the ``meta`` device (no weights, no GPU) and prints ``plan/gpu_bytes.py``'s arithmetic.
Exits 1 when the run does not fit the hardware it declares (``hardware.gpu_memory_gib``)::

    medsrl-plan experiment=qwen2.5-math-7b_meds
    medsrl-plan experiment=qwen3-8b_dapo trainer.devices=4 rollout.max_batch_size=16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from omegaconf import DictConfig

from medsrl.plan.gpu_bytes import DEFAULT_PROMPT_TOKENS, MemoryPlan, format_plan, plan_memory, run_shape
from medsrl.plan.model_size import model_size
from medsrl.run_config import CONFIG_DIR, RunConfig


def compose_train_config(overrides: Sequence[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="plan"):
        return compose(config_name="train", overrides=list(overrides))


def plan_for(cfg: DictConfig, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> MemoryPlan:
    """Parsed: a bad value fails as in training."""
    run = RunConfig.parse(cfg)
    return plan_memory(model_size(run.model), run_shape(run, prompt_tokens))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medsrl-plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for medsrl-train")
    parser.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
                        help="the longest prompt, in tokens (default %(default)s, the reference run's)")
    args = parser.parse_args(argv)
    plan = plan_for(compose_train_config(args.overrides), args.prompt_tokens)
    print(format_plan(plan))
    return 1 if plan.fits is False else 0


if __name__ == "__main__":
    sys.exit(main())
