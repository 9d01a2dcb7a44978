"""Reading the service's streamed responses: Server-Sent Events lines -> text deltas and usage.

Understands the three stream shapes the load tests meet: OpenAI chat chunks (`choices[0].delta.content`),
OpenAI completion chunks (`choices[0].text`) and the native `/v1/generate` events (`text`), each possibly
carrying a final `usage`. llama.cpp's `llama-server` speaks the same OpenAI shapes."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class StreamChunk:
    text: str = ""  # content delta ("" for role-only, usage-only or finish chunks)
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None  # an error event sent inside the stream
    done: bool = False  # the "[DONE]" sentinel


def parse_sse_line(line: str | bytes) -> StreamChunk | None:
    """One line of an SSE body -> a chunk, or None for blank lines, comments and non-data fields."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return StreamChunk(done=True)
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return StreamChunk(error=f"unparseable stream line: {payload[:80]}")
    return chunk_from_json(obj)


def chunk_from_json(obj: dict) -> StreamChunk:
    """Maps one decoded event (OpenAI chat, OpenAI completion or native) to a StreamChunk."""
    if not isinstance(obj, dict):
        return StreamChunk(error=f"unexpected stream event: {str(obj)[:80]}")
    chunk = StreamChunk()
    if "error" in obj:
        err = obj["error"]
        chunk.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
    choices = obj.get("choices") or []
    if choices:
        c = choices[0]
        delta = c.get("delta")
        if isinstance(delta, dict):
            chunk.text = delta.get("content") or ""
        else:
            chunk.text = c.get("text") or ""
        chunk.finish_reason = c.get("finish_reason")
    else:
        chunk.text = obj.get("text") or obj.get("delta") or obj.get("content") or ""
        chunk.finish_reason = obj.get("finish_reason")
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        chunk.usage_completion_tokens = int(usage["completion_tokens"])
    elif obj.get("tokens_predicted") is not None:  # llama-server's native /completion
        chunk.usage_completion_tokens = int(obj["tokens_predicted"])
    return chunk
