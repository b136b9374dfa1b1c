"""The FSDP2 policy on 2 gloo ranks: the weight stream to the engine gathers one parameter at a
time in the engine's dtype, the forwards that run through the units (scoring, features) let a rank
with fewer rows, or none, join the others' passes instead of hanging them, and a rank that built
its policy on the ``meta`` device gets rank 0's weights. One spawn runs every check (the process
start dominates; ``tests/helpers/gloo_ranks.py``)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from medsrl.models.lora import apply_lora, merged_state_dict, merged_weights
from medsrl.models.settings import LoraSettings
from medsrl.models.sharding import layer_classes, shard_policy, streamed_weights
from medsrl.models.tiny import tiny_qwen2_config

ARCH = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=128)
BF16_MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


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


def _shard(model, mixed: MixedPrecisionPolicy | None):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    strategy = SimpleNamespace(shard_mesh=mesh, mixed_precision_policy=mixed or MixedPrecisionPolicy(),
                               offload_policy=OffloadPolicy(), reshard_after_forward=True,
                               root_device=torch.device("cpu"))
    return shard_policy(model, strategy)


def _unit_sizes(policy) -> dict[str, int]:
    from fsdp_probe import gathered_units

    return {name: n for name, n, _ in gathered_units(policy)}


def _stream_check(seed: int, lora: bool) -> dict:
    """Stream a sharded policy's weights as the engine takes them, recording each gather (a
    ``full_tensor``: its dtype and size) between the tensors handed over."""
    from torch.distributed.tensor import DTensor

    from fsdp_probe import gathered_now

    plain = _model(seed, lora)
    want = {k: v.to(torch.bfloat16) for k, v in merged_state_dict(plain).items()}
    policy = _shard(copy.deepcopy(plain), BF16_MIXED)
    events, names, equal = [], [], True
    own = DTensor.full_tensor

    def recorded(self, *args, **kwargs):
        events.append(("gather", str(self.dtype), self.numel()))
        return own(self, *args, **kwargs)

    DTensor.full_tensor = recorded
    try:
        for name, tensor in streamed_weights(policy, torch.bfloat16):
            events.append(("yield", name, tensor.numel()))
            names.append(name)
            equal &= tensor.dtype == torch.bfloat16 and torch.equal(tensor, want[name])
    finally:
        DTensor.full_tensor = own
    return {"events": events, "names": names, "want": list(want), "equal": bool(equal),
            "units": _unit_sizes(policy), "gathered_after": gathered_now(policy)}


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

    layers = tuple(layer_classes(plain))
    hooks = [m.register_forward_pre_hook(sample) for m in policy.modules() if isinstance(m, layers)]
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


def _meta_check(rank: int) -> dict:
    """Rank 0 builds the policy with its weights, rank 1 on the meta device: after sharding, both
    hold rank 0's weights (the plain model HF generation reads is rank 0's model), and a step's
    gradients are gone after ``zero_grad`` (FSDP1 kept its sharded gradient to the next forward)."""
    from medsrl.models.sharding import full_weights

    plain = _model(5, lora=True)
    if rank == 0:
        built = copy.deepcopy(plain)
    else:
        with torch.device("meta"):
            built = _model(6, lora=True)
    policy = _shard(built, None)
    ids = torch.tensor([[1, 5, 7, 9]])
    want = plain(input_ids=ids).logits
    with full_weights(policy) as twin:
        same_twin = torch.allclose(twin(input_ids=ids).logits, want, atol=1e-5)
        twin_plain = type(twin).__name__
    same_sharded = torch.allclose(policy(input_ids=ids).logits, want, atol=1e-5)
    optim = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    policy(input_ids=ids).logits.float().square().mean().backward()
    had = sum(p.grad is not None for p in policy.parameters())
    optim.step()
    optim.zero_grad()
    return {"same_twin": bool(same_twin), "same_sharded": bool(same_sharded), "twin": twin_plain, "had": had,
            "left": sum(p.grad is not None for p in policy.parameters()),
            "rope": bool(torch.equal(policy.base_model.model.model.rotary_emb.inv_freq,
                                     plain.base_model.model.model.rotary_emb.inv_freq))}


def _checks(rank: int) -> dict:
    return {"plain": _stream_check(1, lora=False), "lora": _stream_check(2, lora=True),
            "forward": _forward_checks(rank), "meta": _meta_check(rank)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from gloo_ranks import on_gloo_ranks

    return on_gloo_ranks(_checks, tmp_path_factory.mktemp("sharding"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "lora"])
def test_the_weight_stream_gathers_one_parameter_at_a_time_in_bf16_and_yields_the_merged_weights(ranks, kind):
    """The engine sync gathered a whole fp32 FSDP1 unit at a time (a decoder layer, or the root with
    the embeddings and LM head); FSDP2's stream gathers one parameter at a time, cast to the
    engine's bf16 before the gather (half the bytes), and hands it over before the next gather. A
    LoRA layer's weight is merged from its gathered base and adapters. The tensors are the plain
    model's (LoRA merged), under its names."""
    for r in ranks:
        got = r[kind]
        assert sorted(got["names"]) == sorted(got["want"]) and len(got["names"]) == len(set(got["names"]))
        assert got["equal"]
        assert got["gathered_after"] == 0  # no unit left unsharded
        pending = []  # the gathers since the last tensor handed over
        for event in got["events"]:
            if event[0] == "gather":
                pending.append(event)
                continue
            _, name, numel = event
            if kind == "plain" or "proj.weight" not in name:
                # one gather of exactly this tensor, in bf16
                assert pending == [["gather", "torch.bfloat16", numel]], (name, pending)
            else:  # base weight, lora_A, lora_B: gathered in their own (fp32) dtype, then merged
                assert len(pending) == 3 and pending[0][2] == numel, (name, pending)
            pending = []
        layers = [n for name, n in got["units"].items() if name != "root"]
        assert len(layers) == ARCH["num_hidden_layers"]  # adapters inside their layer's unit


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_rank_built_on_meta_gets_rank0s_weights_and_gradients_go_at_zero_grad(ranks):
    """One load per node: only rank 0 reads the weights (244 GB of host RAM at 7B on 8 ranks when
    each loaded); rank 1 built on the meta device gets its shards and RoPE buffers from rank 0.
    HF generation reads a plain, adapter-free model with the merged weights. Gradients are freed
    at zero_grad (+3.5 GiB a GPU at 7B under FSDP1 during the weight sync)."""
    for r in ranks:
        got = r["meta"]
        assert got["same_sharded"] and got["same_twin"] and got["rope"]
        assert got["twin"] == "Qwen2ForCausalLM"  # no PEFT layers in the generation model
        assert got["had"] > 0 and got["left"] == 0


@pytest.mark.parametrize("precision,device_autocast", [("bf16-mixed", True), ("32-true", False)])
def test_fsdp_computes_in_bf16_over_fp32_shards_under_an_autocast_on_the_runs_device(precision, device_autocast):
    """``trainer=fsdp`` is FSDP2 through Lightning's ``ModelParallelStrategy``: under bf16-mixed the
    units gather bf16 and reduce gradients in fp32, and the step runs under Lightning's AMP
    autocast on the run's own device with the weight-cast cache off (FSDP1's Lightning plugin
    autocast on CUDA only and kept the cache: +14 GiB per GPU at 7B). FSDP1's settings fail,
    naming their replacement."""
    import lightning as L

    from medsrl.models.sharding import PolicyFSDPStrategy

    trainer = L.Trainer(strategy=PolicyFSDPStrategy(), accelerator="cpu", devices=1,
                        precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    plugin = trainer.precision_plugin
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") == device_autocast
        if device_autocast:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert not torch.is_autocast_cache_enabled()
    policy = trainer.strategy.mixed_precision_policy
    low = torch.bfloat16 if device_autocast else None
    assert (policy.param_dtype, policy.reduce_dtype) == (low, torch.float32 if low else None)
    with pytest.raises(ValueError, match="reshard_after_forward"):
        PolicyFSDPStrategy(sharding_strategy="SHARD_GRAD_OP")
