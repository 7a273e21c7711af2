"""One streamed request of ``bench serve``, timed token by token as the client sees it.

Two APIs: TGI (``POST /generate_stream``, one Server-Sent Event per token, the last one with
``details``) and OpenAI (``POST /v1/completions`` with ``stream``, ``data: [DONE]`` at the end).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestRecord:
    """What happened to one request; times are ``time.perf_counter()`` seconds."""

    input_len: int  # tokens asked for
    output_len: int  # tokens asked for
    start: float = 0.0
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each token event
    status: str = "ok"  # ok, http_<code>, stream_error, timeout, or an exception's name
    error: str | None = None
    prompt_tokens: int | None = None  # as the server counted them, when it says
    output_tokens: int = 0
    finish_reason: str | None = None
    cached_tokens: int | None = None  # prompt tokens the server took from its prefix cache
    text: str = ""  # the generated text (a chat's next turn resends it)
    tags: dict[str, Any] = field(default_factory=dict)  # workload's labels: document, turn...

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def request_body(api: str, prompt: str, output_len: int, model: str | None) -> dict[str, Any]:
    if api == "tgi":  # TGI has no ignore_eos: a sequence may stop early at EOS
        return {"inputs": prompt, "parameters": {"max_new_tokens": output_len}}
    return {
        "model": model or "default",
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,  # vLLM's and SGLang's extension: exact output lengths
        "stream_options": {"include_usage": True},
    }


ROUTES = {"tgi": "/generate_stream", "openai": "/v1/completions"}


async def send(
    client: httpx.AsyncClient, url: str, api: str, prompt: str, rec: RequestRecord,
    model: str | None = None,
) -> RequestRecord:  # fmt: skip
    """Stream one request into ``rec``; failures are recorded there, never raised."""
    body = request_body(api, prompt, rec.output_len, model)
    rec.start = time.perf_counter()
    try:
        async with client.stream("POST", url.rstrip("/") + ROUTES[api], json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.status, rec.error = f"http_{resp.status_code}", text[:500]
            else:
                await _read_events(resp, api, rec)
    except httpx.TimeoutException as exc:
        rec.status, rec.error = "timeout", str(exc) or type(exc).__name__
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.status, rec.error = type(exc).__name__, str(exc)[:500]
    rec.end = time.perf_counter()
    return rec


async def _read_events(resp: httpx.Response, api: str, rec: RequestRecord) -> None:
    handle = _tgi_event if api == "tgi" else _openai_event
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            rec.status = "stream_error"
            rec.error = err if isinstance(err, str) else json.dumps(err)
            return
        handle(event, rec, time.perf_counter())
    if not rec.token_times and rec.ok:
        rec.status, rec.error = "stream_error", "the stream ended without a token"


def _tgi_event(event: dict[str, Any], rec: RequestRecord, now: float) -> None:
    if event.get("token") is not None:
        rec.token_times.append(now)
        rec.output_tokens += 1
        rec.text += event["token"].get("text") or ""
    if event.get("generated_text") is not None:  # the last event: the whole text, decoded once
        rec.text = event["generated_text"]
    details = event.get("details")
    if details:
        rec.finish_reason = details.get("finish_reason")
        rec.prompt_tokens = details.get("input_length")
        rec.output_tokens = details.get("generated_tokens", rec.output_tokens)


def _openai_event(event: dict[str, Any], rec: RequestRecord, now: float) -> None:
    choices = event.get("choices") or []
    if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
        rec.token_times.append(now)
        rec.output_tokens += 1
        rec.text += choices[0].get("text") or ""
    if choices and choices[0].get("finish_reason"):
        rec.finish_reason = choices[0]["finish_reason"]
    usage = event.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.output_tokens = usage.get("completion_tokens", rec.output_tokens)
        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
