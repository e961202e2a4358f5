"""LLM-as-judge reward (ROLL's `LLMJudgeRewardWorker`): a judge model reads the question, the
reference answer and the response and gives a verdict (see `roll_gspo.rewards.judge`)."""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Sequence

from roll_gspo.schema.config import RoleConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.rewards.judge import (DEFAULT_JUDGE_MAX_NEW_TOKENS, TRUNCATED_WARN_FRACTION, JudgeError,
                                     OpenAIJudgeClient, format_judge_prompt, parse_verdict, resolve_api_key)
from roll_gspo.rewards.scoring import Outcome
from roll_gspo.strategies import engine_class
from roll_gspo.workers.rewards.base import RewardWorker

logger = logging.getLogger("roll_gspo.rewards")


class LLMJudgeRewardWorker(RewardWorker):
    """`judge_model_type: api`: requests to the OpenAI-compatible endpoint `judge_api_url`
    (model `judge_model_name`, key `judge_api_key`, sampling from `generating_args`, extra request
    fields from `reward_kwargs.request_extra`, `reward_kwargs.concurrency` requests at once,
    default 4); `inference`: the judge model `model_args` loaded in this worker with
    `strategy_args.strategy_name` vllm or hf_infer. `judge_prompt`: the template (`{question}`,
    `{response}`, `{reference}`). A verdict scoring at least 0.5 counts as correct. The judge's
    budget is `generating_args.max_new_tokens` (default 512); a verdict cut at it scores 0 as
    `error`, and a batch where more than a fifth are cut warns."""

    correct_threshold = 0.5

    def build_reward_fn(self):
        cfg = self.cfg
        self.mode = cfg.judge_model_type or "api"
        kwargs = self.reward_kwargs()
        self.max_new_tokens = cfg.generating_args.max_new_tokens or DEFAULT_JUDGE_MAX_NEW_TOKENS
        self.client: Optional[OpenAIJudgeClient] = None
        self.engine = None
        if self.mode == "api":
            gen = cfg.generating_args
            body = {"temperature": gen.temperature, "top_p": gen.top_p, "max_tokens": self.max_new_tokens,
                    **kwargs.get("request_extra", {})}
            self.client = OpenAIJudgeClient(cfg.judge_api_url, cfg.judge_model_name,
                                            api_key=resolve_api_key(cfg.judge_api_key), timeout_s=cfg.timeout_s,
                                            max_retries=cfg.judge_max_retries, body=body)
            self.concurrency = int(kwargs.get("concurrency", 4))
        else:
            self._load_local_judge()
        return None

    def _load_local_judge(self) -> None:
        from transformers import AutoTokenizer

        from roll_gspo.schema.frozen import thawed

        self.cfg = cfg = thawed(self.cfg)  # the judge's own copy: the folder and token cap are settled here
        path = cfg.model_args.model_name_or_path
        if not path:
            raise ValueError(f"rewards.{self.domain}.model_args.model_name_or_path: the judge model to load "
                             f"(or set reward_pretrain)")
        from roll_gspo.builtin.models import resolve_model

        cfg.model_args.model_name_or_path = path = resolve_model(path)
        # Set by the config checks when the judge shares GPUs with the trainer (as ROLL's recipes
        # place it): it sleeps between reward phases (placement.colocation.fill_reward_sleep_level).
        self.sleep_level = cfg.strategy_args.strategy_config.get("sleep_level")
        role = RoleConfig(model_args=cfg.model_args, generating_args=cfg.generating_args,
                          strategy_args=cfg.strategy_args, infer_batch_size=cfg.infer_batch_size)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        cfg.generating_args.max_new_tokens = self.max_new_tokens
        # The engine's options; one that has no use for one ignores it (hf_infer takes the seed alone).
        max_len = int(cfg.strategy_args.strategy_config.get("max_model_len", 2048))
        self.engine = engine_class(cfg.strategy_args.strategy_name)(
            role, max_model_len=max_len, seed=1234 + self.rank, sleep_level=self.sleep_level,
            config_key=f"rewards.{self.domain}.strategy_args.strategy_config")
        # vLLM's context is its max_model_len; transformers' the model's own positions.
        self.max_context = (max_len if cfg.strategy_args.engine.vllm_engine_args else
                            getattr(self.engine.model.config, "max_position_embeddings", None) or 1 << 30)

    def _prompt(self, prompt: str, response: str, truth: Any) -> str:
        return format_judge_prompt(self.cfg.judge_prompt, prompt, response, truth)

    def _verdict(self, text: str, truncated: bool) -> Outcome:
        score = parse_verdict(text)
        if score is None and truncated:
            return 0.0, "error", (f"judge verdict cut at max_new_tokens = {self.max_new_tokens} (raise "
                                  f"rewards.{self.domain}.generating_args.max_new_tokens): {text[-120:]!r}")
        if score is None:
            return 0.0, "error", f"unparsable judge verdict: {text[-120:]!r}"
        return score, "ok", ""

    def _ask(self, judge_prompt: str) -> "tuple[Outcome, bool]":
        try:
            text, truncated = self.client.reply(judge_prompt)
            return self._verdict(text, truncated), truncated
        except JudgeError as exc:
            return (0.0, exc.status, str(exc)), False

    def score_responses(self, prompts: Sequence[str], responses: Sequence[str], truths: Sequence[Any],
                        batch: Batch) -> List[Outcome]:
        judge_prompts = [self._prompt(p, r, t) for p, r, t in zip(prompts, responses, truths)]
        if self.client is not None:
            with ThreadPoolExecutor(max(1, self.concurrency)) as pool:
                asked = list(pool.map(self._ask, judge_prompts))
        else:
            messages = [[{"role": "user", "content": text}] for text in judge_prompts]
            ids = [self.tokenizer.apply_chat_template(m, tokenize=True, add_generation_prompt=True) for m in messages]
            ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
            # A judge prompt the judge cannot hold is that response's error, not the worker's crash.
            fits = [len(x) + self.max_new_tokens <= self.max_context for x in ids]
            samples = iter(self.engine.generate([x for x, ok in zip(ids, fits) if ok], self.cfg.generating_args, 1)
                           if any(fits) else [])
            if self.sleep_level is not None:  # the GPU back to the roles it shares with
                self.engine.offload_states()
            eos = self.tokenizer.eos_token_id
            asked = []
            for prompt_ids, ok in zip(ids, fits):
                if not ok:
                    asked.append(((0.0, "error", f"judge prompt of {len(prompt_ids)} tokens + max_new_tokens "
                                                 f"{self.max_new_tokens} exceeds the judge's {self.max_context}-token "
                                                 f"context"), False))
                    continue
                generated = next(samples)[0][0]
                truncated = len(generated) >= self.max_new_tokens and (not generated or generated[-1] != eos)
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                asked.append((self._verdict(text, truncated), truncated))
        truncated = sum(flag for _, flag in asked)
        if asked and truncated > TRUNCATED_WARN_FRACTION * len(asked):
            logger.warning("LLM judge on domain %r: %d of %d verdicts were cut at max_new_tokens = %d and scored 0; "
                           "raise rewards.%s.generating_args.max_new_tokens or use a prompt asking for the verdict "
                           "line alone", self.domain, truncated, len(asked), self.max_new_tokens, self.domain)
        return [outcome for outcome, _ in asked]

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        super().close()
