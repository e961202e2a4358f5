"""The OpenAI-compatible rollout endpoint: `/v1/chat/completions`, `/v1/completions`, `/v1/models`
in front of the run's rollout ranks, recording every episode's tokens (roll_gspo.serving.episodes).

Requests and responses are vLLM's own OpenAI protocol models; tool calls are vLLM's tool parsers'
(`hermes` by default). Prompts are rendered with the run's tokenizer and chat template, sampled on
a rollout rank (its engine loop: continuous batching) with the run's sampling (temperature, top-p,
top-k of the rollout's generating_args: what the trainer's ratio assumes; a client's own values
are ignored), a request's `max_tokens` capped by the run's `max_new_tokens` and by what is left of
`sequence_length`.

Security: it listens on 127.0.0.1 unless told otherwise; any other address needs a token, then
required on every request (`Authorization: Bearer <token>`, the `openai` client's `api_key`). A
browser page must not drive it (a cross-origin `text/plain` POST needs no preflight; a DNS-rebound
name makes a page same-origin): a request with an `Origin` header or a `Host` that is not the bound
address is a 403, a body that is not `application/json` a 415, token or not. A request body over
`max_request_bytes` (counted while it streams: never read whole first), malformed JSON, an invalid
request, an unknown model, a prompt longer than `sequence_length` get a 4xx; a client that
disconnects while its request runs has the request aborted on the rank and counted as its
episode's failure; an engine error is a 500 and a counted failure; neither stops the server or a
rank.

Memory: only requests with an episode id, on a server that keeps records (`keep_records`: a run
trains on them), are recorded, in a bounded store (roll_gspo.serving.episodes); the episode's
lock and its rank pin live on its record and go with it.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import threading
import time
import uuid
from typing import Any, AsyncIterator, Dict, FrozenSet, List, Optional, Tuple

from starlette.requests import Request  # at module level: FastAPI resolves the handlers' annotations here

from roll_gspo.agentic.tokens import ChatStitcher
from roll_gspo.data.chat_templates import render_chat
from roll_gspo.serving.backends import Router
from roll_gspo.serving.episodes import (EpisodeRecord, EpisodeStore, TurnPlan, message_text, template_messages,
                                       tool_arguments, with_tools)
from roll_gspo.strategies.engine import RequestOutput, Sampling
from roll_gspo.utils.net import is_loopback

logger = logging.getLogger("roll_gspo.serving")
EPISODE_HEADER = "X-Episode-Id"
# verifiers' per-rollout header (the trace id, the same on every turn of a rollout): an episode key
# when X-Episode-Id is absent, so a verifiers trace's turns land in one record.
SESSION_HEADER = "X-Session-ID"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class RolloutServer:
    """The endpoint of one run. `backends`: one per rollout rank (roll_gspo.serving.backends);
    `sampling`: the run's rollout sampling; `start()` returns the address (http://HOST:PORT/v1).
    `keep_records`: record episodes (something takes them: an agent run), at most `max_episodes`
    not in a request; False: record none (nothing would ever free them)."""

    def __init__(self, backends: List, tokenizer, *, model_name: str, sampling: Sampling, sequence_length: int,
                 template: Optional[str] = None, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, tool_parser: Optional[str] = "hermes",
                 max_request_bytes: Optional[int] = None, model_aliases: Tuple[str, ...] = (),
                 keep_records: bool = True, max_episodes: int = 1024):
        if not is_loopback(host) and not token:
            raise ValueError(f"the rollout endpoint listens on {host!r}, not a loopback address: give it a token "
                             f"(clients then send it as their api_key)")
        if sampling.max_new_tokens is None or sampling.max_new_tokens < 1:
            raise ValueError("the endpoint needs the run's max_new_tokens")
        self.router = Router(backends)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_names = {model_name, *model_aliases}
        self.sampling = sampling
        self.sequence_length = sequence_length
        self.template = template or "native"
        self.stitcher = ChatStitcher(tokenizer, self.template)
        self.store = EpisodeStore(self.stitcher, self.render, max_episodes)
        self.keep_records = keep_records
        self.host, self.port, self.token = host, port, token
        self.host_names = own_host_names(host)
        self.tool_parser = tool_parser
        # JSON of a full-length conversation: ~16 bytes a token is generous for text, plus headroom.
        self.max_request_bytes = max_request_bytes or (65536 + 16 * sequence_length * 4)
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.counters: Dict[str, float] = {"requests": 0, "bad_requests": 0, "client_disconnects": 0,
                                           "engine_failures": 0, "generated_tokens": 0, "server_s": 0.0,
                                           "engine_s": 0.0, "unrecorded_requests": 0}
        self._server: Any = None  # uvicorn.Server once started (uvicorn is imported on start)
        self._thread: Optional[threading.Thread] = None
        self.app = self._build_app()

    # -- rendering ------------------------------------------------------------------------------------
    def render(self, messages: List[Dict[str, Any]], tools: Optional[list]) -> str:
        """The prompt text of a conversation under the run's template (tools in the system
        message for the named ChatML templates; the tokenizer's own template takes `tools=`)."""
        if self.template == "native":
            kwargs = {"tools": tools} if tools else {}
            return self.tokenizer.apply_chat_template(_native_messages(messages), tokenize=False,
                                                      add_generation_prompt=True, **kwargs)
        return render_chat(self.template, self.tokenizer, with_tools(template_messages(messages), tools))

    # -- lifecycle ------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> str:
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_keep_alive=30)
        self._server = server = uvicorn.Server(config)
        # The run keeps its own signal handlers: uvicorn installs none from a thread other than the main one.
        self._thread = thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                                                 name="roll-gspo-endpoint")
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the rollout endpoint did not start")
            time.sleep(0.01)
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(10)
            self._server = None

    def take_episode(self, episode_id: str) -> Optional[EpisodeRecord]:
        """The record of a finished episode (removed from the server with its lock and rank pin,
        and closed: an answer still in flight is counted, not added to it)."""
        return self.store.take(episode_id)

    def metrics(self) -> Dict[str, float]:
        c = dict(self.counters)
        c.update({f"episodes_{k}": v for k, v in self.store.counters().items()})
        if c["requests"]:
            c["overhead_ms_per_request"] = 1000 * max(c["server_s"] - c["engine_s"], 0.0) / c["requests"]
        return c

    # -- the app --------------------------------------------------------------------------------------
    def _build_app(self):
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        app = FastAPI(title="roll_gspo rollout endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def error(exc: HttpError):
            from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse

            body = ErrorResponse(error=ErrorInfo(message=exc.message, type=exc.kind, code=exc.status))
            return JSONResponse(body.model_dump(), status_code=exc.status)

        async def guarded(request: Request, handler):
            start = time.perf_counter()
            try:
                self._refuse_browsers(request)
                self._authorise(request)
                return await handler(request)
            except HttpError as exc:
                if exc.status < 500:
                    self.counters["bad_requests"] += 1
                return error(exc)
            except Exception as exc:  # a bug here must not take the server down
                logger.exception("rollout endpoint: request failed")
                return error(HttpError(500, f"{type(exc).__name__}: {exc}", "internal_error"))
            finally:
                self.counters["server_s"] += time.perf_counter() - start

        @app.get("/v1/models")
        async def models(request: Request):
            async def handler(_):
                from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

                return JSONResponse(ModelList(data=[ModelCard(id=self.model_name, root=self.model_name,
                                                              max_model_len=self.sequence_length)]).model_dump())
            return await guarded(request, handler)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await guarded(request, lambda r: self._chat(r, JSONResponse, StreamingResponse, Response))

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await guarded(request, lambda r: self._completion(r, JSONResponse, StreamingResponse, Response))

        return app

    def _refuse_browsers(self, request) -> None:
        """A page in a browser can reach a loopback server: a simple cross-origin POST needs no
        preflight, and a DNS-rebound name makes the page same-origin. Browsers send `Origin` on
        such requests and the page's name as `Host`; an API client sends no `Origin` and the
        address it connects to as `Host`, so the two tell them apart."""
        if "origin" in request.headers:
            raise HttpError(403, "requests with an Origin header (a web page) are refused", "permission_error")
        host = request.headers.get("host", "")
        local = request.scope.get("server")
        names = self.host_names | ({local[0].lower()} if local and is_unspecified(self.host) else set())
        name, port = split_host(host)
        if name not in names or port != self.port:
            raise HttpError(403, f"Host {host!r} is not this endpoint's address ({self.host}:{self.port})",
                            "permission_error")

    def _authorise(self, request) -> None:
        if self.token is None:
            return
        import hmac

        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise HttpError(401, "a valid token is required (Authorization: Bearer <token>)", "authentication_error")

    async def _read_body(self, request) -> bytes:
        """The JSON body, counted while it streams: refused at the limit, never read whole first
        (a chunked body declares no length)."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise HttpError(415, f"Content-Type must be application/json, got {media or 'none'!r}")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            raise HttpError(413, f"request body of {length} bytes is over the endpoint's {self.max_request_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                raise HttpError(413, f"request body over the endpoint's {self.max_request_bytes} bytes")
        return bytes(body)

    async def _parse(self, request, model_cls):
        """The request's model and its episode id (None: the request names no episode)."""
        body = await self._read_body(request)
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise HttpError(400, f"malformed JSON: {exc}") from None
        if not isinstance(data, dict):
            raise HttpError(400, "the request body must be a JSON object")
        try:
            parsed = model_cls.model_validate(data)
        except Exception as exc:  # pydantic's ValidationError, vLLM's own checks
            raise HttpError(400, f"invalid request: {exc}") from None
        if parsed.model is not None and parsed.model not in self.model_names:
            raise HttpError(404, f"model {parsed.model!r} does not exist here; this endpoint serves "
                                 f"{self.model_name!r}", "model_not_found")
        if (getattr(parsed, "n", 1) or 1) != 1:
            raise HttpError(400, "n must be 1 (one sampled answer per request: run a group's episodes instead)")
        if getattr(parsed, "use_beam_search", False):
            raise HttpError(400, "beam search is not a rollout")
        episode = (request.headers.get(EPISODE_HEADER) or request.headers.get(SESSION_HEADER)
                   or getattr(parsed, "user", None) or None)
        if episode is not None and len(episode) > 256:
            raise HttpError(400, "episode ids are at most 256 characters")
        return parsed, episode

    def _cap(self, prompt_ids: List[int], requested: Optional[int]) -> int:
        room = self.sequence_length - len(prompt_ids)
        if room < 1:
            raise HttpError(400, f"the prompt has {len(prompt_ids)} tokens; the run's sequence_length is "
                                 f"{self.sequence_length}", "context_length_exceeded")
        if requested is not None and requested < 1:
            raise HttpError(400, "max_tokens must be at least 1")
        limit = self.sampling.max_new_tokens or room  # the run's reply cap (the checks set it)
        return min(requested or limit, limit, room)

    async def _run(self, request, plan: TurnPlan, max_tokens: int, seed: Optional[int]) -> RequestOutput:
        """Sample on the episode's rank; a client gone meanwhile aborts it (counted, HttpError 499)."""
        rank = plan.record.rank = self.router.pick(plan.record.rank)
        backend = self.router.backends[rank]
        request_id = f"srv-{uuid.uuid4().hex}"
        sampling = Sampling(max_new_tokens=max_tokens, temperature=self.sampling.temperature,
                            top_p=self.sampling.top_p, top_k=self.sampling.top_k)
        backend.in_flight += 1
        start = time.perf_counter()
        task = asyncio.ensure_future(backend.generate(request_id, plan.prompt_ids, sampling, seed))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.05)
                if done:
                    break
                if await request.is_disconnected():
                    await backend.abort(request_id)
                    self.counters["client_disconnects"] += 1
                    self.store.fail(plan.record, "client disconnected")
                    raise HttpError(499, "client disconnected")
            try:
                output = task.result()
            except Exception as exc:
                self.counters["engine_failures"] += 1
                self.store.fail(plan.record, f"engine: {exc}")
                raise HttpError(500, f"the rollout engine failed: {exc}", "engine_error") from None
        finally:
            backend.in_flight -= 1
            self.counters["engine_s"] += time.perf_counter() - start
        self.counters["requests"] += 1
        self.counters["generated_tokens"] += len(output.token_ids)
        return output

    def _text(self, ids: List[int], keep_special: bool) -> str:
        body = ids[:-1] if ids and ids[-1] in self.eos_ids else ids
        return self.tokenizer.decode(body, skip_special_tokens=not keep_special)

    @contextlib.asynccontextmanager
    async def _episode(self, episode: Optional[str]) -> AsyncIterator[EpisodeRecord]:
        """The record a request plays into, the episode's requests one at a time. A scratch record
        (nothing kept) for a request without an episode id, which nothing could take, and on a
        server that keeps no records."""
        if episode is None or not self.keep_records:
            self.counters["unrecorded_requests"] += 1
            yield EpisodeRecord.scratch(episode or "")
            return
        record = self.store.open(episode)
        try:
            async with record.lock:
                yield record
        finally:
            self.store.release(record)

    # -- /v1/chat/completions -------------------------------------------------------------------------
    async def _chat(self, request, JSONResponse, StreamingResponse, Response):
        from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionLogProbs,
            ChatCompletionLogProbsContent, ChatCompletionRequest, ChatCompletionResponse,
            ChatCompletionResponseChoice, ChatMessage)
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        parsed, episode = await self._parse(request, ChatCompletionRequest)
        messages = [m if isinstance(m, dict) else dict(m) for m in parsed.messages]
        if not messages:
            raise HttpError(400, "messages must not be empty")
        tools = [t.model_dump(exclude_none=True) for t in parsed.tools] if parsed.tools else None
        if tools and parsed.tool_choice == "none":
            tools = None
        async with self._episode(episode) as record:
            plan = self.store.plan_chat(record, messages, tools)
            max_tokens = self._cap(plan.prompt_ids, parsed.max_completion_tokens or parsed.max_tokens)
            output = await self._run(request, plan, max_tokens, parsed.seed)
            text = self._text(output.token_ids, keep_special=bool(tools))
            content, tool_calls = text, []
            if tools and self.tool_parser:
                from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

                parser = ToolParserManager.get_tool_parser(self.tool_parser)(self.tokenizer, parsed.tools)
                info = parser.extract_tool_calls(text, parsed)
                if info.tools_called:
                    content, tool_calls = info.content, info.tool_calls
            message = ChatMessage(role="assistant", content=content, tool_calls=tool_calls)
            returned = {"role": "assistant", "content": content,
                        "tool_calls": [c.model_dump() for c in tool_calls]}
            self.store.record(plan, output.token_ids, output.log_probs, output.weight_versions, returned=returned)
        finish = "tool_calls" if tool_calls else ("length" if output.finish_reason == "length" else "stop")
        logprobs = None
        if parsed.logprobs:
            logprobs = ChatCompletionLogProbs(content=[ChatCompletionLogProbsContent(
                token=self.tokenizer.decode([t]), logprob=lp) for t, lp in zip(output.token_ids, output.log_probs)])
        choice = ChatCompletionResponseChoice(index=0, message=message, logprobs=logprobs, finish_reason=finish,
                                              token_ids=list(output.token_ids))
        usage = UsageInfo(prompt_tokens=len(plan.prompt_ids), completion_tokens=len(output.token_ids),
                          total_tokens=len(plan.prompt_ids) + len(output.token_ids))
        body = ChatCompletionResponse(model=self.model_name, choices=[choice], usage=usage,
                                      prompt_token_ids=list(plan.prompt_ids))
        payload = body.model_dump(exclude_none=True)
        payload["episode_id"] = episode
        payload["weight_versions"] = list(output.weight_versions)
        headers = {EPISODE_HEADER: episode} if episode else {}
        if parsed.stream:
            return StreamingResponse(_chat_stream(payload, parsed), media_type="text/event-stream", headers=headers)
        return JSONResponse(payload, headers=headers)

    # -- /v1/completions ------------------------------------------------------------------------------
    async def _completion(self, request, JSONResponse, StreamingResponse, Response):
        from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionRequest,
            CompletionResponse, CompletionResponseChoice)
        from vllm.entrypoints.serve.engine.protocol import UsageInfo

        parsed, episode = await self._parse(request, CompletionRequest)
        prompt = parsed.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise HttpError(400, "prompt must be one non-empty string")
        async with self._episode(episode) as record:
            plan = self.store.plan_completion(record, prompt)
            max_tokens = self._cap(plan.prompt_ids, parsed.max_tokens)
            output = await self._run(request, plan, max_tokens, parsed.seed)
            text = self._text(output.token_ids, keep_special=False)
            self.store.record(plan, output.token_ids, output.log_probs, output.weight_versions, completion_text=text)
        logprobs = None
        if parsed.logprobs is not None:
            logprobs = CompletionLogProbs(tokens=[self.tokenizer.decode([t]) for t in output.token_ids],
                                          token_logprobs=list(output.log_probs))
        choice = CompletionResponseChoice(index=0, text=text, logprobs=logprobs,
                                          finish_reason="length" if output.finish_reason == "length" else "stop",
                                          token_ids=list(output.token_ids))
        usage = UsageInfo(prompt_tokens=len(plan.prompt_ids), completion_tokens=len(output.token_ids),
                          total_tokens=len(plan.prompt_ids) + len(output.token_ids))
        payload = CompletionResponse(model=self.model_name, choices=[choice], usage=usage).model_dump(exclude_none=True)
        payload["episode_id"] = episode
        headers = {EPISODE_HEADER: episode} if episode else {}
        if parsed.stream:
            return StreamingResponse(_completion_stream(payload), media_type="text/event-stream", headers=headers)
        return JSONResponse(payload, headers=headers)


def own_host_names(host: str) -> FrozenSet[str]:
    """The `Host` names that address a server bound to `host`: the address itself, the loopback
    names for a loopback bind, this machine's names for any other (a wildcard bind also takes the
    address each connection arrived on: `RolloutServer._refuse_browsers`)."""
    names = {host.strip("[]").lower()}
    if is_loopback(host):
        return frozenset(names | LOOPBACK_NAMES)
    return frozenset(names | {socket.gethostname().lower(), socket.getfqdn().lower()})


def is_unspecified(host: str) -> bool:
    """A wildcard bind (0.0.0.0, ::): every address of the machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def split_host(value: str) -> Tuple[str, int]:
    """A `Host` header's lower-case name and port (80 when it names none, -1 when it is not a number)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else rest
    else:
        name, _, port = value.partition(":")
    if not port:
        return name, 80
    return name, int(port) if port.isdigit() else -1


def _native_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Messages for a tokenizer's own template: text content, tool-call arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        m["content"] = message_text(m.get("content"))
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c.get("function", {}),
                                                  "arguments": tool_arguments(c.get("function", {}).get("arguments"))}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


async def _chat_stream(payload: Dict[str, Any], parsed):
    """The whole answer as OpenAI stream chunks (the turn is sampled first: its ids are recorded
    before anything is sent)."""
    choice = payload["choices"][0]
    message = choice["message"]
    base = {"id": payload["id"], "object": "chat.completion.chunk", "created": payload["created"],
            "model": payload["model"], "episode_id": payload["episode_id"]}
    delta: Dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]
    yield "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta}]}) + "\n\n"
    yield "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": {},
                                                        "finish_reason": choice["finish_reason"]}]}) + "\n\n"
    if parsed.stream_options and parsed.stream_options.include_usage:
        yield "data: " + json.dumps({**base, "choices": [], "usage": payload["usage"]}) + "\n\n"
    yield "data: [DONE]\n\n"


async def _completion_stream(payload: Dict[str, Any]):
    choice = payload["choices"][0]
    base = {"id": payload["id"], "object": "text_completion", "created": payload["created"],
            "model": payload["model"], "episode_id": payload["episode_id"]}
    yield "data: " + json.dumps({**base, "choices": [{"index": 0, "text": choice["text"],
                                                        "finish_reason": choice["finish_reason"]}]}) + "\n\n"
    yield "data: [DONE]\n\n"
