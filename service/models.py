"""Loading the served models: checkpoint -> model + tokenizer -> engine -> HTTP backend.

Device and dtype come from the config, or ("auto") from what the replica was given: a GPU that
Ray assigned (or, without Ray, any visible GPU) -> cuda + bfloat16; otherwise cpu + bfloat16 where a bf16
matmul measures faster on this CPU, else float32.
A model that cannot be loaded is reported (Backends.unavailable) instead of failing the service.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from model.config import DecoderConfig, Seq2SeqConfig
from model.paths import REPO_ROOT
from service.api.backends import DISABLED, Backends
from service.config import DEFAULT_TRANSLATOR_DIR, GENERATOR_ID, TRANSLATOR_ID, ModelSpec, ServiceConfig
from service.engine.config import EngineConfig
from service.frontend.generator import GeneratorFrontend
from service.startup import Startup

if TYPE_CHECKING:
    from service.frontend.translator import TranslationFrontend


class ModelUnavailable(RuntimeError):
    """The model's files are missing or unreadable; the message says what to do."""


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when bf16 is the faster CPU dtype here (model/cpu_features.py). Measured once per host
    (`measured_once`): bf16 rounding changes which tokens win, so the CLI and every replica must choose alike."""
    from model.cpu_features import cpu_flags, has_bf16_instructions, prefers_bf16

    if not has_bf16_instructions(cpu_flags()):
        return False
    from service.engine.compiled import use_persistent_cache

    path = use_persistent_cache() / "dtype-auto.txt"  # the folder is keyed by torch and the CPU flags
    kept = measured_once(path, ("bfloat16", "float32"), lambda: "bfloat16" if prefers_bf16() else "float32")
    return kept == "bfloat16"


def measured_once(path: Path, answers, measure) -> str:
    """`measure()`'s answer (one of `answers`), kept in `path` for every later start on this host: replicas
    (or the CLI beside a running service) starting side by side measure on a busy CPU, and must not choose
    differently."""
    from model.file_lock import file_lock

    with file_lock(path.with_suffix(".lock")):
        kept = path.read_text().strip() if path.is_file() else ""
        if kept not in answers:
            kept = measure()
            path.write_text(kept)
    return kept


def select_device(device: str, dtype: str, *, cuda_available: bool, ray_gpu_ids: list | None,
                  bf16_supported: bool = True, cpu_bf16: bool = False) -> tuple[str, str]:
    """(device, dtype) for a replica. `ray_gpu_ids`: GPUs Ray assigned to this actor, None outside Ray.
    `cpu_bf16`: the CPU has native bf16 (auto dtype on CPU is then bfloat16, else float32)."""
    if device == "auto":
        wants_gpu = bool(ray_gpu_ids) if ray_gpu_ids is not None else cuda_available
        device = "cuda" if wants_gpu and cuda_available else "cpu"
    if device == "cuda" and not cuda_available:
        raise ModelUnavailable("device 'cuda' was configured but no CUDA device is visible to this replica")
    if dtype == "auto":
        if device == "cuda":
            dtype = "bfloat16" if bf16_supported else "float16"
        else:
            dtype = "bfloat16" if cpu_bf16 else "float32"
    return device, dtype


def engine_config(spec: ModelSpec) -> EngineConfig:
    """The spec's engine settings on the device and dtype this replica was given."""
    import torch

    ray = sys.modules.get("ray")  # imported wherever Ray runs: elsewhere there are no Ray GPUs to ask about
    gpu_ids = list(ray.get_gpu_ids()) if ray is not None and ray.is_initialized() else None
    cuda = torch.cuda.is_available()
    native_bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)  # emulated bf16 is slow
    device, dtype = select_device(spec.device, spec.dtype, cuda_available=cuda, ray_gpu_ids=gpu_ids,
                                  bf16_supported=native_bf16, cpu_bf16=cpu_has_native_bf16())
    return EngineConfig.from_dict({**spec.engine, "device": device, "dtype": dtype})


def _resolve(path: str) -> Path:
    return REPO_ROOT / Path(path).expanduser()  # an absolute path stands as it is


def load_generator(spec: ModelSpec, sink=None, log=print) -> GeneratorFrontend:
    from model.checkpoint import WEIGHTS_FILE, load_checkpoint, load_tokenizer
    from model.importers.hf import generation_stop_ids
    from service.engine.generation import GenerationEngine

    cfg = engine_config(spec)
    if spec.checkpoint:
        d = _resolve(spec.checkpoint)
    else:
        from model.importers.smollm2 import ensure_smollm2

        d = ensure_smollm2(dtype="bfloat16" if cfg.dtype == "bfloat16" else "float32", log=log)
    model, tok = load_checkpoint(d, dtype=cfg.torch_dtype), load_tokenizer(d)
    if not isinstance(model.cfg, DecoderConfig):  # the engine would fail on the first field it lacks
        raise ModelUnavailable(f"{d} holds a translation (encoder-decoder) checkpoint; point generator.checkpoint "
                               f"at a decoder's folder")
    # a Hugging Face folder may hold its weights in shards, listed by an index
    weights = d / WEIGHTS_FILE if (d / WEIGHTS_FILE).is_file() else d / "model.safetensors.index.json"
    quantize_generator(model, tok, spec.quantization, cfg, weights, log=log)
    eos = tok.stop_ids() if hasattr(tok, "stop_ids") else {tok.eos_id} - {None}
    eos |= generation_stop_ids(d)  # a transformers folder's generation config: it stops there too
    name = spec.name or GENERATOR_ID
    engine = GenerationEngine(model, tok, cfg, eos_ids=eos, name=name, sink=sink)
    return GeneratorFrontend(engine, tok, name=name,
                            chat_template=spec.chat_template or getattr(tok, "chat_template", None))


def resolve_quantization(mode: str, cfg: EngineConfig) -> str:
    """'auto' -> the fastest of none / int8 / int4 on this CPU (measured at the first start on this host);
    'none' on GPU."""
    if cfg.device != "cpu":
        if mode in ("int8", "int4"):
            raise ValueError(f"ModelSpec.quantization {mode!r} runs on CPU only; use none on {cfg.device}")
        return "none"
    if mode != "auto":
        return mode
    from model.quantize import QUANTIZATIONS, choose_quantization
    from service.engine.aot_package import code_hash
    from service.engine.compiled import use_persistent_cache

    # once per host (the folder is keyed by torch and CPU flags) and kernel code
    step = "compiled" if cfg.compile else "eager"
    path = use_persistent_cache() / f"quantization-auto-{cfg.dtype}-{step}-{code_hash()[:8]}.txt"
    return measured_once(path, QUANTIZATIONS, lambda: choose_quantization(cfg.torch_dtype, cfg.compile))


def quantize_generator(model, tok, mode: str, cfg: EngineConfig, weights: Path, log=print) -> None:
    """`weights`: the checkpoint's file; its calibration maxima are kept across starts (keyed by the
    file's path, size and time, the mode, dtype and the quantization code)."""
    from model.quantize import CALIBRATION_TEXT, quantize_decoder
    from service.engine.aot_package import code_hash, digest
    from service.engine.compiled import use_persistent_cache

    mode = resolve_quantization(mode, cfg)
    if mode == "none":
        return
    t0 = time.perf_counter()
    st = weights.resolve().stat()
    key = (str(weights.resolve()), st.st_size, st.st_mtime_ns, mode, cfg.dtype, code_hash(),
           hashlib.sha256(CALIBRATION_TEXT.read_bytes()).hexdigest())
    maxima = use_persistent_cache() / "calibration" / f"{mode}-{digest(key)}.safetensors"
    n = quantize_decoder(model, tok, mode, maxima=maxima)
    log(f"attnserve: generator linears in {mode}: {n} layers in {time.perf_counter() - t0:.1f} s")


def load_translator(spec: ModelSpec, sink=None) -> TranslationFrontend:
    from model.checkpoint import load_checkpoint, load_tokenizer
    from service.engine.translation import TranslationEngine
    from service.frontend.translator import TranslationFrontend

    d = _resolve(spec.checkpoint or DEFAULT_TRANSLATOR_DIR)
    if not (d / "config.json").is_file():
        raise ModelUnavailable(f"no translator checkpoint at {d}; train one (`attnserve train translate`) "
                               f"or point translator.checkpoint at a checkpoint folder")
    if spec.quantization not in ("auto", "none"):
        raise ValueError(f"translator.quantization {spec.quantization!r}: the translator is served in full "
                         f"precision (its quality in int8/int4 is not measured); use none")
    cfg = engine_config(spec)
    model = load_checkpoint(d, dtype=cfg.torch_dtype)
    if not isinstance(model.cfg, Seq2SeqConfig):  # the engine would fail on the first field it lacks
        raise ModelUnavailable(f"{d} holds a decoder checkpoint, not a translator's (encoder-decoder); point "
                               f"translator.checkpoint at one")
    engine = TranslationEngine(model, cfg, name=spec.name or TRANSLATOR_ID, sink=sink)
    return TranslationFrontend(engine, load_tokenizer(d))


def load_backends(cfg: ServiceConfig, sink=None, log=print, startup=None) -> Backends:
    """Every enabled model that loads; the others with the reason they did not. `startup`
    (service/startup.py) hears each model's phase: loading, loaded (MB, MB/s), unavailable."""
    import torch

    from model.checkpoint import CheckpointError
    from service.engine import generation, translation  # noqa: F401  (first: their imports are no model's load time)
    from service.engine.cpu_runtime import single_threaded_caller

    # what keeps one model from loading is reported and the other still served; a GPU too small for a
    # model (two replicas may share one) is one of them
    load_errors = (ModelUnavailable, CheckpointError, FileNotFoundError, OSError, ImportError, ValueError,
                   torch.OutOfMemoryError)
    single_threaded_caller()  # engines parallelise on their own threads (see cpu_runtime)
    startup = startup or Startup()
    backends = Backends(generator_id=cfg.generator_id, translator_id=cfg.translator_id)
    for name, spec, loader, attr in ((cfg.translator_id, cfg.translator, load_translator, "translator"),
                                     (cfg.generator_id, cfg.generator, functools.partial(load_generator, log=log),
                                      "generator")):
        if not spec.enabled:
            backends.unavailable[name] = DISABLED
            continue
        startup.set(f"loading the {attr} weights", name, "loading weights")
        t0 = time.perf_counter()
        try:
            backend = loader(spec, sink)
        except load_errors as e:
            backends.unavailable[name] = str(e)
            log(f"attnserve: {name} not served: {e}")
            startup.model(name, f"unavailable: {e}")
            continue
        setattr(backends, attr, backend)
        seconds = max(time.perf_counter() - t0, 1e-6)
        model = backend.engine.model  # quantized linears keep their packed weights as buffers
        mb = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**20
        startup.model(name, f"weights loaded: {mb:.0f} MB in {seconds:.1f} s ({mb / seconds:.0f} MB/s)")
    return backends
