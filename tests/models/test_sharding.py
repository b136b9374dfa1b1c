"""The FSDP policy on 2 gloo ranks: the weight stream to the engine gathers one unit at a time,
and the forwards that run through the wrapper (scoring, features) let a rank with fewer rows, or
none, join the others' passes instead of hanging them. One spawn runs every check (the process
start dominates; ``tests/gloo_ranks.py``)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy

from medsrl.models.lora import apply_lora, merged_state_dict, merged_weights
from medsrl.models.settings import LoraSettings
from medsrl.models.sharding import layer_classes, shard_policy, streamed_weights
from medsrl.models.tiny import tiny_qwen2_config

ARCH = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=128)
BF16_MIXED = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


def _model(seed: int, lora: bool = False) -> torch.nn.Module:
    """An untied tiny Qwen2 (the root unit holds embeddings and LM head, as at 7B); with LoRA,
    adapters with non-zero B so the merge changes the weights."""
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(**ARCH)
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if lora:
        model = apply_lora(model, LoraSettings(r=4, alpha=8.0))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    return model


def _shard(model, mixed: MixedPrecision | None):
    strategy = SimpleNamespace(sharding_strategy=ShardingStrategy.FULL_SHARD, cpu_offload=None,
                               mixed_precision_config=mixed, root_device=torch.device("cpu"))
    return shard_policy(model, strategy)


def _unit_sizes(policy) -> dict[str, int]:
    from fsdp_probe import gathered_units

    return {name: n for name, n, _ in gathered_units(policy)}


def _stream_check(seed: int, lora: bool) -> dict:
    """Stream a sharded policy's weights as the engine takes them; what was gathered at each tensor."""
    from fsdp_probe import gathered_now

    plain = _model(seed, lora)
    want = {k: v.to(torch.bfloat16) for k, v in merged_state_dict(plain).items()}
    policy = _shard(copy.deepcopy(plain), BF16_MIXED)
    most, names, equal = 0, [], True
    for name, tensor in streamed_weights(policy, torch.bfloat16):
        most = max(most, gathered_now(policy))
        names.append(name)
        equal &= tensor.dtype == torch.bfloat16 and torch.equal(tensor, want[name])
    return {"most": most, "names": names, "want": list(want), "equal": bool(equal),
            "units": _unit_sizes(policy), "after": gathered_now(policy)}


def _rollout(tok, texts: list[str]):
    from medsrl.rollout.base import RolloutBatch

    prompt = tok("Q: 1+1?")["input_ids"]
    ids = [tok(t)["input_ids"] + [2] for t in texts]
    return RolloutBatch(prompt_index=[0] * len(ids), prompt_ids=[prompt] * len(ids), response_ids=ids,
                        response_text=texts, finish_reason=["stop"] * len(ids))


def _forward_checks(rank: int) -> dict:
    """Rank 0 has three rows for the scoring pass and responses to featurise; rank 1 one row and
    none: its idle passes keep the collectives in step. Results against the plain model."""
    from fsdp_probe import gathered_now
    from medsrl.evaluation.response_features import response_features
    from medsrl.features.reader import FeatureSpec
    from medsrl.models.char_tokenizer import build_char_tokenizer
    from medsrl.rollout.base import pack_rollouts
    from medsrl.step.scoring import scoring_pass

    tok = build_char_tokenizer()
    plain = _model(3)
    policy = _shard(copy.deepcopy(plain), None)
    most = 0

    def sample(*_):
        nonlocal most
        most = max(most, gathered_now(policy))

    hooks = [m.register_forward_pre_hook(sample) for m in policy.modules() if type(m) in layer_classes(plain)]
    texts = ["2 \\boxed{2}", "so \\boxed{3}", "no box"][: 3 if rank == 0 else 1]
    rollout = _rollout(tok, texts)
    packed = pack_rollouts(rollout.prompt_ids, rollout.response_ids, 0)
    got, _ = scoring_pass(policy, packed, micro_batch_size=1)
    want, _ = scoring_pass(plain, packed, micro_batch_size=1)
    spec = FeatureSpec(layers="all")
    mine = rollout if rank == 0 else _rollout(tok, [])
    feats = response_features(policy, tok, mine, spec=spec, micro_batch_size=1)
    for h in hooks:
        h.remove()
    ref = response_features(plain, tok, mine, spec=spec, micro_batch_size=1)
    close = lambda a, b: all((x is None and y is None) or torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5)  # noqa: E731
                             for x, y in zip(a, b, strict=True))
    return {"logp_close": bool(torch.allclose(got, want, atol=1e-5)), "features": [f is not None for f in feats],
            "features_close": close(feats, ref), "most_in_forward": most, "units": _unit_sizes(policy)}


def _checks(rank: int) -> dict:
    return {"plain": _stream_check(1, lora=False), "lora": _stream_check(2, lora=True),
            "forward": _forward_checks(rank)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from gloo_ranks import on_gloo_ranks

    return on_gloo_ranks(_checks, tmp_path_factory.mktemp("sharding"))


@pytest.mark.parametrize("kind", ["plain", "lora"])
def test_the_weight_stream_gathers_one_unit_at_a_time_and_yields_the_merged_weights(ranks, kind):
    """The engine sync gathered the whole fp32 policy on every GPU at once (28.4 GiB at 7B); now
    at most one FSDP unit is gathered while a tensor is handed over (the root's weights, or one
    decoder layer with its adapters), and the tensors are the plain model's (LoRA merged), under
    its names, in the engine's dtype."""
    for r in ranks:
        got = r[kind]
        units = got["units"]
        adapters = sum(n for name, n in units.items() if "lora_" in name)
        layers = [n for name, n in units.items() if name != "root" and "lora_" not in name]
        assert sorted(got["names"]) == sorted(got["want"]) and len(got["names"]) == len(set(got["names"]))
        assert got["equal"]
        # exactly one unit at a time: the root, or a decoder layer with its adapters
        assert got["most"] == max(units["root"], max(layers) + adapters // len(layers))
        assert got["most"] < sum(units.values()) / 2  # never the whole policy
        assert got["after"] == 0  # nothing left gathered


def test_lora_merge_makes_one_module_at_a_time():
    """The LoRA sync built every delta and every merged weight before the engine saw one (an OOM
    at 7B with LoRA on all linears); the merge is a generator: the delta of a module is made only
    after the previous module's merged weight was handed over."""
    from peft.tuners.lora import LoraLayer

    model = _model(4, lora=True)
    events = []
    for module in model.modules():
        if isinstance(module, LoraLayer):
            own = module.get_delta_weight
            module.get_delta_weight = lambda a, own=own: events.append("delta") or own(a)
    merged = 0
    for name, _ in merged_weights(model, torch.bfloat16):
        if name.endswith("proj.weight"):
            events.append("yield")
            merged += 1
    assert merged == 7 * ARCH["num_hidden_layers"] and events == ["delta", "yield"] * merged
    assert dict(merged_weights(model)).keys() == merged_state_dict(model).keys()


def test_a_rank_with_fewer_rows_joins_the_others_forwards(ranks):
    """Scoring and the feature pass run through the FSDP wrapper (each forward a collective);
    rank 1 has fewer micro-batches, and no response at all to featurise: it runs idle passes, no
    rank hangs, and the results are the plain model's. A forward holds at most the root and one
    layer gathered, never the policy (the validation OOM: the fp32 policy gathered whole)."""
    a, b = ranks[0]["forward"], ranks[1]["forward"]
    assert a["logp_close"] and b["logp_close"]
    assert a["features"] == [True, True, False] and b["features"] == []
    assert a["features_close"] and b["features_close"]
    units = a["units"]
    layer = max(n for name, n in units.items() if name != "root")
    for r in (a, b):
        assert units["root"] + layer <= r["most_in_forward"] <= units["root"] + 2 * layer


@pytest.mark.parametrize("precision,device_autocast", [("bf16-mixed", True), ("32-true", False)])
def test_fsdp_autocast_runs_on_the_runs_device_without_the_weight_cast_cache(precision, device_autocast):
    """Lightning's FSDP precision plugin autocasts on CUDA only (a CPU run computed without
    autocast) and keeps autocast's weight-cast cache on: every fp32 weight a forward in
    ``training_step`` cast to bf16 stayed alive as a bf16 copy until the step's end (+14 GiB per
    GPU at 7B). The strategy's plugin autocasts on its own device with the cache off, as
    Lightning's AMP plugin does."""
    import lightning as L

    from medsrl.models.sharding import PolicyFSDPPrecision, PolicyFSDPStrategy

    trainer = L.Trainer(strategy=PolicyFSDPStrategy(use_orig_params=True), accelerator="cpu", devices=1,
                        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, PolicyFSDPPrecision) and plugin.precision == precision
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") == device_autocast
        if device_autocast:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert not torch.is_autocast_cache_enabled()
            weight = torch.nn.Parameter(torch.randn(4, 4))
            assert torch.nn.functional.linear(torch.randn(2, 4), weight).dtype == torch.bfloat16
    assert trainer.strategy.mixed_precision_config.param_dtype == (torch.bfloat16 if device_autocast else torch.float32)
