"""The OpenAI wire format: request models (pydantic v2), the error body, and response/chunk builders.

Requests are validated strictly (no string-to-number coercion; a JSON number where a string is due is
an error) and every number is range-checked here (``Field`` bounds; no NaN or infinity), so a bad value
is a 400 naming the parameter before any generation starts. Fields the OpenAI API defines but hsdjax
cannot honour losslessly (penalties, ``logit_bias``, tools, ``echo``, ``best_of``, ``suffix``) are
rejected with a 400 rather than silently ignored; fields unknown to both are ignored, as most
OpenAI-compatible servers do.

Logprobs (chat ``logprobs``/``top_logprobs``, completions ``logprobs``) are formatted here from the
scheduler's ``(TokenLogprob, text offset)`` pairs; a log-probability of -inf (a token outside top-k /
top-p) is written as ``LOGPROB_FLOOR``, since JSON has no infinity.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

MAX_STOP_STRINGS = 4
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of (numerically) zero probability
INT32_MAX = 2**31 - 1  # the engine's token counts, top_k and seeds are int32


class APIError(HTTPException):
    """An error answered with the OpenAI error body ``{"error": {message, type, param, code}}``. It is
    an ``HTTPException`` so it can be raised anywhere in a request, even while FastAPI reads the body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                               param=f"messages.{index}.content.{j}", code="unsupported_content")
            pieces.append(part.text)
        return "".join(pieces)


class _SamplingRequest(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)  # extension (as in vLLM); 0 = off
    seed: int | None = Field(None, ge=-(2**31), le=INT32_MAX)  # as `hsdjax generate --seed`
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # OpenAI's ranges; check_supported then rejects anything but the default
    n: int | None = Field(None, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed (got {len(items)})")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def choices(self) -> int:
        return self.n or 1

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token the response lists (0: the chosen token's alone); None: no logprobs."""
        return None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Reject the OpenAI parameters hsdjax does not implement (400, naming the parameter)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (it would change the model's distribution)",
                               param=name, code="unsupported_parameter")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias", code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options",
                           code="invalid_value")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools", code="unsupported_parameter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported", param="response_format",
                           code="unsupported_parameter")

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        out = []
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text(i)})
        return out


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1, le=20)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo", code="unsupported_parameter")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of", code="unsupported_parameter")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_parameter")

    def budget(self) -> int | None:
        return self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"batched prompts ({len(p)}) are not supported: send one prompt per request",
                               param="prompt", code="unsupported_parameter")
            p = p[0]
        if isinstance(p, str) and not p:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        if isinstance(p, list) and not p:
            raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
        return p


# ---------------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens reused from the
    prefix cache (not run again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


Scored = tuple[Any, int]  # (api.TokenLogprob, where the token's text starts in its choice's text)


def _finite(logprob: float) -> float:
    """``logprob`` as JSON can carry it: ``LOGPROB_FLOOR`` for -inf, anything below it, or NaN."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares false


class ResponseBuilder:
    """Builds the bodies and stream chunks of one request (chat or text completion). ``pieces`` spells
    tokens (``text.TokenPieces``) and ``top_logprobs`` is the alternatives per token the request asked
    for (None: no logprobs)."""

    def __init__(self, chat: bool, model: str, fingerprint: str, pieces: Any = None, top_logprobs: int | None = None):
        self.chat = chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.pieces, self.top_logprobs = pieces, top_logprobs

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def full(self, choices: list[dict[str, Any]], use: dict[str, int], extra: dict[str, Any]) -> dict[str, Any]:
        """The whole response; ``choices``: the scheduler's ``index``, ``text``, ``finish_reason``, ``logprobs``."""
        items = []
        for c in choices:
            item: dict[str, Any] = {"index": c["index"]}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c["text"], "refusal": None}
            else:
                item["text"] = c["text"]
            items.append({**item, "logprobs": self.logprobs(c["logprobs"]), "finish_reason": c["finish_reason"]})
        body = self._head("chat.completion" if self.chat else "text_completion")
        return {**body, "choices": items, "usage": use, "hsdjax": extra}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, *, index: int = 0,
              logprobs: list[Scored] | None = None, first: bool = False, include_usage: bool = False,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk of choice ``index``: its new text and the logprobs of its new tokens."""
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        if extra is not None:
            body["hsdjax"] = extra
        return body

    def usage_chunk(self, use: dict[str, int], extra: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": use, "hsdjax": extra}

    # ------------------------------------------------------------------ logprobs
    def logprobs(self, scored: list[Scored] | None) -> dict[str, Any] | None:
        """A choice's (or chunk's) ``logprobs`` object for these tokens; None when not asked for."""
        if self.top_logprobs is None or scored is None:
            return None
        return self._chat_logprobs(scored) if self.chat else self._completion_logprobs(scored)

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        text, data = self.pieces(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": data}

    def _chat_logprobs(self, scored: list[Scored]) -> dict[str, Any]:
        """OpenAI chat: ``content`` [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
        content = [{**self._token(e.token, e.logprob),
                    "top_logprobs": [self._token(t, lp) for t, lp in e.top[: self.top_logprobs]]} for e, _ in scored]
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, scored: list[Scored]) -> dict[str, Any]:
        """Legacy completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token a dict of the
        ``logprobs`` most likely tokens plus the chosen one) and ``text_offset`` (in the completion)."""
        tops = []
        for e, _ in scored:
            top = {self.pieces(t)[0]: _finite(lp) for t, lp in e.top[: self.top_logprobs]}
            top.setdefault(self.pieces(e.token)[0], _finite(e.logprob))
            tops.append(top)
        return {"tokens": [self.pieces(e.token)[0] for e, _ in scored],
                "token_logprobs": [_finite(e.logprob) for e, _ in scored], "top_logprobs": tops,
                "text_offset": [offset for _, offset in scored]}
