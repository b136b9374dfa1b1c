"""Evaluation entry point (``medsrl-eval``): sampled accuracy (mean@n) of a policy on a data set.

Loads an exported Hugging Face directory, a model name, or a Lightning checkpoint of a training
run (the run's saved Hydra config rebuilds the model before the weights are loaded). Writes every
generation with its grade to ``generations.jsonl`` and the figures to ``metrics.json``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("MEDSRL_ROOT", str(ROOT))
CONFIG_DIR = str(ROOT / "configs")

import hydra  # noqa: E402
import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from medsrl.data.template import render_prompt  # noqa: E402
from medsrl.models.loading import load_policy, load_tokenizer  # noqa: E402
from medsrl.reward.grader import MathGrader  # noqa: E402
from medsrl.rollout.base import SamplingParams  # noqa: E402
from medsrl.rollout.hf import HFRolloutEngine  # noqa: E402

log = logging.getLogger(__name__)


def load_for_eval(model_path: str, tokenizer: str | None, dtype: str):
    """``(policy, tokenizer)`` from an HF dir/name or a training run's ``.ckpt``."""
    if str(model_path).endswith(".ckpt"):
        from medsrl.models.policy import build_policy

        ckpt = Path(model_path)
        run_cfg = ckpt.parent.parent / ".hydra" / "config.yaml"
        if not run_cfg.exists():
            raise FileNotFoundError(
                f"{ckpt}: cannot rebuild the model, {run_cfg} (the run's Hydra config) is missing; "
                "evaluate the exported policy directory instead"
            )
        cfg = OmegaConf.load(run_cfg)
        model_cfg = OmegaConf.to_container(cfg.model, resolve=False)
        cache = Path(os.environ["MEDSRL_ROOT"]) / "data" / "cache"
        policy, tok = build_policy(model_cfg, cache)
        state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        policy.load_state_dict({k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")})
        return policy, tok
    return load_policy(model_path, dtype=dtype), load_tokenizer(tokenizer or model_path)


def evaluate(cfg: DictConfig) -> dict[str, float]:
    out_dir = Path(cfg.paths.output_dir)
    policy, tok = load_for_eval(cfg.model_path, cfg.tokenizer, cfg.dtype)
    examples = instantiate(cfg.dataset)
    engine = HFRolloutEngine(policy, tok, max_batch_size=cfg.batch_size)
    template = OmegaConf.to_container(cfg.template, resolve=True)
    correct, total = 0.0, 0
    per_problem: list[float] = []
    with MathGrader(timeout_s=cfg.grader.timeout_s, num_workers=cfg.grader.num_workers) as grader, open(
        out_dir / "generations.jsonl", "w"
    ) as f:
        chunk = max(1, cfg.batch_size // cfg.n)
        for start in range(0, len(examples), chunk):
            batch = examples[start : start + chunk]
            params = SamplingParams(
                n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + start,
            )
            rollout = engine.generate([render_prompt(e.problem, **template) for e in batch], params)
            grades = grader.grade_batch(rollout.response_text, [batch[i].answer for i in rollout.prompt_index])
            hits = [0.0] * len(batch)
            for i, g in enumerate(grades):
                p = rollout.prompt_index[i]
                hits[p] += g.score
                f.write(json.dumps({"key": batch[p].key, "problem": batch[p].problem, "gold": batch[p].answer,
                                    "response": rollout.response_text[i], "extracted": g.extracted,
                                    "score": g.score, "finish_reason": rollout.finish_reason[i]}) + "\n")
            per_problem += [h / cfg.n for h in hits]
            correct += sum(g.score for g in grades)
            total += len(grades)
    metrics = {
        "mean_at_n": correct / max(total, 1),
        "n": cfg.n,
        "problems": len(examples),
        "any_correct": sum(p > 0 for p in per_problem) / max(len(per_problem), 1),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"[medsrl] {cfg.model_path}: mean@{cfg.n} = {metrics['mean_at_n']:.4f} on {len(examples)} problems")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="eval")
def main(cfg: DictConfig) -> float:
    return evaluate(cfg)["mean_at_n"]


if __name__ == "__main__":
    main()
