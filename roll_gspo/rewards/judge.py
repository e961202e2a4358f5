"""LLM-as-judge: the judge prompt, strict verdict parsing, and an OpenAI-compatible client.

Verdict format (what the judge prompt asks for, and all that is accepted): a line that is
exactly ``VERDICT: CORRECT`` or ``VERDICT: INCORRECT`` (case and surrounding whitespace and
``*``/``#`` markdown ignored), scored 1 / 0; or a line ``SCORE: s`` or ``SCORE: s/10`` with
0 <= s <= 10, scored s / 10; or a reply that is the one word ``YES`` / ``NO`` (what ROLL's named
RLVR judge prompt asks for), scored 1 / 0. ROLL scores any reply *containing* "yes" as correct
("eyes", "yes or no?"); here only the bare word counts. The last such line counts; when verdict lines disagree, or there is
none, the verdict is unparsable: the response scores 0 with status ``error`` (counted).
"""
from __future__ import annotations

import logging
import os
import re
import time
from typing import Any, Dict, Optional, Tuple

# The judge's token budget when `generating_args.max_new_tokens` is unset: the schema's default.
from roll_gspo.schema.config import DEFAULT_JUDGE_MAX_NEW_TOKENS  # noqa: F401

logger = logging.getLogger("roll_gspo.rewards")

# Share of a batch's verdicts cut at the token budget above which the worker warns.
TRUNCATED_WARN_FRACTION = 0.2

DEFAULT_JUDGE_PROMPT = """You are grading an answer to a question against a reference answer.

Question:
{question}

Reference answer:
{reference}

Answer to grade:
{response}

Is the answer to grade correct, i.e. does it agree with the reference answer? Think briefly, then
end with one line that is exactly `VERDICT: CORRECT` or `VERDICT: INCORRECT`."""

# ROLL's named judge prompts (`judge_prompt: <name>`, from ROLL's prompt table) -> our template.
# ROLL's RLVR prompt pairs with the virtuoussy/Qwen2.5-7B-Instruct-RLVR judge, which answers a
# bare YES or NO; this one asks the same of the judge (worded here, not copied).
YES_NO_JUDGE_PROMPT = """Decide whether the final answer of a solution agrees with a reference answer.
The reference may be an option letter, a number, an expression or a list of answers, in any language.
If the solution's final answer agrees with the reference, reply YES. If it does not, or the
solution is unfinished or unclear, reply NO. Reply with the single word YES or NO and nothing else.

Question:
{question}

Solution (its end):
{response}

Reference answer:
{reference}

Reply:"""
NAMED_JUDGE_PROMPTS = {"Qwen2.5-7B-Instruct-RLVR-prompt": YES_NO_JUDGE_PROMPT}

_VERDICT = re.compile(r"^[\s*#>`]*verdict\s*[:=]\s*[*`]*\s*(correct|incorrect)\s*[*`.]*\s*$", re.IGNORECASE)
_YES_NO = re.compile(r"^[\s*#>`]*(yes|no)[\s*`.]*$", re.IGNORECASE)
_SCORE = re.compile(r"^[\s*#>`]*score\s*[:=]\s*[*`]*\s*(\d+(?:\.\d+)?)\s*(?:/\s*10)?\s*[*`.]*\s*$", re.IGNORECASE)


class JudgeError(Exception):
    """A judge call that produced no verdict; ``status`` is ``timeout`` or ``error``."""

    def __init__(self, message: str, status: str = "error"):
        super().__init__(message)
        self.status = status


def parse_verdict(text: str) -> Optional[float]:
    """The judge's score in [0, 1], or None when unparsable (see the module doc)."""
    text = str(text or "")
    bare = _YES_NO.match(text.strip())
    if bare:
        return 1.0 if bare.group(1).lower() == "yes" else 0.0
    found = []
    for line in text.splitlines():
        verdict, score = _VERDICT.match(line), _SCORE.match(line)
        if verdict:
            found.append(1.0 if verdict.group(1).lower() == "correct" else 0.0)
        elif score and float(score.group(1)) <= 10:
            found.append(float(score.group(1)) / 10.0)
    verdicts = {v for v in found if v in (0.0, 1.0)}
    if not found or len(verdicts) > 1:
        return None
    return found[-1]


def format_judge_prompt(template: Optional[str], question: str, response: str, reference: Any) -> str:
    """`template` is a template with `{question}`, `{response}`, `{reference}`, or the name of one
    of ROLL's named prompts (NAMED_JUDGE_PROMPTS); None: DEFAULT_JUDGE_PROMPT."""
    template = NAMED_JUDGE_PROMPTS.get(template, template) if template else None
    return (template or DEFAULT_JUDGE_PROMPT).format(question=question, response=response, reference=reference)


def resolve_api_key(value: Optional[str]) -> Optional[str]:
    """``env:NAME`` reads the key from the environment variable NAME; anything else is the key."""
    if value and value.startswith("env:"):
        name = value[len("env:"):]
        if name not in os.environ:
            raise ValueError(f"judge_api_key names the environment variable {name!r}, which is not set")
        return os.environ[name]
    return value


class OpenAIJudgeClient:
    """`POST {base_url}/chat/completions` with retries: a refused connection, a timeout, HTTP 429
    or 5xx is retried up to ``max_retries`` times after 0.5 s, 1 s, 2 s, ... (capped at 8 s);
    other HTTP errors are not. The key goes only into the Authorization header, never into a
    message or log line."""

    def __init__(self, base_url: str, model: Optional[str], *, api_key: Optional[str] = None,
                 timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                 body: Optional[Dict[str, Any]] = None):
        import httpx

        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.max_retries, self.backoff_s = int(max_retries), float(backoff_s)
        self.body = dict(body or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s))
        self.retries = 0

    def close(self) -> None:
        self._client.close()

    def complete(self, prompt: str) -> str:
        return self.reply(prompt)[0]

    def reply(self, prompt: str) -> Tuple[str, bool]:
        """The judge's text, and whether it stopped at the token budget (`finish_reason: length`)."""
        import httpx

        body = {**self.body, "messages": [{"role": "user", "content": prompt}]}
        if self.model:
            body["model"] = self.model
        last: Optional[JudgeError] = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 8.0))
            try:
                reply = self._client.post(self.url, json=body)
            except httpx.TimeoutException as exc:
                last = JudgeError(f"judge request timed out ({type(exc).__name__})", "timeout")
                continue
            except httpx.TransportError as exc:  # refused, reset, DNS
                last = JudgeError(f"judge endpoint unreachable ({type(exc).__name__}: {exc})")
                continue
            if reply.status_code == 429 or reply.status_code >= 500:
                last = JudgeError(f"judge endpoint answered HTTP {reply.status_code}")
                continue
            if reply.status_code != 200:
                raise JudgeError(f"judge endpoint answered HTTP {reply.status_code}: {reply.text[:200]}")
            try:
                choice = reply.json()["choices"][0]
                return choice["message"]["content"] or "", choice.get("finish_reason") == "length"
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise JudgeError(f"judge endpoint answered an unexpected body ({type(exc).__name__})") from None
        raise last if last is not None else JudgeError("judge request failed")
