"""The plan's arithmetic against what a CPU measures, at Qwen2.5-Math-1.5B's real width.

Measured here: the bytes of weights, gradients and AdamW's states and temporaries (allocator
events, ``utils/memory_tracking.py``), the tensors one decoder layer saves for backward under bf16
autocast over fp32 weights (saved-tensor hooks), the KV cache HF keeps under that autocast, and
the fused log-prob head's buffers at a 151,936-token vocabulary, with its backward's ``[V, H]``
weight-gradient buffers. The plan must agree; what a CPU cannot show (the CUDA runtime,
fragmentation, vLLM) stays computed and says so.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from medsrl.algo.logprobs import head_logprobs
from medsrl.models.loading import random_model_like
from medsrl.plan.gpu_bytes import (
    RunShape,
    head_chunk_bytes,
    kv_cache_bytes,
    layer_saved_bytes,
    plan_memory,
)
from medsrl.plan.model_size import size_of
from medsrl.utils.memory_tracking import track_memory

# Qwen2.5-Math-1.5B's widths (configs/model/qwen2.5-math-1.5b.yaml)
WIDTH = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "intermediate_size": 8960}
VOCAB = 151_936


@functools.cache
def _layer() -> Qwen2DecoderLayer:
    torch.manual_seed(0)
    return Qwen2DecoderLayer(Qwen2Config(vocab_size=VOCAB, **WIDTH), 0)


@functools.cache
def _size():
    """The plan's sizes of a 2-layer model of that width (narrow vocabulary: only the widths are read)."""
    return size_of(random_model_like("qwen2", 1000, num_hidden_layers=2, **WIDTH))


def _run(**kw) -> RunShape:
    base = dict(devices=1, sharded=False, ddp=False, master_bytes=4, compute_bytes=2, gradient_checkpointing=True,
                backend="hf", sequences_per_rank=8, prompt_tokens=16, response_tokens=48, generate_rows=8,
                micro_batch=2, reference_model=False, vllm_fraction=None, vllm_kv_bytes=None,
                vllm_weight_bytes=2, vllm_sleep=False, gpu_bytes=None, on_gpu=False)
    return RunShape(**{**base, **kw})


def _item(plan, phase: str, name: str) -> int:
    (item,) = [i for p in plan.phases if p.name == phase for i in p.items if i.name == name]
    return item.bytes


def test_gradients_adamw_states_and_temporaries_are_what_the_allocator_sees():
    layer = _layer()
    params = list(layer.parameters())
    numel = sum(p.numel() for p in params)
    x = torch.randn(1, 4, WIDTH["hidden_size"])
    pos = torch.arange(4).unsqueeze(0)
    rope = _rope(x, pos)
    with track_memory(vocab_size=-1) as backward:
        layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope).sum().backward()
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=True)  # what CUDA tensors get by default
    with track_memory(vocab_size=-1) as first_step:
        opt.step()
    # the plan of a model made of this one layer
    plan = plan_memory(_size_with(numel), _run())
    assert backward.net_bytes == pytest.approx(_item(plan, "update", "gradients"), rel=0.01)
    assert first_step.net_bytes == pytest.approx(_item(plan, "optimizer step", "AdamW moments"), rel=0.01)
    temporaries = first_step.peak_bytes - first_step.net_bytes
    assert temporaries == pytest.approx(_item(plan, "optimizer step", "AdamW temporaries"), rel=0.01)
    for p in params:
        p.grad = None


def _size_with(params: int):
    return replace(_size(), params=params)


def _rope(x, pos):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return Qwen2RotaryEmbedding(_layer().self_attn.config)(x, pos)


def test_one_layers_saved_activations_and_weight_casts_match_the_plan():
    """Under bf16 autocast over fp32 weights (bf16-mixed on one GPU), no checkpointing."""
    layer, size = _layer(), _size()
    b, t = 2, 64
    x = torch.randn(b, t, WIDTH["hidden_size"], requires_grad=True)
    pos = torch.arange(t).unsqueeze(0).expand(b, -1)
    rope = _rope(x, pos)
    param_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    param_shapes = {tuple(p.shape) for p in layer.parameters()} | {tuple(p.shape[::-1]) for p in layer.parameters()}
    saved: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = (storage.nbytes(), tuple(tensor.shape))
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope)
    casts = sum(n for n, shape in saved.values() if shape in param_shapes)
    activations = sum(n for n, shape in saved.values() if shape not in param_shapes)
    matrices = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    assert casts == pytest.approx(2 * matrices, rel=0.01)  # every weight matrix, as bf16
    assert activations == pytest.approx(layer_saved_bytes(size, b * t, 2), rel=0.15)


def test_hf_kv_cache_is_fp32_under_autocast_over_fp32_weights():
    model = random_model_like("qwen2", 1000, num_hidden_layers=2, **WIDTH)
    rows, t = 3, 20
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        out = model(input_ids=torch.randint(0, 1000, (rows, t)), use_cache=True)
    layers = out.past_key_values.layers
    assert {lay.keys.dtype for lay in layers} == {lay.values.dtype for lay in layers} == {torch.float32}
    measured = sum(lay.keys.nbytes + lay.values.nbytes for lay in layers)
    assert measured == kv_cache_bytes(size_of(model), rows, t, 4)
    plan = plan_memory(size_of(model), _run(prompt_tokens=t, response_tokens=0, generate_rows=rows))
    # the plan adds one layer for the copy the cache's growth makes
    assert _item(plan, "generation", "KV cache") == measured * 3 // 2


@pytest.mark.parametrize("grad", [False, True], ids=["scoring", "update"])
def test_fused_head_buffers_at_a_151936_token_vocabulary_match_the_plan(grad):
    hidden, chunk, n = 64, 256, 1024
    size = _size()
    h = torch.randn(n, hidden, requires_grad=grad)
    w = (torch.randn(VOCAB, hidden) * 0.02).requires_grad_(grad)
    y = torch.randint(0, VOCAB, (n,))
    plan_bytes = head_chunk_bytes(size, chunk, 4, backward=grad) * VOCAB // size.vocab_size
    with torch.set_grad_enabled(grad), track_memory(vocab_size=VOCAB) as mem:
        logp = head_logprobs(h, w, None, y, chunk_tokens=chunk).logp
        if grad:
            logp.sum().backward()
    # measured: the peak above what the block leaves (log-probs, and the gradients of h and w)
    working = mem.peak_bytes - mem.net_bytes
    assert mem.largest_vocab_numel <= chunk * VOCAB
    assert 0.5 * plan_bytes <= working <= 1.1 * plan_bytes, (working, plan_bytes)


@pytest.mark.parametrize("sharded", [False, True], ids=["fp32 master weight", "FSDP bf16 gathered weight"])
def test_fused_head_weight_gradient_buffers_match_the_plan(sharded):
    """The backward of the fused head under bf16 autocast, at a 151,936-token vocabulary: the
    fp32 sum and each chunk's bf16 product alive together, then the sum returned (as itself for
    an fp32 weight; cast for FSDP's bf16 gathered one). The plan counts product and cast both,
    an upper bound: the last product is freed before the cast is made."""
    hidden, n, chunk = 512, 32, 16
    size = replace(_size(), vocab_size=VOCAB, hidden_size=hidden)
    items = {i.name: i.bytes for p in plan_memory(size, _run(sharded=sharded, devices=2 if sharded else 1)).phases
             if p.name == "update" for i in p.items}
    acc, product, cast = items["head grad accumulator"], items["head grad product"], items.get("head grad cast", 0)
    assert (cast > 0) == sharded
    dtype = torch.bfloat16 if sharded else torch.float32
    torch.manual_seed(0)
    w = (torch.randn(VOCAB, hidden) * 0.02).to(dtype).requires_grad_(True)
    h = torch.randn(n, hidden, dtype=dtype)  # FSDP: the final norm's output in bf16
    y = torch.randint(0, VOCAB, (n,))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        logp = head_logprobs(h, w, None, y, chunk_tokens=chunk).logp
    with track_memory(vocab_size=VOCAB) as mem:
        logp.sum().backward()
    # what the backward leaves is the weight's gradient: the fp32 sum itself, or its bf16 cast
    assert mem.net_bytes == pytest.approx(cast if sharded else acc, rel=0.01)
    # CPU only: adding the bf16 product into the fp32 sum first copies it to fp32 (TensorIterator
    # promotes CPU inputs by a temporary; CUDA kernels cast as they read: not in the plan)
    promotion = VOCAB * hidden * 4
    head_cast = 0 if sharded else VOCAB * hidden * 2  # autocast's cast of the fp32 head ("bf16 weight casts")
    expected = max(acc + product + head_cast + promotion, acc + cast)
    chunk_set = head_chunk_bytes(size, chunk, 2, backward=True)
    assert expected <= mem.peak_bytes <= expected + chunk_set, (mem.peak_bytes, expected)
