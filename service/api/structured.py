"""OpenAI's response_format as the engine's JSON schema: `json_object` is any JSON object, `json_schema` the
client's schema. The schema is compiled here, off the event loop, so that a costly one does not stall other
streams and a schema the grammar library refuses is a 400 naming response_format."""

from __future__ import annotations

import asyncio

from service.api.errors import ApiError
from service.api.schemas import ResponseFormat
from service.engine.types import RequestRejected
from service.frontend.generator import GeneratorFrontend

JSON_OBJECT = {"type": "object"}  # OpenAI's JSON mode: any JSON object


async def response_schema(gen: GeneratorFrontend, fmt: ResponseFormat | None) -> dict | None:
    """The JSON schema the output must follow (None for plain text), checked and compiled."""
    if fmt is None or fmt.type == "text":
        return None
    schema = JSON_OBJECT if fmt.type == "json_object" else fmt.json_schema.schema_
    try:
        await asyncio.to_thread(gen.compile_schema, schema)
    except RequestRejected as e:
        raise ApiError(400, f"response_format: {e}; simplify the schema or use {{\"type\": \"json_object\"}}",
                       "response_format") from None
    return schema
