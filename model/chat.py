"""Render a model's Jinja chat template (as stored in its GGUF / tokenizer_config.json) with jinja2.

The same sandboxed environment, helpers and filters as Hugging Face's `apply_chat_template`, so templates
written for it render identically; the caller passes the tokenizer's `bos_token` / `eos_token`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

_OPEN_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # HF's marker, so both cut a stripping template's text alike


class ChatTemplateError(ValueError):
    """A bad template, a bad message list, or the template itself raised."""


def _raise(message: str):
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def compile_template(template: str):
    """The template compiled (kept for the next call); ChatTemplateError where it does not compile."""
    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """HF's `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for training): the
        block renders its body, in its own scope as HF's does."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, **extra) -> str:
    """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...] -> prompt text.
    `continue_final_message`: the text ends with the last message's content, its turn left open (a
    prefilled reply the model continues), as HF's option cuts it."""
    from jinja2 import TemplateError

    if not template:
        raise ChatTemplateError("this model has no chat template")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i} must be an object with string 'role' and 'content'")
    if continue_final_message:
        if not messages:
            raise ChatTemplateError("continue_final_message: there is no message to continue")
        # a marker after the last content shows where it ends in the text, as HF finds it
        messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _OPEN_TAG}]
    try:
        # tools and documents none, as HF passes them: `{% if tools is not none %}` is true of an undefined
        text = compile_template(template).render(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError:
        raise
    # the template's own errors; a macro calling itself without end is a RecursionError, a division by a
    # count of messages that can be 0 a ZeroDivisionError (ArithmeticError): a 400, as any of them
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    if not continue_final_message:
        return text
    at = text.rfind(_OPEN_TAG.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template drops the end of the last message")
    # a template that strips the content strips the marker's space too, and the content's trailing ones
    return text[:at] if text.startswith(_OPEN_TAG, at) else text[:at].rstrip()
