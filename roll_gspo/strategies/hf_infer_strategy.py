"""transformers `generate` as a rollout engine (`strategy_name: hf_infer`): no extra engine to
install or start, slower than vLLM. Also serves a frozen reference model's log-probs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from roll_gspo.schema.config import GeneratingArgs, RoleConfig
from roll_gspo.models.causal_lm import build_sequences, load_causal_lm, micro_batches, response_token_log_probs
from roll_gspo.strategies.engine import (RequestHandle, RequestOutput, RequestTable, Sampling, TabledEngine,
                                         as_samples, generate_groups)
from roll_gspo.sync.collective import CollectiveBucket, CollectiveReceiver


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


def generate_kwargs(gen: Union[GeneratingArgs, Sampling], n: int, pad_id: int, eos_id) -> Dict[str, Any]:
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


@dataclass
class _Group:
    """Pending requests sampled from one prompt with one sampling: a row of today's batch each."""

    prompt_ids: List[int]
    sampling: Sampling
    request_ids: List[str]
    seeds: List[Optional[int]]


class HfInferStrategy(TabledEngine):
    """transformers' `generate` behind the `RolloutEngine` contract: submitted requests wait in a
    queue; each `step` runs one `generate` call over the next `infer_batch_size` groups (a group:
    the requests of one prompt, one row each) that share a sampling, and finishes them all, so
    the batches, and the tokens, are those of a batch call over the same prompts. A request's
    tokens all carry the version loaded when its batch ran; `abort` of a queued request returns
    it without tokens. `sleep` moves the weights to CPU memory on a GPU and is a no-op on CPU."""

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
        self.requests = RequestTable()
        self.queue: Dict[str, _Group] = {}  # pending groups by key, in submission order
        self.weight_version = 0
        self.collective = CollectiveReceiver()  # its end of the device routes (CUDA IPC, NCCL, gloo)

    # -- requests (RolloutEngine) -------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: Sampling, seed: Optional[int] = None,
               group: Optional[str] = None) -> RequestHandle:
        """Queue one request; requests of one `group` share its prompt and sampling. Sampling
        without a seed draws one from torch's global RNG now."""
        if seed is None and sampling.temperature > 0:
            seed = int(torch.randint(0, 2 ** 31 - 1, (1,)))
        key = f"group:{group}" if group is not None else f"request:{request_id}"
        pending = self.queue.get(key)
        if pending is not None and (pending.prompt_ids != list(prompt_ids) or pending.sampling != sampling):
            raise ValueError(f"request {request_id!r} joins group {group!r} with another prompt or sampling")
        self.requests.add(request_id, self.weight_version)
        if pending is None:
            pending = self.queue[key] = _Group(list(prompt_ids), sampling, [], [])
        pending.request_ids.append(request_id)
        pending.seeds.append(seed)
        return RequestHandle(self, request_id)

    def step(self) -> List[str]:
        """Run the next batch of queued groups (one `generate` call); returns their request ids."""
        if not self.queue:
            if self.requests.live:
                raise RuntimeError(f"hf_infer holds none of the requests waited for: {self.requests.unfinished()[:5]}")
            return []
        keys = list(self.queue)
        sampling = self.queue[keys[0]].sampling
        batch = []
        for key in keys[: self.role.infer_batch_size]:
            if self.queue[key].sampling != sampling:
                break
            batch.append(self.queue.pop(key))
        done = []
        for group, samples in zip(batch, self._run(batch, sampling)):
            for request_id, (ids, log_probs, finished) in zip(group.request_ids, samples):
                self.requests.extend(request_id, ids, log_probs, self.weight_version)
                self.requests.finish(request_id, "stop" if finished else "length")
                done.append(request_id)
        self.steps_taken += 1
        return done

    def abort(self, request_ids: Sequence[str]) -> List[RequestOutput]:
        """Queued requests leave the queue without tokens (a batch runs whole, nothing is partial)."""
        dropping = set(request_ids)
        for key in list(self.queue):
            group = self.queue[key]
            kept = [(rid, seed) for rid, seed in zip(group.request_ids, group.seeds) if rid not in dropping]
            if not kept:
                del self.queue[key]
            else:
                group.request_ids, group.seeds = [rid for rid, _ in kept], [seed for _, seed in kept]
        return self.requests.abort(request_ids)

    @torch.no_grad()
    def _run(self, groups: List[_Group], sampling: Sampling) -> List[List[Tuple[List[int], List[float], bool]]]:
        """Per group, per request: (response ids, log-probs, finished). A sampled row draws from its
        own generator (its request's seed); greedy runs one row per group and copies it."""
        self.wake()
        counts = [len(group.request_ids) for group in groups]
        greedy = sampling.temperature <= 0
        rows = [group.prompt_ids for group in groups] if greedy else \
            [group.prompt_ids for group in groups for _ in group.request_ids]
        sampler = {} if greedy else {"logits_processor": LogitsProcessorList([PerRowSampler(
            [seed for group in groups for seed in group.seeds], sampling.temperature, sampling.top_k, sampling.top_p)])}
        width = max(len(p) for p in rows)
        # generate() wants left padding so every row's next token follows its prompt.
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in rows])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        kwargs = generate_kwargs(sampling, 1, self.pad_id, self.eos_ids or None)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                  **kwargs, **sampler).cpu()
        if greedy:  # a group's responses are one response repeated (as vLLM returns them)
            out = out.repeat_interleave(torch.tensor(counts), dim=0)
        responses, finished = [], []
        for row in out[:, width:].tolist():
            stop = next((i for i, token in enumerate(row) if token in self.eos_ids), None)
            if stop is not None:
                row = row[: stop + 1]
                finished.append(True)
            else:
                finished.append(False)
            responses.append(row)
        repeated_prompts = [group.prompt_ids for group, count in zip(groups, counts) for _ in range(count)]
        log_probs = self.score(repeated_prompts, responses, temperature=sampling.temperature or 1.0)
        samples = list(zip(responses, log_probs, finished))
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [samples[start:start + count] for start, count in zip(starts, counts)]

    def generate(self, prompt_ids: Sequence[Sequence[int]], gen: GeneratingArgs, n: int,
                 seeds: Optional[Sequence[int]] = None) -> List[List[Tuple[List[int], List[float], bool]]]:
        """Per prompt, `n` samples of (response ids, log-probs, finished). `seeds`: one per
        prompt (None: drawn from torch's global RNG); sample i of a prompt draws from its own
        generator seeded seed + i (as vLLM)."""
        if seeds is None and gen.temperature > 0:
            seeds = torch.randint(0, 2 ** 31 - 1, (len(prompt_ids),)).tolist()
        return as_samples(generate_groups(self, prompt_ids, Sampling.of(gen), n, seeds))

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

    def sleep(self) -> None:
        """Between phases on a shared GPU: the weights to CPU memory (a no-op on CPU)."""
        if self.device.type != "cpu" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.asleep = True

    offload_states = sleep  # the name the reward judge calls

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

    def load_bucket(self, payload, reader) -> None:
        """One bucket as it arrived: a collective one from the weight-sync group (or CUDA IPC),
        else shared memory or the object store (`reader`)."""
        if isinstance(payload, CollectiveBucket):
            self.load_weights(self.collective.receive(payload))
        else:
            from roll_gspo.sync.broadcast import receive_bucket

            self.load_weights(receive_bucket(payload, reader))

    def finish_weight_update(self, version: Optional[int] = None) -> None:
        """Nothing to finish (the weights were copied in place); `version` stamps what follows."""
        if version is not None:
            self.weight_version = version

    def load_adapter(self, named_tensors: List[Tuple[str, Any]], config: Dict[str, Any],
                     version: Optional[int] = None) -> None:
        """Refused: `lora_sync: adapter` needs vLLM's LoRA support (the config refuses it with hf_infer)."""
        raise NotImplementedError("lora_sync: adapter needs strategy_name: vllm; hf_infer takes merged weights")

    # -- device routes of the weight sync ----------------------------------------------------------
    def weight_receivers(self) -> int:
        """This process alone holds the weights."""
        return 1

    def weight_gpus(self) -> List[Optional[str]]:
        from roll_gspo.sync.cuda_ipc import gpu_identity

        return [gpu_identity()]

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                          backend: str, members: Optional[List[Optional[int]]] = None) -> None:
        """Join as `first_rank` (one process: `members` adds nothing)."""
        self.collective.join(host, port, first_rank, world_size, timeout_s, backend)


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
