"""LLM-as-judge reward (ROLL's `LLMJudgeRewardWorker`): a judge model reads the question, the
reference answer and the response and gives a verdict (see `roll_gspo.rewards.judge`)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional, Sequence

from roll_gspo.config.schema import RoleConfig
from roll_gspo.distributed.batch import Batch
from roll_gspo.rewards.judge import (JudgeError, OpenAIJudgeClient, format_judge_prompt, parse_verdict,
                                     resolve_api_key)
from roll_gspo.rewards.scoring import Outcome
from roll_gspo.workers.rewards.base import RewardWorker


class LLMJudgeRewardWorker(RewardWorker):
    """`judge_model_type: api`: requests to the OpenAI-compatible endpoint `judge_api_url`
    (model `judge_model_name`, key `judge_api_key`, sampling from `generating_args`, extra request
    fields from `reward_kwargs.request_extra`, `reward_kwargs.concurrency` requests at once,
    default 4); `inference`: the judge model `model_args` loaded in this worker with
    `strategy_args.strategy_name` vllm or hf_infer. `judge_prompt`: the template (`{question}`,
    `{response}`, `{reference}`). A verdict scoring at least 0.5 counts as correct."""

    correct_threshold = 0.5

    def build_reward_fn(self):
        cfg = self.cfg
        self.mode = cfg.judge_model_type or "api"
        kwargs = self.reward_kwargs()
        self.client: Optional[OpenAIJudgeClient] = None
        self.engine = None
        if self.mode == "api":
            gen = cfg.generating_args
            body = {"temperature": gen.temperature, "top_p": gen.top_p, "max_tokens": gen.max_new_tokens or 64,
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

        cfg = self.cfg
        path = cfg.model_args.model_name_or_path
        if not path:
            raise ValueError(f"rewards.{self.domain}.model_args.model_name_or_path: the judge model to load "
                             f"(or set reward_pretrain)")
        from roll_gspo.builtin.models import resolve_model

        cfg.model_args.model_name_or_path = path = resolve_model(path)
        role = RoleConfig(model_args=cfg.model_args, generating_args=cfg.generating_args,
                          strategy_args=cfg.strategy_args, infer_batch_size=cfg.infer_batch_size)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.max_new_tokens = cfg.generating_args.max_new_tokens or 64
        cfg.generating_args.max_new_tokens = self.max_new_tokens
        if cfg.strategy_args.strategy_name == "vllm":
            from roll_gspo.strategies.vllm_strategy import VllmStrategy

            max_len = int(cfg.strategy_args.strategy_config.get("max_model_len", 2048))
            self.engine = VllmStrategy(role, max_model_len=max_len, seed=1234 + self.rank)
        else:
            from roll_gspo.strategies.hf_infer_strategy import HfInferStrategy

            self.engine = HfInferStrategy(role, seed=1234 + self.rank)

    def _prompt(self, prompt: str, response: str, truth: Any) -> str:
        return format_judge_prompt(self.cfg.judge_prompt, prompt, response, truth)

    def _verdict(self, text: str) -> Outcome:
        score = parse_verdict(text)
        if score is None:
            return 0.0, "error", f"unparsable judge verdict: {text[-120:]!r}"
        return score, "ok", ""

    def _ask(self, judge_prompt: str) -> Outcome:
        try:
            return self._verdict(self.client.complete(judge_prompt))
        except JudgeError as exc:
            return 0.0, exc.status, str(exc)

    def score_responses(self, prompts: Sequence[str], responses: Sequence[str], truths: Sequence[Any],
                        batch: Batch) -> List[Outcome]:
        judge_prompts = [self._prompt(p, r, t) for p, r, t in zip(prompts, responses, truths)]
        if self.client is not None:
            with ThreadPoolExecutor(max(1, self.concurrency)) as pool:
                return list(pool.map(self._ask, judge_prompts))
        messages = [[{"role": "user", "content": text}] for text in judge_prompts]
        ids = [self.tokenizer.apply_chat_template(m, tokenize=True, add_generation_prompt=True) for m in messages]
        ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
        samples = self.engine.generate(ids, self.cfg.generating_args, 1)
        texts = self.tokenizer.batch_decode([per_prompt[0][0] for per_prompt in samples], skip_special_tokens=True)
        return [self._verdict(text) for text in texts]

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        super().close()
