"""vLLM rollout engine for a rank (`strategy_name: vllm`): in-process `vllm.LLM`, sampled
token log-probs, in-place weight reload."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Sequence, Tuple

from roll_gspo.config.schema import GeneratingArgs, RoleConfig

logger = logging.getLogger("roll_gspo.vllm")
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def vllm_engine_args(role: RoleConfig, *, max_model_len: int, seed: int) -> Dict[str, Any]:
    """`vllm.LLM` arguments for a role: ours, then the YAML's `strategy_config` over them."""
    engine_args: Dict[str, Any] = {
        "model": role.model_args.model_name_or_path,
        "dtype": VLLM_DTYPES[role.model_args.dtype],
        "seed": seed,
        "max_model_len": max_model_len,
        # Log-probs of the distribution actually sampled from (after temperature), which is
        # what the trainer scores; vLLM's default reports the raw logits' log-probs.
        "logprobs_mode": "processed_logprobs",
        "enforce_eager": True,
        # Weight updates are driven through these methods on every vLLM worker.
        "worker_extension_cls": EXTENSION,
    }
    engine_args.update(role.strategy_args.strategy_config)
    return engine_args


def sampling_kwargs(gen: GeneratingArgs, n: int) -> Dict[str, Any]:
    """`vllm.SamplingParams` arguments: `n` samples per prompt with their sampled log-probs."""
    return {"n": n, "max_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_p": gen.top_p,
            "top_k": gen.top_k if gen.top_k > 0 else -1, "logprobs": 0}


class VllmStrategy:
    def __init__(self, role: RoleConfig, *, max_model_len: int, seed: int):
        from vllm import LLM

        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").lower() not in ("0", "false"):
            # Weight sync hands tensors to the engine by reference; vLLM's multiprocess engine
            # would need a data plane for them (its RPC serialises tensors as nested lists).
            raise RuntimeError("the vllm strategy needs vLLM's in-process engine: set "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0 (roll_gspo's workers default to it)")

        engine_args = vllm_engine_args(role, max_model_len=max_model_len, seed=seed)
        _check_extension(engine_args["worker_extension_cls"])
        self.llm = LLM(**engine_args)

    def generate(self, prompt_ids: Sequence[Sequence[int]], gen: GeneratingArgs, n: int
                 ) -> List[List[Tuple[List[int], List[float], bool]]]:
        """Per prompt, `n` samples of (response token ids, their log-probs, finished-by-stop)."""
        from vllm import SamplingParams

        params = SamplingParams(**sampling_kwargs(gen, n))
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

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        full = [{"prompt_token_ids": list(p) + list(r)} for p, r in zip(prompt_ids, response_ids)]
        outputs = self.llm.generate(full, params, use_tqdm=False)
        scores = []
        for out, p, r in zip(outputs, prompt_ids, response_ids):
            steps = out.prompt_logprobs[len(p):]
            scores.append([step[token].logprob for token, step in zip(r, steps)])
        return scores

    # A weight update is one session of vLLM's layerwise reload, however many buckets it takes:
    # a layer is processed (e.g. re-packed for the CPU GEMM kernels) once all its tensors have
    # arrived, and a layer's tensors may span buckets. (`LLM.reload_weights` per bucket would
    # finalise half-loaded layers and leave garbage in them.)
    def begin_weight_update(self) -> None:
        self.llm.collective_rpc("roll_gspo_begin_weight_update")

    def load_weights(self, named_tensors: List[Tuple[str, Any]]) -> None:
        self.llm.collective_rpc("roll_gspo_load_weights", args=(named_tensors,))

    def finish_weight_update(self) -> None:
        self.llm.collective_rpc("roll_gspo_finish_weight_update")
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights


class WeightUpdateExtension:
    """Mixed into every vLLM worker class (`worker_extension_cls`), so that `collective_rpc` can
    call these by name, in-process or in vLLM's worker processes alike, as vLLM's own
    weight-transfer engines do. A custom `worker_extension_cls` must subclass it."""

    def roll_gspo_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.get_model())

    def roll_gspo_load_weights(self, named_tensors) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            # Pairs come back as lists from vLLM's multiprocess serialisation; loaders want tuples.
            self.get_model().load_weights((name, tensor) for name, tensor in named_tensors)

    def roll_gspo_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.get_model(), self.model_config)


EXTENSION = f"{WeightUpdateExtension.__module__}.{WeightUpdateExtension.__qualname__}"


def _check_extension(qualname: str) -> None:
    if qualname == EXTENSION:
        return
    from roll_gspo.utils.imports import import_object

    cls = import_object(qualname)
    if not (isinstance(cls, type) and issubclass(cls, WeightUpdateExtension)):
        raise ValueError(f"actor_infer.strategy_args.strategy_config.worker_extension_cls={qualname!r} must "
                         f"subclass {EXTENSION} (weight sync calls its methods on every vLLM worker)")
