"""OpenAI chat fields this server accepts in the body but refuses to act on, each with a 400 that names
the field and says what to change (rather than pydantic's generic "Extra inputs are not permitted")."""

from __future__ import annotations

from service.api.errors import ApiError
from service.api.schemas import ChatCompletionBody

NO_TOOLS = "the model cannot call tools"


def refuse_unsupported(body: ChatCompletionBody) -> None:
    if body.tools:
        raise ApiError(400, f"tools: {NO_TOOLS}; remove 'tools'", "tools")
    if body.tool_choice not in (None, "none"):
        raise ApiError(400, f"tool_choice: {NO_TOOLS}; remove 'tool_choice' or set it to \"none\"", "tool_choice")
    if body.functions:
        raise ApiError(400, f"functions: {NO_TOOLS}; remove 'functions'", "functions")
    if body.function_call not in (None, "none"):
        raise ApiError(400, f"function_call: {NO_TOOLS}; remove 'function_call'", "function_call")
