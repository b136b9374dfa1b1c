"""MEDS features: per-layer logits of the first answer token, read during the old-log-prob pass.

For each response the answer locator finds the token holding the ``{`` of the last
``\\boxed{``; forward hooks keep only the hidden states at those positions while the module runs
its no-grad forward (no second forward, no stored hidden-state stack), and the LM head scores
the first answer token from each selected layer (PAPER.md steps 1-2).
"""

from __future__ import annotations

from contextlib import nullcontext

from medsrl.callbacks.protocol import RolloutCallback, StepRollouts
from medsrl.shaping.answer_locator import locate_answers
from medsrl.shaping.logit_capture import LayerLogitCapture, answer_targets, layer_differences

FEATURES = "meds_features"  # rollouts.features[FEATURES]: float32 [M, D] on CPU
SAMPLE_INDEX = "meds_sample_index"  # rollouts.features[SAMPLE_INDEX]: long [M], response rows


class AnswerLogitCapture(RolloutCallback):
    """Puts ``rollouts.features[FEATURES]`` and ``[SAMPLE_INDEX]`` for responses with a box."""

    def __init__(self, layers=14, final_norm: bool = False, diff: bool = False) -> None:
        self.layers = layers
        self.final_norm = final_norm
        self.diff = diff
        self.capture: LayerLogitCapture | None = None
        self._targets = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.capture is None:
            self.capture = LayerLogitCapture(pl_module.policy, self.layers, final_norm=self.final_norm)

    def on_before_logprob_forward(self, trainer, module, rollouts: StepRollouts) -> None:
        index = locate_answers(rollouts.response_ids, module.tokenizer)
        self._targets = answer_targets(index, rollouts.response_ids, rollouts.packed.prompt_length)
        self.capture.clear()

    def logprob_microbatch(self, trainer, module, rollouts, start: int, stop: int):
        part = self._targets.for_rows(start, stop)
        return self.capture.capture(part) if len(part) else nullcontext()

    def on_after_logprob_forward(self, trainer, module, rollouts: StepRollouts) -> None:
        targets, self._targets = self._targets, None
        if len(targets):
            feats = self.capture.pop_features().float().cpu()
            if self.diff:
                feats = layer_differences(feats)
        else:
            feats = rollouts.packed.response_mask.new_zeros((0, self.num_features)).float().cpu()
        rollouts.features[FEATURES] = feats
        rollouts.features[SAMPLE_INDEX] = targets.sample_index.cpu()
        rollouts.metrics["meds/answer_found_rate"] = len(targets) / max(len(rollouts), 1)

    @property
    def num_features(self) -> int:
        n = self.capture.num_features
        return n - 1 if self.diff else n
