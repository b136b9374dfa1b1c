"""Rollouts with an in-process (colocated) vLLM engine, fed the policy's weights in place.

The engine starts from the policy's config and tokenizer only (``load_format="dummy"``); the
weights are streamed by reference, one tensor at a time, into the worker's layerwise
``reload_weights`` (nothing as large goes to disk, so the engine must be in this process). A sync
that leaves an engine parameter unloaded fails (vLLM only warns; after a level-2 sleep it holds
garbage). Every response is its own request (vLLM refuses ``n > 1`` when greedy; the prefix cache
runs a shared prompt once); vLLM samples from NaN logits without complaint, so the sampled
log-probs are always checked. vLLM keeps its parallel state in process globals: one engine a process.

Sleep mode as vLLM 0.32.0 runs it (``tests/helpers/fake_vllm.py`` follows it): a sync wakes the
weights alone, sampling the KV cache too, :meth:`VLLMRolloutEngine.release` sleeps at level 2.
docs/GPU.md has the rest (sleep mode, ``external_launcher`` under DDP / FSDP).
"""

from __future__ import annotations

import logging
import os
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from medsrl.models.sharding import streamed_weights
from medsrl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutBatch,
    SamplingParams,
    resolve_stop_ids,
    tokenize_prompts,
)
from medsrl.utils.distributed import is_distributed, rank_and_size
from medsrl.utils.guard import LIKELY_CAUSES, NONFINITE_SAMPLING, RunawayError

log = logging.getLogger(__name__)

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
SLEEP_TAGS = ("weights", "kv_cache")
ROTARY_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
SEED_STRIDE = 2**20  # more than any n: responses of one prompt get consecutive seeds
_live: weakref.ref | None = None  # the process's one open engine


def _drop_rotary_warning(record: logging.LogRecord) -> bool:
    """The rotary cos/sin cache is computed, not loaded: every reload restores it and warns."""
    return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


def _load_into_worker(worker: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> tuple[str, list[str]]:
    """Runs inside the vLLM worker: copy ``weights`` into its model in place. Returns the API used
    and the parameters no weight reached (vLLM's own check only warns)."""
    model = worker.model_runner.get_model()
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] | None = set()
    load = model.load_weights

    def recording(ws):
        nonlocal loaded
        names = load(ws)
        loaded = None if names is None or loaded is None else loaded | set(names)
        return names

    model.load_weights = recording  # what reload_weights calls, for the names it returns
    try:
        reload = getattr(worker, "reload_weights", None)
        if reload is not None:
            reload(weights_iterator=weights)
        else:
            recording(weights)
    finally:
        del model.load_weights  # the class's own again
    api = "reload_weights" if reload is not None else "load_weights"
    return api, [] if loaded is None else sorted(expected - loaded)


def _seed_worker(worker: Any, seed: int) -> None:
    """Runs inside the vLLM worker: its sampler draws unseeded requests from the default generators."""
    torch.manual_seed(seed)


def _sampled_logprobs(completion: Any) -> list[float]:
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no log-probs although they were asked for")
    pairs = zip(completion.token_ids, completion.logprobs, strict=True)
    return [float(step[tok].logprob) for tok, step in pairs]


def _multi_process_options(tensor_parallel_size: int) -> dict[str, Any]:
    if not is_distributed():
        return {}
    if tensor_parallel_size != 1:
        raise ValueError("rollout.vllm.tensor_parallel_size must be 1 with several training processes: each "
                         "rank's engine serves its own prompts (tensor parallelism would need the ranks of a "
                         "group to share them)")
    # external_launcher reads these (torchrun sets them; Lightning's own launcher may not)
    os.environ.setdefault("RANK", str(rank_and_size()[0]))
    local = torch.cuda.current_device() if torch.cuda.is_available() else 0
    os.environ.setdefault("LOCAL_RANK", str(local))
    return {"distributed_executor_backend": "external_launcher"}


def _engine_dtype(dtype: str, model: torch.nn.Module) -> tuple[str, torch.dtype | None]:
    """The name and torch dtype (None if it names none); ``auto`` means the policy's dtype (vLLM's own
    ``auto`` would run a float32 model in 16 bits)."""
    name = str(next(model.parameters()).dtype).removeprefix("torch.") if dtype == "auto" else dtype
    torch_dtype = getattr(torch, name, None)
    return name, torch_dtype if isinstance(torch_dtype, torch.dtype) else None


def _process_group_up() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class VLLMRolloutEngine:
    """A :class:`~medsrl.rollout.base.RolloutEngine` backed by an in-process ``vllm.LLM``."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, *,
                 gpu_memory_utilization: float = 0.5, kv_cache_memory_bytes: int | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False, enable_sleep_mode: bool = False,
                 dtype: str = "auto", max_model_len: int | None = None, per_request_seeds: bool = False,
                 seed: int = 0) -> None:
        os.environ.setdefault(IN_PROCESS_ENV, "0")
        if os.environ[IN_PROCESS_ENV] != "0":
            raise ValueError(f"VLLMRolloutEngine syncs weights in process: set {IN_PROCESS_ENV}=0")
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ImportError("rollout.backend=vllm needs vllm: pip install -e '.[vllm]' (GPU), or the CPU build "
                              "in .venv-vllm (make test-vllm)") from e

        options = dict(kv_cache_memory_bytes=kv_cache_memory_bytes, max_model_len=max_model_len)
        options.update(_multi_process_options(tensor_parallel_size))

        global _live
        previous = _live() if _live is not None else None
        if previous is not None and not previous.closed:
            log.info("closing the previous vLLM engine: one per process")
            previous.close()
        sleep_mode = bool(enable_sleep_mode) and current_platform.is_sleep_mode_available()
        if enable_sleep_mode and not sleep_mode:
            log.info("rollout.vllm.enable_sleep_mode ignored: not supported on %s", current_platform)
        config_dir = tempfile.TemporaryDirectory(prefix="medsrl-vllm-")
        model.config.save_pretrained(config_dir.name)  # config + tokenizer only: no weights on disk
        tokenizer.save_pretrained(config_dir.name)
        if current_platform.is_cpu():
            # vLLM 0.32 CPU: a prefill split over two scheduler steps rewinds the seeded request's
            # generator offset, which CPU generators do not support: whole prefills only
            options["enable_chunked_prefill"] = False
        engine_dtype, weight_dtype = _engine_dtype(dtype, model)
        trainer_group = _process_group_up()  # the trainer's, which vLLM joins (external_launcher)
        llm = vllm.LLM(
            model=config_dir.name,
            load_format="dummy",
            generation_config="vllm",
            logprobs_mode="processed_logprobs",  # after temperature and top-p, as sampled
            dtype=engine_dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            enable_sleep_mode=sleep_mode,
            **{k: v for k, v in options.items() if v is not None},
        )
        self._attach(llm, tokenizer, sleep_mode=sleep_mode, per_request_seeds=per_request_seeds, config_dir=config_dir,
                     max_model_len=max_model_len, weight_dtype=weight_dtype, trainer_group=trainer_group)
        _live = weakref.ref(self)
        logging.getLogger(ROTARY_LOGGER).addFilter(_drop_rotary_warning)  # added once
        # an FSDP rank other than 0 has no weights yet (its policy is on the meta device until
        # sharding fills it): the first sync_engine brings them, every rank together
        self._unsynced = any(p.is_meta for p in model.parameters())
        if not self._unsynced:
            self.sync_weights(model)

    @classmethod
    def around(cls, llm: Any, tokenizer: PreTrainedTokenizerBase, **options: Any) -> VLLMRolloutEngine:
        """An engine over an ``llm`` already built (the tests' recording fakes of ``vllm.LLM``)."""
        engine = cls.__new__(cls)
        engine._attach(llm, tokenizer, **options)
        return engine

    def _attach(self, llm: Any, tokenizer: PreTrainedTokenizerBase, *, sleep_mode: bool = False,
                per_request_seeds: bool = False, max_model_len: int | None = None,
                weight_dtype: torch.dtype | None = None, config_dir=None, trainer_group: bool = False) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.stop_token_ids = resolve_stop_ids(tokenizer, None, "VLLMRolloutEngine")
        self.sleep_mode = sleep_mode
        self._asleep: set[str] = set()
        self.per_request_seeds = bool(per_request_seeds)
        self.max_model_len = max_model_len
        self.weight_dtype = weight_dtype  # what the engine computes in: each streamed tensor is cast to it
        self._dir = config_dir
        self.trainer_group = trainer_group  # a process group was up before the engine: close() would end it
        self.load_api = ""  # which worker API the last sync used

    uses_policy_weights = False  # generation reads the engine's own copy of the weights

    @property
    def closed(self) -> bool:
        return self.llm is None

    @property
    def weights_released(self) -> bool:
        return "weights" in self._asleep or getattr(self, "_unsynced", False)

    def close(self) -> None:
        """Refused while the trainer's process group is up: vLLM's shutdown destroys the default group."""
        if self.llm is None:
            return
        if self.trainer_group and _process_group_up():
            raise RuntimeError(
                "closing a vLLM engine would destroy the default process group (vLLM's shutdown "
                "does), which the trainer's ranks still use: one engine per process in a "
                "multi-process run, closed when the process ends")
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        if self._dir is not None:
            self._dir.cleanup()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Stream ``model``'s weights into the engine in place (every rank together under FSDP); the
        KV cache stays asleep until ``generate``."""
        self._check_open()
        self._wake(["weights"])
        weights = streamed_weights(model, self.weight_dtype)
        try:
            with torch.no_grad(), torch.autocast(_device_type(), enabled=False):
                self.load_api, missing = self.llm.collective_rpc(_load_into_worker, args=(weights,))[0]
        finally:
            weights.close()
        self._unsynced = False
        if missing:
            raise RuntimeError(
                f"the vLLM engine got no weight for {len(missing)} of its parameters "
                f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): the policy's weight "
                f"names do not match what {type(model).__name__} maps to vLLM's model, and those "
                "parameters would generate from garbage")
        if "kv_cache" not in self._asleep and not self.llm.reset_prefix_cache():
            log.warning("vLLM prefix cache not reset after the weight sync")

    def generate(self, prompts: list[str], params: SamplingParams) -> RolloutBatch:
        prompt_ids, order = tokenize_prompts(self.tokenizer, prompts, params.n, "VLLMRolloutEngine")
        if not prompt_ids:
            return RolloutBatch.empty(params.logprobs)
        self._check_open()
        if self.weights_released:
            raise RuntimeError("VLLMRolloutEngine.generate: the weights were released (sleep level 2) "
                               "and not synced since; call sync_weights(policy) first")
        self._check_lengths(prompt_ids, params)
        requests = [{"prompt_token_ids": prompt_ids[i]} for i in order]
        sampling = [self._sampling_params(params, i, k % params.n) for k, i in enumerate(order)]
        self._wake(list(SLEEP_TAGS))
        if params.seed is not None and not self.per_request_seeds:
            self.llm.collective_rpc(_seed_worker, args=(int(params.seed),))
        with torch.autocast(_device_type(), enabled=False):  # the engine's own precision, not the trainer's
            outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        responses = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [_sampled_logprobs(out.outputs[0]) for out in outputs]
        if any(lp != lp or lp == float("inf") for row in logprobs for lp in row):
            raise RunawayError(f"{NONFINITE_SAMPLING}. {LIKELY_CAUSES}")
        finish = [self._finish_reason(out.outputs[0]) for out in outputs]
        return RolloutBatch.decoded(self.tokenizer, prompt_ids, order, responses, finish,
                                    logprobs if params.logprobs else None)

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this vLLM engine was closed (a newer one replaced it)")

    def _sampling_params(self, params: SamplingParams, prompt: int, sample: int):
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=1,
            temperature=0.0 if params.greedy else float(params.temperature),
            top_p=1.0 if params.greedy else float(params.top_p),
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=True,  # only our stop ids end a response, as in the HF backend
            seed=None if params.seed is None or not self.per_request_seeds
            else (params.seed + prompt) * SEED_STRIDE + sample,
            detokenize=False,  # decoded by our tokenizer, exactly as the HF backend does
            logprobs=0,  # the sampled token's only: returned if asked for, always checked
        )

    def _finish_reason(self, completion: Any) -> str:
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with {completion.finish_reason!r}")
        ids = completion.token_ids
        return FINISH_STOP if ids and ids[-1] in self.stop_token_ids else FINISH_LENGTH

    def _check_lengths(self, prompt_ids: list[list[int]], params: SamplingParams) -> None:
        """Data is filtered to this limit at load (``prompt_token_limit``): such a prompt was made in the run."""
        if self.max_model_len is None:
            return
        room = self.max_model_len - params.max_new_tokens
        for i, ids in enumerate(prompt_ids):
            if len(ids) > room:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; the engine's max_model_len "
                    f"{self.max_model_len} (rollout.max_prompt_tokens + max_new_tokens, at most the "
                    f"model's positions; or rollout.vllm.max_model_len) leaves {room} beside "
                    f"{params.max_new_tokens} new tokens. Data prompts over it are dropped at load: "
                    "shorten the prompts made during the run, or lower max_new_tokens")

    def release(self) -> None:
        """Sleep level 2 on every rank, whether or not it generated. A no-op with the weights asleep:
        vLLM's executor would skip it (``vllm/v1/executor/abstract.py:383-385``); with the KV cache
        alone asleep it runs and frees the weights too (``vllm/device_allocator/cumem.py:256-262``)."""
        self._check_open()
        if self.sleep_mode and "weights" not in self._asleep:
            self.llm.sleep(level=2)
            self._asleep.update(SLEEP_TAGS)

    def _wake(self, tags: list[str]) -> None:
        """vLLM ignores a wake whose tag is awake (``abstract.py:398-404``) and answers whether it is
        fully awake: an answer unlike this record raises here, not as a generate that never runs."""
        todo = [t for t in tags if t in self._asleep]
        if not todo:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the trainer's cached blocks back to the driver first
        fully_awake = self.llm.wake_up(tags=todo)
        self._asleep.difference_update(todo)
        if fully_awake != (not self._asleep):
            raise RuntimeError(
                f"vLLM's sleep state differs from the engine's: after waking {todo} vLLM says "
                f"fully awake = {fully_awake}, the engine has {sorted(self._asleep) or 'nothing'} asleep "
                "(was the engine's vllm.LLM put to sleep or woken directly?)")
        if "kv_cache" in todo:
            self.llm.reset_prefix_cache()
