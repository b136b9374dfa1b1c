"""Checkpoints to Hugging Face folders (``medsrl-export``) and into ``medsrl-eval``: a single-file
``.ckpt`` and a sharded checkpoint directory (DCP, as FSDP writes it with ``state_dict_type:
sharded``), full weights and LoRA adapters; each export loads with ``from_pretrained`` to the logits
of the model the checkpoint came from. The checkpoints are written here in Lightning's layouts
(``models/checkpoint_files.py``); the last test takes one from a real 2-rank FSDP run."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from gloo_ranks import on_gloo_ranks
from medsrl.export import export_checkpoint, main
from medsrl.models import lora
from medsrl.models.checkpoint_files import (
    CheckpointError,
    is_sharded_checkpoint,
    load_checkpoint_policy,
    stored_policy_shapes,
)
from medsrl.models.loading import load_tokenizer
from medsrl.models.policy import build_policy
from medsrl.models.settings import ModelConfig
from run_helpers import ROOT, read_metrics, train_in_subprocess

# debug=fast's micro model; an odd intermediate size so a 2-rank split of dim 0 is uneven
TINY = {"tokenizer": "char", "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                      "num_key_value_heads": 1, "intermediate_size": 63}}
LORA = {**TINY, "lora": {"r": 4, "alpha": 8.0}}
INPUT = torch.tensor([[5, 17, 30, 41, 9, 12, 60, 3]])


def trained_policy(model: dict, precision: str = "32-true") -> torch.nn.Module:
    """The run's model as it would be after training: every trained weight moved off the one
    ``build_policy`` rebuilds (the LoRA base stays; its adapters' B, zero at start, become non-zero)."""
    policy, _ = build_policy(ModelConfig(**model), precision=precision)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in policy.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return policy.eval()


def module_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``RLModule.state_dict`` checkpoints of ``policy``: ``policy.<name>``, the adapters alone with LoRA."""
    state = lora.checkpoint_state(policy.state_dict(), lora.is_lora(policy))
    return {f"policy.{k}": v for k, v in state.items()}


def new_run(root: Path, model: dict, precision: str = "32-true") -> Path:
    """A run directory with its Hydra config (the model section is what the export reads)."""
    (root / ".hydra").mkdir(parents=True)
    OmegaConf.save({"model": model, "trainer": {"max_steps": 2, "precision": precision}},
                   root / ".hydra" / "config.yaml")
    (root / "checkpoints").mkdir()
    return root


def save_single_file(run: Path, policy: torch.nn.Module) -> Path:
    """A Lightning single-file checkpoint: the module's state beside AdamW states and loop state."""
    ckpt = run / "checkpoints" / "step_000002.ckpt"
    moments = {i: {"exp_avg": torch.randn(p.shape), "exp_avg_sq": torch.rand(p.shape)}
               for i, p in enumerate(q for q in policy.parameters() if q.requires_grad)}
    torch.save({"state_dict": module_state(policy), "global_step": 2,
                "optimizer_states": [{"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]}]},
               ckpt)
    return ckpt


def save_sharded_one_process(run: Path, policy: torch.nn.Module, module_key: str) -> Path:
    """A sharded checkpoint as Lightning lays it out (``module_key``: ``state_dict`` FSDP2,
    ``model`` FSDP1), written by one process: one ``.distcp`` file, ``.metadata``, ``meta.pt``."""
    import torch.distributed.checkpoint as dcp

    ckpt = run / "checkpoints" / "step_000002.ckpt"
    moments = {f"policy.{k}": {"exp_avg": torch.randn(v.shape)}
               for k, v in policy.named_parameters() if v.requires_grad}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled", category=UserWarning)
        dcp.save({module_key: module_state(policy), "optimizer_0": {"state": moments}}, checkpoint_id=ckpt,
                 no_dist=True)
    torch.save({"global_step": 2, "hyper_parameters": {}}, ckpt / "meta.pt")
    return ckpt


def _save_on_rank(rank: int, ckpt: str) -> dict:
    """One of 2 ranks writing its half of every tensor (dim 0, as FSDP2 shards), and of AdamW's
    states, to one DCP directory, as ``ModelParallelStrategy.save_checkpoint`` does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    policy = trained_policy(TINY)
    shard = lambda t: distribute_tensor(t.detach().clone(), mesh, [Shard(0)])  # noqa: E731
    state = {k: shard(v) for k, v in module_state(policy).items()}
    moments = {k: {"exp_avg": shard(torch.randn(v.shape)), "exp_avg_sq": shard(torch.rand(v.shape))}
               for k, v in state.items()}
    dcp.save({"state_dict": state, "optimizer_0": {"state": moments}}, checkpoint_id=ckpt)
    if rank == 0:
        torch.save({"global_step": 2, "hyper_parameters": {}}, Path(ckpt) / "meta.pt")
    return {"local_rows": state["policy.model.layers.0.mlp.gate_proj.weight"].to_local().shape[0]}


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def assert_same_logits(exported: Path, policy: torch.nn.Module) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(exported).eval()
    torch.testing.assert_close(logits(loaded), logits(policy))


def test_a_single_file_checkpoint_exports_to_the_logits_it_was_saved_with(tmp_path):
    policy = trained_policy(TINY)
    ckpt = save_single_file(new_run(tmp_path / "run", TINY), policy)
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert_same_logits(out, policy)
    assert not torch.allclose(logits(build_policy(ModelConfig(**TINY))[0]), logits(policy))  # trained away from it

    half = export_checkpoint(ckpt, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(half, dtype="auto")
    assert next(loaded.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(loaded.state_dict()["model.embed_tokens.weight"],
                               policy.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16))


def test_a_two_rank_sharded_checkpoint_exports_and_evaluates_without_reading_the_optimizer(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemReader

    from medsrl.eval import load_for_eval

    run = new_run(tmp_path / "run", TINY)
    ckpt = run / "checkpoints" / "step_000002.ckpt"
    (tmp_path / "gloo").mkdir()
    ranks = on_gloo_ranks(functools.partial(_save_on_rank, ckpt=str(ckpt)), tmp_path / "gloo")
    assert [r["local_rows"] for r in ranks] == [32, 31]  # uneven halves of 63 rows
    assert is_sharded_checkpoint(ckpt) and len(list(ckpt.glob("*.distcp"))) == 2
    policy = trained_policy(TINY)
    assert stored_policy_shapes(ckpt) == {k.removeprefix("policy."): tuple(v.shape)
                                          for k, v in module_state(policy).items()}

    read: list[str] = []
    real_read = FileSystemReader.read_data

    def spy(self, plan, planner):
        read.extend(item.dest_index.fqn for item in plan.items)
        return real_read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    main([str(ckpt), str(tmp_path / "hf")])
    assert read and all(fqn.startswith("state_dict.policy.") for fqn in read)  # never optimizer_0
    assert_same_logits(tmp_path / "hf", policy)

    evaluated, tok = load_for_eval(str(ckpt), None, "float32")
    torch.testing.assert_close(logits(evaluated.eval()), logits(policy))
    assert tok.get_vocab() == load_tokenizer(str(tmp_path / "hf")).get_vocab()  # the run's, exported with it


@pytest.mark.parametrize("module_key", ["state_dict", "model"])
def test_a_sharded_lora_checkpoint_exports_merged_or_as_the_adapter(tmp_path, module_key):
    from peft import PeftModel

    policy = trained_policy(LORA)
    ckpt = save_sharded_one_process(new_run(tmp_path / "run", LORA), policy, module_key)
    assert all(lora.is_adapter_key(k) for k in stored_policy_shapes(ckpt))  # the adapters alone

    merged = export_checkpoint(ckpt, tmp_path / "merged")
    assert not (merged / "adapter_config.json").exists()
    assert_same_logits(merged, policy)

    adapter = export_checkpoint(ckpt, tmp_path / "adapter", merge=False)
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    base, _ = build_policy(ModelConfig(**TINY))
    reloaded = PeftModel.from_pretrained(base, adapter).eval()
    torch.testing.assert_close(logits(reloaded), logits(policy))


def test_a_lora_checkpoint_is_rebuilt_on_the_base_dtype_of_its_run_s_precision(tmp_path):
    """Under bf16-mixed a LoRA run's frozen base is bf16 (model.lora.base_dtype: compute): its adapters
    are loaded onto that base, which the export then merges them into, as the run's own export does."""
    policy = trained_policy(LORA, precision="bf16-mixed")
    ckpt = save_single_file(new_run(tmp_path / "run", LORA, precision="bf16-mixed"), policy)
    loaded, _ = load_checkpoint_policy(ckpt)
    dtypes = {n: p.dtype for n, p in loaded.named_parameters()}
    assert {d for n, d in dtypes.items() if lora.is_adapter_key(n)} == {torch.float32}
    assert {d for n, d in dtypes.items() if not lora.is_adapter_key(n)} == {torch.bfloat16}
    torch.testing.assert_close(logits(loaded.eval()), logits(policy))
    merged = export_checkpoint(ckpt, tmp_path / "hf")
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"
    want = lora.merged_state_dict(policy)
    got = AutoModelForCausalLM.from_pretrained(merged, dtype="auto").state_dict()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_a_lora_checkpoint_of_a_warm_started_run_is_loaded_onto_that_warm_start(tmp_path, micro_cache):
    """The tiny preset's LoRA run trains adapters on the warm-started model in the run's cache, not on
    the random one its config names (name_or_path null): the export must merge onto the former."""
    from medsrl.warmstart import warm_started

    warm = {"steps": 300, "batch_size": 32, "lr": 1.0e-2, "warmup_steps": 10, "num_examples": 2000,
            "eval_examples": 8, "eval_max_new_tokens": 48, "system_prompt": None}  # run_helpers.MICRO_WARM_START
    model = {**LORA, "tiny": {**TINY["tiny"], "intermediate_size": 64}, "warm_start": warm}
    run = new_run(tmp_path / "run", model)
    OmegaConf.save({"model": model, "paths": {"cache_dir": str(micro_cache)}}, run / ".hydra" / "config.yaml")
    started = warm_started(ModelConfig(**model), micro_cache)
    assert started.name_or_path is not None
    policy = trained_policy(started.model_dump())
    ckpt = save_single_file(run, policy)
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert_same_logits(out, policy)


def test_what_is_not_a_usable_checkpoint_is_refused_naming_the_path(tmp_path, capsys):
    not_ckpt = tmp_path / "run" / "checkpoints" / "step_000002.ckpt"
    not_ckpt.mkdir(parents=True)
    (not_ckpt / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(f"{not_ckpt}: a directory but not a sharded checkpoint")):
        export_checkpoint(not_ckpt, tmp_path / "out")
    with pytest.raises(SystemExit, match=re.escape(f"medsrl-export: {not_ckpt}: a directory")):
        main([str(not_ckpt), str(tmp_path / "out")])
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out")

    orphan = tmp_path / "orphan" / "checkpoints" / "last.ckpt"
    orphan.parent.mkdir(parents=True)
    save_sharded_one_process(tmp_path / "orphan", trained_policy(TINY), "state_dict")
    (orphan.parent / "step_000002.ckpt").rename(orphan)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "orphan" / ".hydra" / "config.yaml"))):
        export_checkpoint(orphan, tmp_path / "out")

    other = {**TINY, "tiny": {**TINY["tiny"], "hidden_size": 64}}
    for save in (save_single_file, functools.partial(save_sharded_one_process, module_key="model")):
        run = new_run(tmp_path / f"other_{save is save_single_file}", other)
        ckpt = save(run, trained_policy(TINY))
        shapes = r"policy's shapes: model\.embed_tokens\.weight: stored \[\d+, 32\], model \[\d+, 64\]"
        with pytest.raises(CheckpointError, match=shapes):
            load_checkpoint_policy(ckpt)
    full_into_lora = new_run(tmp_path / "lora_run", LORA)
    ckpt = save_single_file(full_into_lora, trained_policy(TINY))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt)) + " .*holds full weights"):
        load_checkpoint_policy(ckpt)

    good = save_single_file(new_run(tmp_path / "good", TINY), trained_policy(TINY))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match=re.escape(f"{tmp_path / 'full'}: exists")):
        export_checkpoint(good, tmp_path / "full")


@pytest.mark.slow
def test_a_two_rank_fsdp_run_s_sharded_checkpoint_exports_and_evaluates(tmp_path):
    """The issue's reproduction: a 2-step 2-rank ``trainer=fsdp`` run on the CPU with sharded
    checkpoints, then ``medsrl-export`` and ``medsrl-eval`` on its checkpoint directory (and the
    run through ``runs_dir=``). The export holds the weights the run exported itself at the end."""
    from hydra import compose, initialize_config_dir
    from safetensors.torch import load_file

    from medsrl.eval import evaluate

    run = tmp_path / "run"
    train_in_subprocess(run, tmp_path / "cache", [
        "debug=fast", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true",
        "trainer.max_steps=2", "trainer.strategy.state_dict_type=sharded", "export_policy=true"], timeout_s=600)
    ckpt = run / "checkpoints" / "step_000002.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == 2
    assert read_metrics(run).keys() >= {1}

    out = tmp_path / "hf"
    done = subprocess.run([str(Path(sys.executable).parent / "medsrl-export"), str(ckpt), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    exported, final = load_file(out / "model.safetensors"), load_file(run / "policy" / "model.safetensors")
    assert exported.keys() == final.keys()
    for name in final:
        torch.testing.assert_close(exported[name], final[name], rtol=0, atol=0, msg=name)
    assert_same_logits(out, AutoModelForCausalLM.from_pretrained(run / "policy").eval())

    def eval_cfg(out_dir: Path, *models: str):
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            return compose("eval", overrides=[f"paths.output_dir={out_dir}", "benchmark.arithmetic.num=4", "n=2",
                                              "max_new_tokens=16", "batch_size=8", "template.system_prompt=null",
                                              *models])

    rows = evaluate(eval_cfg(tmp_path / "eval", f"model_path=[{ckpt},{run / 'policy'},{out}]"))
    assert [r["run"] for r in rows] == ["run/step_000002", "run", "hf"]
    texts = sampled_texts(tmp_path / "eval")
    assert texts["run/step_000002"] == texts["run"] == texts["hf"] and texts["run"]  # the same weights, samples
    row = lambda r: json.dumps({k: v for k, v in r.items() if k != "run"}, sort_keys=True)  # noqa: E731 (NaN-safe)
    assert row(rows[0]) == row(rows[1])  # and the same MEDS feature (its run's; "hf" is outside the run)
    (run / "policy").rename(tmp_path / "moved_policy")  # runs_dir then finds checkpoints/last.ckpt
    by_dir = evaluate(eval_cfg(tmp_path / "eval_dir", f"runs_dir={tmp_path}"))
    assert len(by_dir) == 1 and by_dir[0]["run"].startswith("run: ") and "trainer=fsdp" in by_dir[0]["run"]
    assert sampled_texts(tmp_path / "eval_dir")[by_dir[0]["run"]] == texts["run"]
    assert row(by_dir[0]) == row(rows[0])


def sampled_texts(eval_dir: Path) -> dict[str, list[str]]:
    """{row name: every sampled response's text, in order} from an evaluation's generations.jsonl."""
    texts: dict[str, list[str]] = {}
    for line in (eval_dir / "generations.jsonl").read_text().splitlines():
        record = json.loads(line)
        texts.setdefault(record["run"], []).extend(r["text"] for r in record["responses"])
    return texts
