"""The OpenAI-compatible HTTP server: FastAPI routes over one engine loop.

`/v1/completions`, `/v1/chat/completions` (streaming as server-sent events), `/v1/models`,
`/health`, `/metrics`. Every error is an OpenAI error body with a 4xx status; a request the
engine refuses changes nothing; a client that leaves frees its sequences before the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from specdec.config import SamplingParams
from specdec.llm import LLM
from specdec.outputs import RequestOutput
from specdec.server.engine_loop import EngineError, EngineLoop, RequestStream
from specdec.server.metrics import ServerMetrics
from specdec.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenLogprob,
    TopLogprob,
    Usage,
    usage_of,
)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))


def build_app(llm: LLM, model_name: str, api_key: str | None = None) -> FastAPI:
    """An app serving `llm` under `model_name`; with `api_key`, every /v1 route needs `Authorization: Bearer KEY`."""
    metrics = ServerMetrics(model_name)
    engine_loop = EngineLoop(llm.engine, on_finished=metrics.request_finished)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine_loop.shutdown()  # uvicorn has let running responses finish (or timed out): cancel the rest

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.engine_loop = engine_loop
    _add_error_handlers(app)

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error",
                           code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.read_engine(llm.engine)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)], response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=llm.config.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(authorized)], response_model=CompletionResponse,
              responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        _refuse_unsupported(body.unsupported())
        prompts = [_encode_completion_prompt(llm, p) for p in _prompt_list(body.prompt)]
        params = [_sampling_params(llm, body, len(ids), body.max_tokens, body.logprobs) for _, ids in prompts]
        streams = await _submit(engine_loop, prompts, params)
        render = _CompletionRender(llm, model_name, body.n)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_stream_chunks(streams, render, include_usage))
        finals = await _collect(streams, request)
        return render.response(finals)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)], response_model=ChatCompletionResponse,
              responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        _refuse_unsupported(body.unsupported())
        if llm.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer; this server was started without one")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        try:
            text = llm.apply_chat_template(messages)
        except Exception as error:  # a template that refuses these messages (e.g. roles out of order)
            raise APIError(400, f"the chat template refused these messages: {error}", param="messages") from None
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = _sampling_params(llm, body, len(ids), max_tokens, logprobs)
        streams = await _submit(engine_loop, [(text, ids)], [params])
        render = _ChatRender(llm, model_name, body.top_logprobs or 0)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_stream_chunks(streams, render, include_usage))
        finals = await _collect(streams, request)
        return render.response(finals)

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn that, on SIGINT/SIGTERM, stops accepting, lets running requests finish for `grace_s`, then ends
    the rest itself (an error event and [DONE] for a stream, a 500 body otherwise) so that every response
    completes before uvicorn's own cancelling (at `grace_s` + 5 s)."""

    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float = 30.0, log_level: str = "info") -> None:
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=grace_s + 5))
        self.engine_loop: EngineLoop = app.state.engine_loop
        self.grace_s = grace_s

    async def shutdown(self, sockets: Any = None) -> None:
        async def cancel_after_grace() -> None:
            await asyncio.sleep(self.grace_s)
            await asyncio.to_thread(self.engine_loop.shutdown)

        task = asyncio.create_task(cancel_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            task.cancel()


# --- requests ---------------------------------------------------------------------------------------

def _refuse_unsupported(field: str | None) -> None:
    if field is not None:
        raise APIError(400, f"{field} is not supported yet (it would change the sampled distribution)", param=field)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    return list(prompt)  # type: ignore[arg-type]


def _encode_completion_prompt(llm: LLM, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    try:
        return llm.encode_prompt(prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt})
    except ValueError as error:
        raise APIError(400, str(error), param="prompt") from None


def _sampling_params(llm: LLM, body: Any, num_prompt_tokens: int, max_tokens: int | None,
                     logprobs: int | None) -> SamplingParams:
    limit = llm.config.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                            f"{num_prompt_tokens}", param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = limit - num_prompt_tokens
    if num_prompt_tokens + max_tokens > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; you requested "
                            f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the prompt, {max_tokens} in the "
                            "completion)", param="max_tokens", code="context_length_exceeded")
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as error:
        raise APIError(400, str(error)) from None


async def _submit(engine_loop: EngineLoop, prompts: list[tuple[str | None, list[int]]],
                  params: list[SamplingParams]) -> list[RequestStream]:
    streams: list[RequestStream] = []
    try:
        for (text, ids), p in zip(prompts, params):
            streams.append(await engine_loop.submit(ids, p, text))
    except ValueError as error:
        raise APIError(400, str(error)) from None
    except EngineError as error:
        raise APIError(503, str(error), "service_unavailable") from None
    finally:
        if len(streams) < len(prompts):  # one was refused: none of this request runs
            for stream in streams:
                stream.close()
    return streams


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as each prompt's request moves; closing this aborts every unfinished one."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream.outputs():
                queue.put_nowait((index, output))
        except Exception as error:
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        unfinished = len(streams)
        while unfinished:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            unfinished -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def _collect(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    outputs = _merged(streams)
    try:
        async for index, output in outputs:
            finals[index] = output
            if await request.is_disconnected():
                break  # nobody will read the answer: stop computing it
    except EngineError as error:
        raise APIError(500, str(error), "internal_error") from None
    finally:
        await outputs.aclose()
    if any(f is None or not f.finished for f in finals):
        raise APIError(499, "the client closed the request", "client_closed_request")
    return finals  # type: ignore[return-value]


# --- responses --------------------------------------------------------------------------------------

def _usage(finals: list[RequestOutput]) -> Usage:
    prompt = sum(f.metrics.num_prompt_tokens for f in finals)
    completion = sum(f.metrics.num_output_tokens for f in finals)
    specs = [f.metrics.speculative_decoding for f in finals if f.metrics.speculative_decoding]
    if not specs:
        return usage_of(prompt, completion, None)
    steps = sum(s["num_spec_steps"] for s in specs)
    accepted = sum(s["num_accepted_tokens"] for s in specs)
    return usage_of(prompt, completion, {"num_draft_tokens": sum(s["num_draft_tokens"] for s in specs),
                                         "num_accepted_tokens": accepted,
                                         "mean_acceptance_length": 1 + accepted / steps if steps else None})


class _CompletionRender:
    """/v1/completions bodies; choice index = prompt index × n + sample index (as OpenAI numbers them)."""

    def __init__(self, llm: LLM, model: str, n: int) -> None:
        self.llm, self.model, self.n = llm, model, n
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def logprobs(self, entries: list[dict[int, float]] | None, offset: int) -> CompletionLogprobs | None:
        if entries is None:
            return None
        result = CompletionLogprobs()
        for entry in entries:
            [(token, logprob), *_] = entry.items()
            text = _token_text(self.llm, token)
            result.tokens.append(text)
            result.token_logprobs.append(logprob)
            top: dict[str, float] = {}
            for t, v in _top(entry):
                top.setdefault(_token_text(self.llm, t), v)  # tokens that decode alike: the likeliest keeps the key
            result.top_logprobs.append(top)
            result.text_offset.append(offset)
            offset += len(text)
        return result

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = [CompletionChoice(index=i * self.n + c.index, text=c.text, logprobs=self.logprobs(c.logprobs, 0),
                                    finish_reason=c.finish_reason)
                   for i, final in enumerate(finals) for c in final.outputs]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=_usage(finals))

    def chunk(self, prompt_index: int, index: int, text: str, logprobs: list[dict[int, float]] | None,
              offset: int, finish_reason: str | None) -> dict[str, Any]:
        choice = CompletionChoice(index=prompt_index * self.n + index, text=text,
                                  logprobs=self.logprobs(logprobs, offset), finish_reason=finish_reason)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice]).model_dump()

    def first_chunk(self, prompt_index: int, index: int) -> dict[str, Any] | None:
        return None

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                  usage=_usage(finals)).model_dump()


class _ChatRender:
    def __init__(self, llm: LLM, model: str, top_logprobs: int) -> None:
        self.llm, self.model, self.top_logprobs = llm, model, top_logprobs
        self.id, self.created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def logprobs(self, entries: list[dict[int, float]] | None, offset: int = 0) -> ChoiceLogprobs | None:
        if entries is None:
            return None
        content = []
        for entry in entries:
            [(token, logprob), *_] = entry.items()
            text = _token_text(self.llm, token)
            top = [TopLogprob(token=(t := _token_text(self.llm, i)), logprob=v, bytes=list(t.encode()))
                   for i, v in _top(entry)][: self.top_logprobs]
            content.append(TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        [final] = finals
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), logprobs=self.logprobs(c.logprobs),
                              finish_reason=c.finish_reason) for c in final.outputs]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=_usage(finals))

    def _chunk(self, choice: ChatChunkChoice) -> dict[str, Any]:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]).model_dump(
            exclude_none=True)

    def first_chunk(self, prompt_index: int, index: int) -> dict[str, Any] | None:
        return self._chunk(ChatChunkChoice(index=index, delta=Delta(role="assistant", content="")))

    def chunk(self, prompt_index: int, index: int, text: str, logprobs: list[dict[int, float]] | None,
              offset: int, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk(ChatChunkChoice(index=index, delta=Delta(content=text), logprobs=self.logprobs(logprobs),
                                           finish_reason=finish_reason))

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=_usage(finals)).model_dump(exclude_none=True)


async def _stream_chunks(streams: list[RequestStream], render: Any, include_usage: bool) -> AsyncIterator[dict]:
    """One chunk per choice per step that added text (or finished it); then, if asked, the usage."""
    sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, choice) → (characters, logprob entries) sent
    finals: dict[int, RequestOutput] = {}
    outputs = _merged(streams)
    try:
        async for prompt_index, output in outputs:
            finals[prompt_index] = output
            for choice in output.outputs:
                key = (prompt_index, choice.index)
                if key not in sent:
                    sent[key] = (0, 0)
                    if (first := render.first_chunk(prompt_index, choice.index)) is not None:
                        yield first
                chars, entries = sent[key]
                new_text = choice.text[chars:]
                new_logprobs = None if choice.logprobs is None else choice.logprobs[entries:]
                finish = choice.finish_reason
                if new_text or finish or new_logprobs:
                    yield render.chunk(prompt_index, choice.index, new_text, new_logprobs, chars, finish)
                    sent[key] = (len(choice.text), entries + len(new_logprobs or []))
    finally:
        await outputs.aclose()  # closing this stream aborts its requests at once
    if include_usage:
        yield render.usage_chunk([finals[i] for i in sorted(finals)])


def _sse(chunks: AsyncGenerator[dict, None]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except EngineError as error:
            body = ErrorResponse(error=ErrorInfo(message=str(error), type="internal_error"))
            yield f"data: {body.model_dump_json()}\n\n"
        finally:
            await chunks.aclose()  # a client that left: abort its requests now, not when the generator is collected
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _top(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])


def _token_text(llm: LLM, token: int) -> str:
    return llm.tokenizer.decode([token]) if llm.tokenizer is not None else f"token_id:{token}"


# --- errors -----------------------------------------------------------------------------------------

def _add_error_handlers(app: FastAPI) -> None:
    def body(status: int, message: str, type: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=ErrorInfo(message=message, type=type, param=param)).model_dump(),
                            status_code=status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body.model_dump(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = "; ".join(f"{'.'.join(str(x) for x in p.get('loc', ()) if x != 'body')}: {p.get('msg')}"
                            for p in problems[:5])
        return body(400, message or "invalid request", param=where or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return body(error.status_code, str(error.detail), "not_found_error" if error.status_code == 404 else
                    "invalid_request_error")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return body(500, f"internal error: {type(error).__name__}", "internal_error")

