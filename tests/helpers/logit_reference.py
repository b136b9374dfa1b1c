"""An obviously-right reference for the MEDS feature, shared by the capture and feature tests.

Import as ``from logit_reference import reference_features`` (``tests`` is on pytest's path).
"""

from __future__ import annotations

import torch

from medsrl.features.logit_capture import find_decoder_layers


def reference_features(model, packed, targets, layers, final_norm=False) -> torch.Tensor:
    """``[M, len(layers)]``: lm_head(hidden_states[n])[row, pos, next_token] for each layer n,
    from ``output_hidden_states=True`` (the reference's way); ``final_norm`` also passes the
    intermediate layers through the final norm."""
    with torch.no_grad():
        hs = model(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            use_cache=False,
            output_hidden_states=True,
        ).hidden_states
        n_layers = len(hs) - 1
        cols = []
        for n in layers:
            h = hs[n][targets.rows, targets.positions]
            if final_norm and n < n_layers:
                h = model.model.norm(h)
            logits = model.lm_head(h).float()
            cols.append(logits.gather(1, targets.next_token_ids[:, None])[:, 0])
    return torch.stack(cols, dim=1)


def hook_count(model) -> int:
    """Forward hooks left on the decoder blocks (0 outside a capture)."""
    return sum(len(m._forward_hooks) for m in find_decoder_layers(model))
