"""transformers `generate` as a rollout engine (`strategy_name: hf_infer`): no extra engine to
install or start, slower than vLLM. Also serves a frozen reference model's log-probs."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from roll_gspo.config.schema import GeneratingArgs, RoleConfig
from roll_gspo.models.causal_lm import build_sequences, load_causal_lm, micro_batches, response_token_log_probs


def stop_token_ids(model_folder: str, tokenizer) -> List[int]:
    """The ids that end a response: the tokenizer's eos, then every `eos_token_id` of the model
    folder's generation_config.json (an int or a list: Qwen2.5-Instruct names `<|im_end|>` and
    `<|endoftext|>`). vLLM stops at the same set (it reads that file: `generation_config: vllm`),
    so both engines end a response at the same token."""
    import json
    import os

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    path = os.path.join(str(model_folder), "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            extra = json.load(fh).get("eos_token_id")
        ids += [int(i) for i in (extra if isinstance(extra, list) else [extra]) if i is not None]
    return list(dict.fromkeys(ids))


def generate_kwargs(gen: GeneratingArgs, n: int, pad_id: int, eos_id) -> Dict[str, Any]:
    """`generate` keywords (the model's own generation config is neutral). Greedy decoding takes
    one sequence per prompt. Sampling gets neutral temperature/top-k/top-p: `PerRowSampler`
    applies the YAML's, because transformers appends its own warpers after custom processors
    (they would act on the sampler's one-hot row) and fills a key left out with its default
    (top_k 50, not "off")."""
    common = dict(max_new_tokens=gen.max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id)
    if gen.temperature <= 0:
        return dict(common, do_sample=False, num_return_sequences=1)
    return dict(common, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=n)


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """The logits vLLM samples from: divided by `temperature`, then every token below the
    `top_k`-th highest (ties kept), then every token outside the smallest most-likely set whose
    probability reaches `top_p` (the most likely token always stays) set to -inf. As in vLLM,
    top_k -1 or 0 (or >= the vocabulary) and top_p 1 are off, and top-p sees the tempered,
    top-k-cut distribution.

    logits: ``(B, V)``. Returns a new ``(B, V)`` tensor of logits.dtype."""
    if temperature <= 0:
        raise ValueError(f"warp_logits needs temperature > 0 (0 is greedy decoding), got {temperature}")
    warped = logits / temperature
    if 0 < top_k < warped.shape[-1]:
        kth_highest = torch.topk(warped, top_k, dim=-1).values[..., -1:]
        warped = warped.masked_fill(warped < kth_highest, float("-inf"))
    if top_p < 1.0:
        ascending, order = warped.sort(dim=-1)
        mass_up_to = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_up_to <= 1.0 - top_p
        drop_sorted[..., -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        warped = warped.masked_fill(drop, float("-inf"))
    return warped


class HfInferStrategy:
    def __init__(self, role: RoleConfig, *, seed: int, **_unused: Any):
        from transformers import AutoTokenizer, GenerationConfig

        torch.manual_seed(seed)
        self.role = role
        self.model = load_causal_lm(role.model_args.model_name_or_path, role.model_args.dtype,
                                    role.model_args.attn_implementation).eval()
        self.model.requires_grad_(False)
        # The rank's GPU when Ray gave it one (device_mapping / num_gpus_per_worker), else CPU.
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model.to(self.device)
        self.asleep = False
        # Sampling comes from the YAML's generating_args only: `generate` fills every key it is
        # not given from the model folder's generation_config.json (e.g. Qwen2.5-Instruct's
        # repetition_penalty 1.05, top_k 20), which the trainer's ratio never sees.
        self.model.generation_config = GenerationConfig()
        self.tokenizer = AutoTokenizer.from_pretrained(role.model_args.model_name_or_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = stop_token_ids(role.model_args.model_name_or_path, self.tokenizer)
        self.eos_id = self.eos_ids[0] if self.eos_ids else None

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]], gen: GeneratingArgs, n: int,
                 seeds: Optional[Sequence[int]] = None) -> List[List[Tuple[List[int], List[float], bool]]]:
        """Per prompt, `n` samples of (response ids, log-probs, finished). `seeds`: one per
        prompt (None: drawn from torch's global RNG); sample i of a prompt draws from its own
        generator seeded seed + i (as vLLM)."""
        self.wake()
        if seeds is None and gen.temperature > 0:
            seeds = torch.randint(0, 2 ** 31 - 1, (len(prompt_ids),)).tolist()
        results = []
        for chunk in micro_batches(len(prompt_ids), self.role.infer_batch_size):
            prompts = list(prompt_ids[chunk])
            sampler = ({"logits_processor": LogitsProcessorList([PerRowSampler(
                [int(seed) + i for seed in seeds[chunk] for i in range(n)], gen.temperature, gen.top_k, gen.top_p)])}
                if gen.temperature > 0 else {})
            width = max(len(p) for p in prompts)
            # generate() wants left padding so every row's next token follows its prompt.
            input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts])
            attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            kwargs = generate_kwargs(gen, n, self.pad_id, self.eos_ids or None)
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                      **kwargs, **sampler).cpu()
            # Greedy: the n responses of a prompt are one response n times (as vLLM returns them).
            out = out.repeat_interleave(n // kwargs["num_return_sequences"], dim=0)
            responses, finished = [], []
            for row in out[:, width:].tolist():
                stop = next((i for i, token in enumerate(row) if token in self.eos_ids), None)
                if stop is not None:
                    row = row[: stop + 1]
                    finished.append(True)
                else:
                    finished.append(False)
                responses.append(row)
            repeated_prompts = [p for p in prompts for _ in range(n)]
            log_probs = self.score(repeated_prompts, responses, temperature=gen.temperature or 1.0)
            samples = list(zip(responses, log_probs, finished))
            results += [samples[i * n:(i + 1) * n] for i in range(len(prompts))]
        return results

    @torch.no_grad()
    def score(self, prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
              temperature: float = 1.0) -> List[List[float]]:
        self.wake()
        scores: List[List[float]] = []
        for chunk in micro_batches(len(prompt_ids), self.role.infer_batch_size):
            responses = list(response_ids[chunk])
            input_ids, attention, prompt_lengths, mask = build_sequences(prompt_ids[chunk], responses, self.pad_id)
            log_probs, _ = response_token_log_probs(self.model, input_ids.to(self.device), attention.to(self.device),
                                                    prompt_lengths, mask.shape[1], temperature)
            scores += [lp[: len(r)].tolist() for lp, r in zip(log_probs, responses)]
        return scores

    def offload_states(self) -> None:
        """Between phases on a shared GPU: the weights to CPU memory (a no-op on CPU)."""
        if self.device.type != "cpu" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.model.to(self.device)
            self.asleep = False

    def begin_weight_update(self) -> None:
        self.wake()

    def load_weights(self, named_tensors: List[Tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied names too
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)

    def finish_weight_update(self) -> None:
        pass


class PerRowSampler(LogitsProcessor):
    """Samples each row's next token from `warp_logits` of the model's scores with the row's own
    generator, and leaves only that token possible, so generate's sampling step picks it whatever
    its global RNG holds (generate_kwargs gives generate no warpers of its own).

    One `torch.rand` per row and token (a few microseconds each); the rest is batched."""

    def __init__(self, row_seeds: Sequence[int], temperature: float, top_k: int = -1, top_p: float = 1.0):
        self.generators = [torch.Generator().manual_seed(seed) for seed in row_seeds]
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(f"PerRowSampler built for {len(self.generators)} rows, got {scores.shape[0]}")
        uniform = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in self.generators]).to(scores.device)
        warped = warp_logits(scores.double(), self.temperature, self.top_k, self.top_p)
        cdf = torch.softmax(warped, dim=-1).cumsum(-1)
        target = (uniform * cdf[:, -1]).unsqueeze(-1)
        tokens = torch.searchsorted(cdf, target, right=True).clamp(max=scores.shape[-1] - 1)
        chosen = torch.full_like(scores, float("-inf"))
        chosen.scatter_(1, tokens, 0.0)
        return chosen
