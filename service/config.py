"""Service configuration: which models to load, on what device, with which engine and API limits.

These dataclasses are the `args` of the Serve application (`deploy/serve_config.yaml` ->
`applications[].args`) and the `user_config` of the ingress deployment (`limits`, live-reloadable).
Unknown keys are rejected with a message naming them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from model.importers.smollm2 import MODEL_NAME as SMOLLM2_ID
from model.paths import REPO_ROOT, SHIPPED_TRANSLATOR
from model.strict_fields import FromDict, check_choices, from_dict, reject_unknown

GENERATOR_ID = SMOLLM2_ID
TRANSLATOR_ID = SHIPPED_TRANSLATOR.name
DEFAULT_TRANSLATOR_DIR = str(SHIPPED_TRANSLATOR.relative_to(REPO_ROOT))  # as Serve configs spell it


@dataclass
class ApiLimits(FromDict):
    """Bounds on request bodies, enforced by the HTTP layer before anything reaches an engine."""

    max_body_bytes: int = 1_000_000  # 413 beyond this
    max_prompt_chars: int = 32_000
    max_messages: int = 64
    max_texts: int = 32  # texts per /v1/translate call
    max_text_chars: int = 2_000  # characters per text to translate
    max_sentences: int = 2_048  # sentences to translate per /v1/translate call (each costs a beam search)
    max_stop: int = 4  # stop strings per request
    max_stop_chars: int = 64
    max_beam_size: int = 8
    max_translate_length: int = 512
    max_n: int = 8  # choices (n, best_of) per completion request: each holds a KV slot while it runs
    max_prompts: int = 64  # prompts per /v1/completions call (each queued as a request of its own)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"ApiLimits.{f.name} must be >= 1, got {getattr(self, f.name)}")


def limits_from_user_config(user_config: dict | None, default: ApiLimits) -> ApiLimits:
    """The deployment's `user_config: {limits: {...}}` (live-reloadable API limits) over `default`: a limit
    it does not name keeps its value from `default` (the application's args, or the defaults)."""
    # not a mapping: else a TypeError, an AttributeError, or a string's characters named as unknown fields
    if user_config is not None and not isinstance(user_config, Mapping):
        raise ValueError(f"user_config must be a mapping like {{limits: {{...}}}}, got {user_config!r}")
    reject_unknown(user_config or {}, ["limits"], "user_config")
    limits = (user_config or {}).get("limits")
    if limits is None:
        return default
    if not isinstance(limits, Mapping):  # a string's characters would read as unknown fields
        raise ValueError(f"user_config.limits must be a mapping of ApiLimits fields, got {limits!r}")
    reject_unknown(limits, [f.name for f in dataclasses.fields(ApiLimits)], "user_config.limits")
    return ApiLimits.from_dict({**dataclasses.asdict(default), **limits})


@dataclass
class ModelSpec(FromDict):
    """One model: where its checkpoint is, and the engine that serves it.

    `checkpoint` None means the default source (SmolLM2 via `ensure_smollm2()` for the generator,
    `weights/attnserve-zh-en` for the translator); `name` None, that source's model id. "auto" `device`/`dtype`
    and `quantization` (CPU, generator: int8 or int4 linears, model/quantize.py) are resolved on the replica
    (service/models.py)."""

    enabled: bool = True
    checkpoint: str | None = None
    name: str | None = None  # the id clients send as `model` (and the metrics' model label)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "none", "int8", "int4"] = "none"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (device/dtype set from above)
    chat_template: str | None = None  # Jinja chat template overriding the tokenizer's (generator only)

    def __post_init__(self):
        check_choices(self)
        name = self.name
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= 128 and name.strip() == name):
            raise ValueError(f"ModelSpec.name must be a model id of 1 to 128 characters without surrounding "
                             f"spaces, got {name!r}")
        if self.engine is None:  # `engine:` left empty in YAML
            self.engine = {}
        if not isinstance(self.engine, dict):
            raise ValueError(f"ModelSpec.engine must be a mapping of EngineConfig fields, got {self.engine!r}")
        if bad := {"device", "dtype"} & set(self.engine):
            raise ValueError(f"ModelSpec.engine must not set {sorted(bad)}: use ModelSpec.device/dtype")
        if self.chat_template is not None:  # else every chat request answered 400 naming the server's template
            from model.chat import ChatTemplateError, compile_template

            try:
                compile_template(self.chat_template)
            except ChatTemplateError as e:
                raise ValueError(f"ModelSpec.chat_template: {e}") from None
        from service.engine.config import EngineConfig

        EngineConfig.from_dict(dict(self.engine))  # its keys and values, checked where the config is read


@dataclass
class ServiceConfig:
    generator: ModelSpec = field(default_factory=ModelSpec)
    translator: ModelSpec = field(default_factory=lambda: ModelSpec(checkpoint=DEFAULT_TRANSLATOR_DIR))
    limits: ApiLimits = field(default_factory=ApiLimits)
    batching: Literal["engine", "serve_batch"] = "engine"  # serve_batch = Ray's @serve.batch (static batches)
    serve_batch_size: int = 8
    serve_batch_wait_s: float = 0.05
    # origins whose pages may call the API from a browser (CORS); [] = none but the service's own (the
    # playground); ["*"] = any, as vLLM and llama-server allow by default
    cors_allowed_origins: list[str] = field(default_factory=list)

    def __post_init__(self):
        check_choices(self)
        if not (self.generator.enabled or self.translator.enabled):  # /readyz would never say ready
            raise ValueError("ServiceConfig: generator and translator are both disabled; enable at least one")
        if self.generator_id == self.translator_id:
            raise ValueError(f"ServiceConfig: generator.name and translator.name must differ, both are "
                             f"{self.generator_id!r}")
        # NaN or inf: Ray's batcher would never time out, a batch not filled never ran
        if self.serve_batch_size < 1 or not 0 <= self.serve_batch_wait_s < math.inf:
            raise ValueError("ServiceConfig.serve_batch_size must be >= 1 and serve_batch_wait_s >= 0 and finite")
        origins = self.cors_allowed_origins
        if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
            raise ValueError("ServiceConfig.cors_allowed_origins must be a list of origins such as "
                             "'http://localhost:3000' (or '*')")

    @property
    def generator_id(self) -> str:
        return self.generator.name or GENERATOR_ID

    @property
    def translator_id(self) -> str:
        return self.translator.name or TRANSLATOR_ID

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ServiceConfig:
        if data is not None and not isinstance(data, Mapping):
            raise ValueError(f"the application's args must be a mapping of settings, got {type(data).__name__}")
        data = dict(data or {})
        if isinstance(data.get("translator"), dict) and "checkpoint" not in data["translator"]:
            data["translator"] = {"checkpoint": DEFAULT_TRANSLATOR_DIR, **data["translator"]}
        return from_dict(cls, data, nested={"generator": ModelSpec, "translator": ModelSpec, "limits": ApiLimits})
