"""vLLM on CPU admits prompts whole: its seeded sampling cannot take a prompt split over steps.

vLLM samples a token for every request of a step, also for one whose prompt was only partly
prefilled (chunked prefill: the prompts of a batch exceed `max_num_batched_tokens`, 4096 on CPU),
and throws that token away; to undo the draw it rewinds the request's seeded generator,
`gen.set_offset(gen.get_offset() - 4)` (`GPUModelRunner._bookkeeping_sync`, which the CPU runner
inherits). CUDA's Philox generator has an offset; torch's CPU generator (Mersenne Twister) has
none: `RuntimeError: CPU Generator does not use offset`. roll_gspo seeds every rollout request
(`roll_gspo.lifecycle.seeding`, for exact resume), so any batch whose prompts outgrow the budget
crashed. Catching the error would not do either: the discarded draw would make a sample depend on
how the batch happened to be split, not on its seed alone.

So a CPU engine runs with `enable_chunked_prefill: false` (`CPU_ENGINE_DEFAULTS`): vLLM's scheduler
then admits a prompt only when all of it fits this step's budget (the rest wait for the next
step) and never cuts one, whatever the prompt lengths, and the samples still depend on the seeds
alone. It needs a budget of at least one whole sequence (vLLM's default is then
max(4096, max_model_len)). A larger `max_num_batched_tokens` alone is no fix: it only moves the
batch size at which a prompt is split, unless it holds max_num_seqs whole sequences (a prefill step
of that many tokens, and its activations, at worst). Explicit engine keys that would still split a prompt are
refused here, naming the key (`prompt_split_problems`); GPUs keep chunked prefill (their
generators rewind).
"""
from __future__ import annotations

from typing import Any, List, Mapping

CPU_ENGINE_DEFAULTS = {"enable_chunked_prefill": False}
# vLLM's CPU defaults (EngineArgs.get_batch_defaults, LLM class): budget and sequences, per TP rank.
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 4096
VLLM_CPU_MAX_NUM_SEQS = 256

WHY = ("vLLM on CPU cannot split a prompt over steps under roll_gspo's seeded sampling (RuntimeError: CPU "
       "Generator does not use offset; roll_gspo turns chunked prefill off on CPU so prompts are admitted whole)")


def prompt_split_problems(engine: Mapping[str, Any], max_model_len: int, key: str) -> List[str]:
    """Keys of a CPU vLLM engine's arguments (`engine`, ours with the YAML's over them, or the
    YAML's `strategy_config` alone) under which vLLM could split a prompt over scheduler steps;
    `key` is where they are written (e.g. `actor_infer.strategy_args.strategy_config`)."""
    problems = []
    chunked = engine.get("enable_chunked_prefill")
    chunked = CPU_ENGINE_DEFAULTS["enable_chunked_prefill"] if chunked is None else bool(chunked)
    budget = engine.get("max_num_batched_tokens")
    threshold = engine.get("long_prefill_token_threshold") or 0
    if chunked:
        tp = int(engine.get("tensor_parallel_size") or 1)
        shown = budget if budget is not None else f"{VLLM_CPU_MAX_NUM_BATCHED_TOKENS * tp} (vLLM's CPU default)"
        seqs = engine.get("max_num_seqs") or min(VLLM_CPU_MAX_NUM_SEQS * tp, budget or VLLM_CPU_MAX_NUM_BATCHED_TOKENS * tp)
        if budget is None or budget < seqs * max_model_len:
            # max_num_seqs sequences of max_model_len tokens never outgrow such a budget: nothing is cut.
            problems.append(f"{key}.enable_chunked_prefill = true: a batch whose prompts exceed max_num_batched_tokens "
                            f"= {shown} would have a prompt split over steps, and {WHY}; drop the key, or set "
                            f"max_num_batched_tokens to at least max_num_seqs * max_model_len = {seqs} * "
                            f"{max_model_len} = {seqs * max_model_len}")
    elif isinstance(budget, int) and budget < max_model_len:
        problems.append(f"{key}.max_num_batched_tokens = {budget} is less than max_model_len = {max_model_len}: "
                        f"{WHY}, so one step's token budget must hold a whole sequence; raise it to at least "
                        f"{max_model_len} or drop it (vLLM's default is then max(4096, max_model_len))")
    if isinstance(threshold, int) and 0 < threshold < max_model_len:
        problems.append(f"{key}.long_prefill_token_threshold = {threshold}: vLLM cuts prompts longer than that "
                        f"into steps even without chunked prefill, and {WHY}; drop the key")
    return problems
