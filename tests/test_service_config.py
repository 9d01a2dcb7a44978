"""Device/dtype selection from what Ray assigned, service config parsing, and missing-model handling (CPU only)."""

from __future__ import annotations

import pytest
import torch

from model.config import DecoderConfig, Seq2SeqConfig
from service.config import GENERATOR_ID, TRANSLATOR_ID, ApiLimits, ModelSpec, ServiceConfig
from service.engine.config import EngineConfig
from service.models import ModelUnavailable, engine_config, load_backends, select_device


@pytest.mark.parametrize("device,dtype,cuda,ray_gpus,bf16,expected", [
    ("auto", "auto", False, None, False, ("cpu", "float32")),  # no Ray, no GPU
    ("auto", "auto", True, None, True, ("cuda", "bfloat16")),  # no Ray, a visible GPU
    ("auto", "auto", True, [], True, ("cpu", "float32")),  # Ray gave this replica no GPU
    ("auto", "auto", True, [0], True, ("cuda", "bfloat16")),  # Ray assigned GPU 0
    ("auto", "auto", True, [0], False, ("cuda", "float16")),  # GPU without bf16
    ("auto", "float32", True, [0], True, ("cuda", "float32")),  # explicit dtype wins
    ("cpu", "auto", True, [0], True, ("cpu", "float32")),  # explicit device wins
    ("auto", "auto", False, [0], False, ("cpu", "float32")),  # assigned but not visible: CPU fallback
])
def test_select_device(device, dtype, cuda, ray_gpus, bf16, expected):
    assert select_device(device, dtype, cuda_available=cuda, ray_gpu_ids=ray_gpus, bf16_supported=bf16) == expected


def test_cpu_with_native_bf16_defaults_to_bf16():
    assert select_device("auto", "auto", cuda_available=False, ray_gpu_ids=None, cpu_bf16=True) == ("cpu", "bfloat16")
    assert select_device("auto", "float32", cuda_available=False, ray_gpu_ids=None, cpu_bf16=True) == ("cpu", "float32")
    assert select_device("auto", "auto", cuda_available=True, ray_gpu_ids=[], cpu_bf16=True) == ("cpu", "bfloat16")


def test_bf16_on_cpu_needs_native_instructions_and_a_measured_speedup():
    from model.cpu_features import BF16_MIN_SPEEDUP, decide_bf16, has_amx_bf16

    amx = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"})
    avx512_bf16 = frozenset({"avx512f", "avx512_bf16"})
    assert has_amx_bf16(amx) and not has_amx_bf16(avx512_bf16)
    assert decide_bf16(avx512_bf16, 4.3)  # AMD EPYC here: bf16 GEMM ~4x fp32
    assert not decide_bf16(avx512_bf16, 0.73)  # Intel without AMX: bf16 slower than fp32
    assert not decide_bf16(amx, BF16_MIN_SPEEDUP * 0.9)  # the measurement decides, not the flag
    assert decide_bf16(amx, None)
    assert not decide_bf16(frozenset({"avx2"}), 10.0)  # emulated bf16 is never chosen


@pytest.mark.parametrize("cost,expected", [({"float32": 3, "bfloat16": 1}, 3.0),
                                           ({"float32": 1, "bfloat16": 4}, 0.25)])
def test_bf16_speedup_is_fp32_time_over_bf16_time(monkeypatch, cost, expected):
    """A fake clock advanced by each matmul's dtype: the ratio is exact and its direction checked."""
    import torch

    from model import cpu_features

    clock = [0.0]
    monkeypatch.setattr(cpu_features.time, "perf_counter", lambda: clock[0])

    def fake_linear(x, w):
        clock[0] += cost[str(x.dtype).removeprefix("torch.")]
        return x

    monkeypatch.setattr(torch.nn.functional, "linear", fake_linear)
    assert cpu_features.bf16_matmul_speedup(m=2, k=4, n=4, repeats=3) == expected


def test_cuda_requested_without_gpu_is_clear_error():
    with pytest.raises(ModelUnavailable, match="cuda"):
        select_device("cuda", "auto", cuda_available=False, ray_gpu_ids=None)


@pytest.mark.parametrize("bf16_faster,dtype", [(True, "bfloat16"), (False, "float32")])
def test_engine_config_on_a_cpu_follows_the_bf16_decision(monkeypatch, bf16_faster, dtype):
    from service import models

    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: bf16_faster)
    cfg = engine_config(ModelSpec(engine={"max_slots": 3}))
    assert (cfg.device, cfg.dtype, cfg.kv_torch_dtype, cfg.max_slots) == ("cpu", dtype, getattr(torch, dtype), 3)


def test_the_cpu_dtype_decision_is_measured_once_per_host_and_kept(monkeypatch, tmp_path):
    """Two processes on one host (replicas side by side, the CLI beside the service) choose the same dtype
    even when their measurements on a busy CPU disagree."""
    from model import cpu_features
    from service import models

    monkeypatch.setenv("ATTNSERVE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(cpu_features, "has_bf16_instructions", lambda flags: True)
    for measured, kept in ((True, True), (False, True)):  # the second process measures otherwise
        monkeypatch.setattr(cpu_features, "prefers_bf16", lambda measured=measured: measured)
        models.cpu_has_native_bf16.cache_clear()
        assert models.cpu_has_native_bf16() is kept
    models.cpu_has_native_bf16.cache_clear()
    assert list(tmp_path.rglob("dtype-auto.txt"))[0].read_text() == "bfloat16"


def test_kv_cache_dtype_defaults_to_the_weights_dtype_and_can_be_wider():
    assert EngineConfig(device="cpu", dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    assert EngineConfig(device="cuda", dtype="float16").kv_torch_dtype == torch.float16
    assert EngineConfig(device="cpu", dtype="bfloat16", kv_dtype="float32").kv_torch_dtype == torch.float32
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype="int8")
    for bad in (-0.1, float("nan")):  # NaN: every prompt prefilled on its own, silently
        with pytest.raises(ValueError, match="prefill_max_padding"):
            EngineConfig(prefill_max_padding=bad)
    for bad in (-0.01, float("nan"), float("inf")):  # inf: a static engine's first batch waited forever
        with pytest.raises(ValueError, match="static_batch_wait_s must be >= 0 and finite"):
            ModelSpec.from_dict({"engine": {"mode": "static", "static_batch_wait_s": bad}})
    EngineConfig(static_batch_wait_s=0, prefill_max_padding=float("inf"))  # inf: one padded forward for all
    for bad in (0, -1, float("nan")):  # every request would time out
        with pytest.raises(ValueError, match="default_deadline_s"):
            EngineConfig(default_deadline_s=bad)


def test_config_rejects_unknown_and_bad_fields():
    with pytest.raises(ValueError, match="bogus"):
        ServiceConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="max_slot"):
        engine_config(ModelSpec(engine={"max_slot": 3}))
    with pytest.raises(ValueError, match="device"):
        ModelSpec.from_dict({"engine": {"device": "cuda"}})
    with pytest.raises(ValueError, match="max_texts"):
        ApiLimits(max_texts=0)
    assert ServiceConfig.from_dict({"translator": {"device": "cpu"}}).translator.checkpoint == "weights/attnserve-zh-en"


def test_missing_translator_is_reported_not_fatal(tmp_path):
    cfg = ServiceConfig.from_dict({"generator": {"enabled": False},
                                   "translator": {"checkpoint": str(tmp_path / "nothing")}})
    b = load_backends(cfg, log=lambda *_: None)
    assert b.generator is None and b.translator is None
    assert "no translator checkpoint" in b.unavailable[TRANSLATOR_ID]
    assert "disabled" in b.unavailable[GENERATOR_ID]


def test_a_configured_name_is_the_model_id_clients_send_and_the_reports_use(tmp_path):
    """`name` (vLLM's --served-model-name): /v1/models, the `model` a request sends, and while the model is
    missing, the 503 that names it; an empty, padded or shared name is refused."""
    from types import SimpleNamespace

    from service.api.errors import ApiError

    cfg = ServiceConfig.from_dict({"generator": {"enabled": False, "name": "my-llama"},
                                   "translator": {"checkpoint": str(tmp_path / "nothing"), "name": "zh-en"}})
    assert (cfg.generator_id, cfg.translator_id) == ("my-llama", "zh-en")
    b = load_backends(cfg, log=lambda *_: None)
    assert set(b.unavailable) == {"my-llama", "zh-en"}
    request = SimpleNamespace(state=SimpleNamespace())
    for ask in (None, "my-llama"):
        with pytest.raises(ApiError, match="model my-llama is not available: disabled") as e:
            b.need_generator(ask, request)
        assert e.value.status == 503
    with pytest.raises(ApiError, match="does not serve completions") as e:
        b.need_generator("zh-en", request)
    assert e.value.status == 400
    for bad in ("", " padded", "x" * 129):
        with pytest.raises(ValueError, match="ModelSpec.name"):
            ModelSpec(name=bad)
    with pytest.raises(ValueError, match="must differ"):
        ServiceConfig.from_dict({"generator": {"name": "one"}, "translator": {"name": "one"}})


def test_a_model_that_runs_out_of_device_memory_is_reported_and_the_other_still_served(monkeypatch):
    from service import models

    def oom(spec, sink=None, log=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")

    monkeypatch.setattr(models, "load_generator", oom)
    b = load_backends(ServiceConfig.from_dict({"translator": {"device": "cpu"}}), log=lambda *_: None)
    assert b.generator is None and "out of memory" in b.unavailable[GENERATOR_ID]
    assert b.translator is not None


@pytest.mark.parametrize("make, field", [
    (lambda: EngineConfig(mode="batchy"), "EngineConfig.mode"),
    (lambda: ModelSpec(quantization="int3"), "ModelSpec.quantization"),
    (lambda: ServiceConfig(batching="ray"), "ServiceConfig.batching"),
    (lambda: DecoderConfig(mlp="relu"), "DecoderConfig.mlp"),
    (lambda: Seq2SeqConfig(activation="tanh"), "Seq2SeqConfig.activation"),
])
def test_a_choice_field_outside_its_choices_is_refused_naming_the_field_and_the_choices(make, field):
    with pytest.raises(ValueError, match=rf"{field} must be one of \[.*\], got"):
        make()


def test_serve_config_file_http_options_and_errors(tmp_path):
    """The file's host and port hold unless the command line gives one; a broken file is a ValueError naming
    it (a message and exit 2 in `attnserve serve` / `deploy`), before Ray starts."""
    from service.ray_local import DEFAULT_CONFIG, read_config

    text = DEFAULT_CONFIG.read_text()
    cfg = tmp_path / "serve.yaml"
    assert "  port: 8000\n" in text
    cfg.write_text(text.replace("  port: 8000\n", "  port: 9000\n", 1))
    assert read_config(cfg)["http_options"]["port"] == 9000
    assert read_config(cfg, None, None)["http_options"] == {**read_config(cfg)["http_options"]}
    assert read_config(cfg, "127.0.0.1", 8123)["http_options"]["port"] == 8123
    cfg.write_text(text.replace("  port: 8000\n", "  port: yes\n", 1))  # YAML's true, not a port
    with pytest.raises(ValueError, match="port must be in 1..65535, got True"):
        read_config(cfg)
    cfg.write_text(text.replace("proxy_location: HeadOnly", "proxy_location: Disabled", 1))  # no HTTP at all
    with pytest.raises(ValueError, match="starts no HTTP proxy"):
        read_config(cfg)
    for bad, words in (("applications: [\n", "not valid YAML"), ("- 1\n- 2\n", "mapping"),
                       ("http_options: 5\n", "mapping"), ("applications: 7\n", "not a valid Serve config")):
        cfg.write_text(bad)
        with pytest.raises(ValueError, match=words):
            read_config(cfg)


def test_serve_command_line_defers_to_the_config_for_host_and_port():
    import argparse

    from service.commands import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args([])
    assert args.host is None and args.port is None  # read_config then keeps the file's http_options


def test_limits_in_args_hold_when_user_config_has_none():
    """Serve calls reconfigure(user_config) right after __init__: limits given in the args must survive a
    user_config without limits, and user_config's limits win when given."""
    import types

    from service.deployments import AttnServe

    cls = AttnServe.func_or_class
    replica = types.SimpleNamespace(config=ServiceConfig.from_dict({"limits": {"max_texts": 4, "max_n": 3}}),
                                    fastapi=None)
    cls.reconfigure(replica, {})
    assert replica.limits.max_texts == 4
    cls.reconfigure(replica, {"limits": {"max_texts": 2}})
    assert replica.limits.max_texts == 2 and replica.limits.max_n == 3  # a limit not named keeps the args' value
    with pytest.raises(ValueError, match="max_textz"):
        cls.reconfigure(replica, {"limits": {"max_textz": 2}})


@pytest.mark.parametrize("limits", [5, "max_n", [1]])
def test_user_config_limits_that_are_not_a_mapping_are_refused_naming_them(limits):
    from service.config import limits_from_user_config

    with pytest.raises(ValueError, match="user_config.limits must be a mapping of ApiLimits fields"):
        limits_from_user_config({"limits": limits}, ApiLimits())


@pytest.mark.parametrize("user_config", [5, "limits", ["limits"]])
def test_user_config_that_is_not_a_mapping_is_refused_naming_it(user_config):
    """A number ended in a TypeError, a list in an AttributeError, a string in its characters named as
    unknown fields."""
    from service.config import limits_from_user_config

    with pytest.raises(ValueError, match="user_config must be a mapping like"):
        limits_from_user_config(user_config, ApiLimits())


@pytest.mark.parametrize("data, words", [
    ({"generator": {"enabled": "false"}}, "enabled must be bool"),  # a string is not a bool
    ({"limits": {"max_texts": "10"}}, "max_texts must be int"),
    ({"serve_batch_size": 1.5}, "serve_batch_size"),
    ({"serve_batch_wait_s": float("nan")}, "serve_batch_wait_s >= 0"),  # YAML's .nan
    ({"serve_batch_wait_s": float("inf")}, "serve_batch_wait_s >= 0 and finite"),  # YAML's .inf: one request hung
    # a template that does not compile: every chat request answered 400 for the server's own template
    ({"generator": {"chat_template": "{% for m in messages %}{{ m }"}}, "chat_template: chat template does not"),
    ({"generator": 5}, "must be a mapping"),
    # nothing to serve: /readyz answered 503 for ever, and `attnserve serve` waited on it
    ({"generator": {"enabled": False}, "translator": {"enabled": False}}, "both disabled"),
    ({"translator": [1]}, "must be a mapping"),
])
def test_config_values_of_the_wrong_type_are_refused_naming_the_field(data, words):
    with pytest.raises(ValueError, match=words):
        ServiceConfig.from_dict(data)


def test_the_service_url_brackets_an_ipv6_host_and_ends_in_the_route_prefix():
    from service.ray_local import ATTNSERVE_APP, service_url

    def config(host, route_prefix=None):
        return {"http_options": {"host": host, "port": 8000},
                "applications": [{"import_path": ATTNSERVE_APP, "route_prefix": route_prefix}]}

    assert service_url(config("127.0.0.1")) == "http://127.0.0.1:8000"
    assert service_url(config("::1", "/")) == "http://[::1]:8000"
    assert service_url(config("127.0.0.1", "/api/")) == "http://127.0.0.1:8000/api"


def test_a_host_folder_that_cannot_be_written_costs_the_generator_only(tmp_path, monkeypatch):
    from service import models
    from tests.serve_fixture import tiny_checkpoints

    def unwritable(mode, cfg):
        raise OSError(30, "Read-only file system", "quantization-auto.txt")

    monkeypatch.setattr(models, "resolve_quantization", unwritable)
    gen, tr = tiny_checkpoints(tmp_path)
    cfg = ServiceConfig.from_dict({"generator": {"checkpoint": str(gen), "device": "cpu", "dtype": "float32",
                                                 "quantization": "auto", "engine": {"compile": False}},
                                   "translator": {"checkpoint": str(tr), "device": "cpu", "dtype": "float32",
                                                  "engine": {"compile": False}}})
    b = load_backends(cfg, log=lambda *_: None)
    assert b.translator is not None and b.generator is None
    assert "Read-only" in b.unavailable[GENERATOR_ID]


def test_a_checkpoint_of_the_other_architecture_is_reported_not_a_crash(tmp_path):
    """generator.checkpoint at a translator's folder (or the reverse) is that model's reason on /readyz, and
    the replica starts: an AttributeError deep in the engine failed its start-up, both models with it."""
    from tests.serve_fixture import tiny_checkpoints

    gen, tr = tiny_checkpoints(tmp_path)
    spec = {"device": "cpu", "dtype": "float32", "engine": {"compile": False}}
    cfg = ServiceConfig.from_dict({"generator": {**spec, "checkpoint": str(tr)},
                                   "translator": {**spec, "checkpoint": str(gen)}})
    b = load_backends(cfg, log=lambda *_: None)
    assert b.generator is None and b.translator is None
    assert "translation (encoder-decoder) checkpoint" in b.unavailable[GENERATOR_ID]
    assert "decoder checkpoint, not a translator's" in b.unavailable[TRANSLATOR_ID]


def test_a_translator_compiled_after_ready_is_reported_starting_not_compiling(monkeypatch):
    """Where a child builds the translator's packages after ready (service/prebuild.py), its engine starts
    eagerly: the start-up phase says it starts, not that it compiles its decode step."""
    import asyncio
    import types

    from service import deployments, models, prebuild
    from service.api.backends import Backends
    from service.startup import Startup

    cls = deployments.AttnServe.func_or_class
    replica = cls.__new__(cls)
    seen = []

    class Translator:
        name = TRANSLATOR_ID
        engine = types.SimpleNamespace(config=types.SimpleNamespace(compile=True), compile_later=False, compiled=None)

        async def start(self):
            seen.append(replica.startup.snapshot())

    replica.config = ServiceConfig.from_dict({"generator": {"enabled": False}})
    replica.startup, replica.backends = Startup(), Backends()
    monkeypatch.setattr(models, "load_backends", lambda *a, **k: Backends(translator=Translator()))
    monkeypatch.setattr(prebuild, "translator_build_needed", lambda *a: True)
    monkeypatch.setattr(prebuild, "start_translator_build", lambda *a: seen.append(replica.startup.snapshot()))
    monkeypatch.setattr(deployments, "gc", types.SimpleNamespace(collect=lambda: 0, freeze=lambda: None))
    asyncio.run(cls._load(replica, None))
    assert seen[0]["phase"] == "starting the translator engine"
    assert seen[0]["models"][TRANSLATOR_ID] == "starting"
    # ready while the build runs behind requests, and /readyz says so (a load test waits for it)
    assert seen[1]["ready"] and seen[1]["models"][TRANSLATOR_ID].startswith("ready (eager until its compiled")
    assert seen[1]["warming"][TRANSLATOR_ID].startswith("building its compiled steps")
    # the build ended (here: no child, nothing built): the state says what it serves with now
    snap = replica.startup.snapshot()
    assert snap["warming"] == {}
    assert snap["models"][TRANSLATOR_ID] == "ready (eager: its compiled steps could not be built)"

    def cancelled(*a):
        raise asyncio.CancelledError

    # the build cancelled (the replica shutting down): `warming` does not stay set
    monkeypatch.setattr(prebuild, "start_translator_build", cancelled)
    replica.startup, replica.backends = Startup(), Backends()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cls._load(replica, None))
    assert replica.startup.snapshot()["warming"] == {}
