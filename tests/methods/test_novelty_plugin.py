"""The novelty plug-in's hidden-state vectors: read inside the (left-trimmed) scoring forward, equal
to the mean final hidden state over each response's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from medsrl.methods.novelty import NoveltyBonus
from medsrl.models.char_tokenizer import build_char_tokenizer
from medsrl.models.tiny import build_tiny_model
from medsrl.rollout.base import pack_rollouts
from medsrl.step.scoring import scoring_pass

TOK = build_char_tokenizer()


def test_hidden_mean_vectors_match_a_full_forward():
    model = build_tiny_model(seed=2, hidden_size=32, num_hidden_layers=2, intermediate_size=64).eval()
    enc = lambda s: TOK.encode(s, add_special_tokens=False)  # noqa: E731
    prompts = ["1+2=", "a much longer prompt than the others: 3*4=", "9-4"]
    responses = ["3", "12 so \\boxed{12}", "5."]
    packed = pack_rollouts([enc(p) for p in prompts], [enc(r) for r in responses], TOK.pad_token_id)
    plugin = NoveltyBonus(vectors="hidden_mean")
    plugin.setup(None, SimpleNamespace(policy=model, tokenizer=TOK), "fit")
    rollouts = SimpleNamespace(packed=packed, response_ids=[enc(r) for r in responses])
    plugin.before_scoring(rollouts, None)
    scoring_pass(model, packed, micro_batch_size=1,
                 microbatch_context=lambda rows: plugin.scoring_microbatch(rollouts, rows))
    plugin.after_scoring(rollouts, None)
    with torch.no_grad():
        out = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                    position_ids=packed.position_ids, output_hidden_states=True)
    last = out.hidden_states[-1][:, packed.prompt_length:]  # after the final norm
    m = packed.response_mask.unsqueeze(-1)
    want = (last * m).sum(1) / m.sum(1)
    assert plugin._rows.tolist() == [0, 1, 2]
    assert torch.allclose(plugin._vecs, want, atol=1e-5)
