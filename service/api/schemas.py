"""Request bodies of the HTTP API (pydantic v2). Every field has a bound; unknown fields are rejected.

Static bounds live here; configurable ones (`ApiLimits`: prompt length, list lengths, body size) and
"max_tokens fits the context" are checked by the routes, which name the offending field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from model.translation import (
    DECODING_LIMITS,
    DEFAULT_BEAM_SIZE,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_MIN_LENGTH_RATIO,
    DEFAULT_NO_REPEAT_NGRAM,
)

MAX_CHARS = 1_000_000  # hard ceiling on any one string; ApiLimits tightens it
MAX_TOKENS = 8192  # hard ceiling on max_tokens; the model's context tightens it
SEED_MAX = 2**63 - 1
N_MAX = 128  # hard ceiling on n / best_of; ApiLimits.max_n tightens it
LOGIT_BIAS_MAX = 300  # entries in logit_bias, as OpenAI allows
COMPLETION_LOGPROBS_MAX = 5  # alternatives per token on /v1/completions, as OpenAI allows
CHAT_TOP_LOGPROBS_MAX = 20  # alternatives per token on /v1/chat/completions, as OpenAI allows
SCHEMA_MAX_CHARS = 64_000  # a response_format JSON schema, serialized


def _valid_unicode(s: str) -> str:
    """JSON may carry lone UTF-16 surrogates (`"\\ud800"`), which are not text: no tokenizer or UTF-8
    response can hold them, so they are a 400 here rather than an error deep in the engine."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone UTF-16 surrogate {s[e.start]!r} at index {e.start}; "
                         f"send valid Unicode text") from None
    return s


Text = Annotated[str, AfterValidator(_valid_unicode)]  # every free-text field of a request body


def _not_bool(v: Any) -> Any:
    """pydantic's lax mode reads JSON's true as 1; OpenAI's API refuses it, and so do we."""
    if isinstance(v, bool):
        raise ValueError(f"must be a number, not {str(v).lower()}")
    return v


Int = Annotated[int, BeforeValidator(_not_bool)]  # every number field of a request body
Float = Annotated[float, BeforeValidator(_not_bool)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN/Infinity are JSON extensions

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """null for an optional field means "not given", as in OpenAI's API and vLLM: clients pass their
        own unset options through as null (`temperature=None` in the openai SDK)."""
        if isinstance(data, dict) and None in data.values():
            # keys as the client sends them: a field's alias ("schema" for `schema_`) or its name
            fields = {f.alias or name: f for name, f in cls.model_fields.items()} | cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data


class TextPart(Strict):
    type: Literal["text"]
    text: Text = Field(max_length=MAX_CHARS)


class ChatMessage(Strict):
    # "developer": OpenAI's newer name for the system turn (sent by current SDK clients); read as "system"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] = Field(max_length=MAX_CHARS)
    name: Text | None = Field(None, max_length=64)

    @property
    def template_role(self) -> str:
        """The role as the chat template knows it."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as vLLM joins a message's text parts


class Sampling(Strict):
    """Sampling fields shared by every generation endpoint (OpenAI names)."""

    model: Text | None = Field(None, max_length=128)
    max_tokens: Int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: Float = Field(1.0, ge=0.0, le=2.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    stop: Text | list[Text] | None = Field(None, max_length=MAX_CHARS)
    seed: Int | None = Field(None, ge=0, le=SEED_MAX)
    stream: bool = False
    # extensions on every endpoint, as vLLM's: top_k 0 or -1 = off, min_p 0 = off, repetition_penalty 1 = off
    top_k: Int = Field(0, ge=-1, le=1000)
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Float = Field(1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False  # fixed-length outputs for benchmarks


class PromptOrMessages(Strict):
    """A raw `prompt` or chat `messages` (exactly one)."""

    prompt: Text | None = Field(None, max_length=MAX_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _one_input(self) -> PromptOrMessages:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class GenerateBody(Sampling, PromptOrMessages):
    """POST /v1/generate: a raw `prompt` or chat `messages` (exactly one)."""


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    """OpenAI's response_format.json_schema. `strict` is accepted either way: the output always follows the
    schema (a token mask, service/engine/structured.py)."""

    name: Text = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = Field(None, max_length=MAX_CHARS)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")  # the field name `schema` is pydantic's
    strict: bool | None = None

    @model_validator(mode="after")
    def _bounded(self) -> JsonSchemaFormat:
        try:
            size = len(json.dumps(self.schema_, allow_nan=False))
        except RecursionError:  # the body parser took it, but serializing it here, deeper in the stack, fails
            raise ValueError("schema is nested too deeply") from None
        except ValueError:  # json.loads reads them into `Any`; the grammar would take them as null
            raise ValueError("schema holds NaN or Infinity, which are not JSON numbers") from None
        if size > SCHEMA_MAX_CHARS:
            raise ValueError(f"schema is {size} characters as JSON; the limit is {SCHEMA_MAX_CHARS}")
        return self


class ResponseFormat(Strict):
    """OpenAI's response_format: text (the default), any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("give json_schema with type 'json_schema', and only then")
        return self


class OpenAIBase(Sampling):
    n: Int = Field(1, ge=1, le=N_MAX)  # choices from one prefill; ApiLimits.max_n tightens it
    presence_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Float = Field(0.0, ge=-2.0, le=2.0)
    # token id (a decimal string, as JSON keys are) -> bias added to its logit; ids are checked by the route
    logit_bias: dict[Annotated[str, Field(max_length=16)], Annotated[Float, Field(ge=-100.0, le=100.0)]] | None = \
        Field(None, max_length=LOGIT_BIAS_MAX)
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # vLLM takes it on /v1/completions too
    user: Text | None = Field(None, max_length=256)


TokenIds = Annotated[list[Annotated[Int, Field(ge=0)]], Field(max_length=MAX_TOKENS * 16)]


class CompletionBody(OpenAIBase):
    """POST /v1/completions (OpenAI legacy completions). The prompt is text or token ids (as lm-eval sends
    it), or a list of either: a batch of prompts, each with its n choices."""

    prompt: Text | list[Text] | TokenIds | list[TokenIds] = Field(max_length=MAX_CHARS)
    max_tokens: Int | None = Field(None, ge=0, le=MAX_TOKENS)  # 0 with echo: score the prompt only
    echo: bool = False  # the prompt before the completion (with its token logprobs when `logprobs` is set)
    logprobs: Int | None = Field(None, ge=0, le=COMPLETION_LOGPROBS_MAX)
    best_of: Int | None = Field(None, ge=1, le=N_MAX)  # candidates generated; the n most likely returned

    def prompts(self) -> list[str | list[int]]:
        """The prompts given, each text or token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class ChatRendering(Strict):
    """How chat messages become the prompt (vLLM's options)."""

    add_generation_prompt: bool = True  # end with the assistant's turn opening
    continue_final_message: bool = False  # end inside the last message, which the model continues (a prefill)

    @model_validator(mode="after")
    def _open_one_turn(self) -> ChatRendering:
        # a raw prompt (/tokenize's) is not rendered: both options are ignored there, as vLLM ignores them
        rendered = getattr(self, "messages", None) is not None
        if rendered and self.add_generation_prompt and self.continue_final_message:
            raise ValueError("set add_generation_prompt to false with continue_final_message: true; "
                             "the reply continues the last message rather than opening a turn")
        return self


class ChatCompletionBody(ChatRendering, OpenAIBase):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: Int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=CHAT_TOP_LOGPROBS_MAX)
    # declared so that the route can refuse them with a reason (service/api/openai_routes.py)
    tools: list[Any] | None = Field(None, max_length=128)
    tool_choice: Any = None
    functions: list[Any] | None = Field(None, max_length=128)
    function_call: Any = None
    parallel_tool_calls: bool | None = None


class TokenizeBody(ChatRendering, PromptOrMessages):
    """POST /tokenize (vLLM's shape): a raw `prompt`, or chat `messages` rendered by the chat template."""

    model: Text | None = Field(None, max_length=128)
    return_token_strs: bool = False  # also each token's text


class DetokenizeBody(Strict):
    """POST /detokenize (vLLM's shape)."""

    model: Text | None = Field(None, max_length=128)
    tokens: list[Int] = Field(max_length=MAX_TOKENS * 16)


# the translation decoding options' bounds as Field arguments (model/translation.py holds them for every path)
_BOUNDS = {name: {"ge": lo, "le": hi} for name, (lo, hi) in DECODING_LIMITS.items()}


class TranslateBody(Strict):
    """POST /v1/translate: one text or a list; the source language is detected when omitted."""

    model: Text | None = Field(None, max_length=128)
    text: Text | list[Text] = Field(max_length=MAX_CHARS)
    source_lang: Literal["en", "zh"] | None = None
    target_lang: Literal["en", "zh"] | None = None
    # upper bounds: ApiLimits and the translator's slots and positions, checked together in the route
    beam_size: Int = Field(DEFAULT_BEAM_SIZE, ge=1)
    max_length: Int | None = Field(None, ge=1)
    length_penalty: Float = Field(DEFAULT_LENGTH_PENALTY, **_BOUNDS["length_penalty"])
    no_repeat_ngram: Int = Field(DEFAULT_NO_REPEAT_NGRAM, **_BOUNDS["no_repeat_ngram"],
                                 description="forbid repeating any n-gram of this size in an output (0 = off)")
    min_length_ratio: Float = Field(DEFAULT_MIN_LENGTH_RATIO, **_BOUNDS["min_length_ratio"],
                                    description="no end of a sentence's translation before this many times its "
                                                "source's tokens")
