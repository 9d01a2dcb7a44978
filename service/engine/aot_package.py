"""Compiled steps kept across starts as AOTInductor packages under `$ATTNSERVE_HOME/compile`.

`torch.compile` re-traces at every start, and cannot cache a step whose float linears are frozen at all; a
package (torch.export + AOTInductor: generated C++, its library, the weights as constants) loads at once,
with the same dynamic sizes and outputs. It is reused only for the same torch, CPU flags, thread count, step
code, weights and cache shape. A *shared* package takes a module's weights as trailing inputs instead, so one
graph serves every module of the same structure (the decoder's runs of identical layers).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch._inductor.config

from model import native_ops
from model.file_lock import file_lock
from model.paths import REPO_ROOT as ROOT
from model.quantize import handles_as_inputs

log = logging.getLogger(__name__)
KEEP = 3  # packages kept per step at least
KEEP_BYTES = 64 * 2**20  # and more, the newest first, while a step's packages stay within this


class _Step(torch.nn.Module):
    """A pure step function of (model, *tensors) as the module torch.export takes."""

    def __init__(self, fn: Callable, model: torch.nn.Module):
        super().__init__()
        self.fn, self.model = fn, model

    def forward(self, *args):
        return self.fn(self.model, *args)


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's parameters, then buffers, in a fixed order: the trailing inputs of a shared package."""
    return [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]


class _Shared(torch.nn.Module):
    """`fn(template, *args)` with the template's weights as the trailing inputs. The template is kept out
    of this module's own attributes, so torch.export finds no constants to hold."""

    def __init__(self, fn: Callable, template: torch.nn.Module, n_args: int):
        super().__init__()
        step = _Step(fn, template)
        self.n_args, self._step = n_args, [step]
        self.names = [n for n, _ in step.named_parameters()] + [n for n, _ in step.named_buffers()]

    def forward(self, *args):
        given = dict(zip(self.names, args[self.n_args:], strict=True))
        return torch.func.functional_call(self._step[0], given, args[:self.n_args], strict=True)


_ISA_LOCK = threading.Lock()  # the config patch below is process-wide


@functools.cache
def known_vec_isa(where: Path) -> None:
    """Let this process skip inductor's vector-ISA probe where an earlier one on this host made it.

    At a first package load inductor compiles and runs a test per ISA the CPU lists, in a child Python. The
    first process records the answer with what it depends on (compiler, torch, the listed ISAs); a later one
    whose record matches takes the listed ISAs as probed. Any failure here just means probing as usual."""
    from torch._inductor import cpp_builder, cpu_vec_isa

    if platform.machine() not in ("x86_64", "AMD64"):
        return
    record = where / "vec-isa.txt"
    with _ISA_LOCK:
        try:
            flags = cpu_vec_isa.x86_isa_checker()
            listed = [str(i) for i in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(i).split())]
            head = [digest([cpp_builder.get_compiler_version_info(cpp_builder.get_cpp_compiler())]), torch.__version__]
            if record.is_file() and record.read_text(encoding="utf-8") == "\n".join([*head, *listed]):
                with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
                    cpu_vec_isa.valid_vec_isa_list()
                return
            probed = [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]
            tmp = record.with_suffix(f".{os.getpid()}")
            tmp.write_text("\n".join([*head, *probed]), encoding="utf-8")
            tmp.replace(record)
        except Exception:  # only time is at stake: inductor probes when it needs to, as without this
            log.debug("vector-ISA record not used", exc_info=True)


def _runner(path: Path) -> Callable:
    """The package's run function over flat tensors (no pytree round trip: every step takes and returns
    flat tuples). Our C++ kernels are registered first: a package may call them."""
    native_ops.load()
    known_vec_isa(path.parent)
    run = torch._inductor.aoti_load_package(str(path)).loader.boxed_run
    return lambda *tensors: tuple(run(list(tensors)))


STEP_MODULES = ("model/decoder_step.py", "model/seq2seq_step.py", "model/quantize.py", "service/engine/compiled.py",
                "service/engine/aot_package.py")


def step_sources() -> list[Path]:
    """The files a package's generated code depends on: the step modules and every module of model/ they
    import (read from their import statements, so training or importer code changes no package), our C++
    kernels, and the compile code."""
    todo, seen = [ROOT / m for m in STEP_MODULES], set()
    while todo:
        f = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "model":
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]  # a name may be a module
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "model"]
            else:
                continue
            for name in names:
                base = ROOT.joinpath(*name.split("."))
                todo += [base.with_suffix(".py"), base / "__init__.py"]
    return sorted(seen) + sorted((ROOT / "model" / "csrc").glob("*.cpp"))


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """A digest of `step_sources()`: a package is reused only for the same code. Python files count by
    their syntax tree less docstrings, so comments, docstrings and layout rebuild nothing."""
    h = hashlib.blake2b(digest_size=12)
    for f in step_sources():
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(code_of(f.read_text(encoding="utf-8")).encode() if f.suffix == ".py" else f.read_bytes())
    return h.hexdigest()


def code_of(source: str) -> str:
    """A module's syntax tree without its docstrings, as text: what its code does, not how it reads."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and ast.get_docstring(node, clean=False) is not None):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree)


def digest(parts: Sequence[object]) -> str:
    """A file name's digest of a key (its values' reprs): what a file kept across starts is built from."""
    return hashlib.blake2b(repr(list(parts)).encode(), digest_size=12).hexdigest()


def fingerprint(model: torch.nn.Module) -> str:
    """The model's weights and buffers (frozen into a package as constants), and the opaque quantized
    kernels' own fingerprints (model/quantize.py)."""
    h = hashlib.blake2b(digest_size=12)
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy() if t.numel() else b"")
    for name, m in model.named_modules():
        if hasattr(m, "fingerprint"):
            h.update(f"{name}:{m.fingerprint}".encode())
    return h.hexdigest()


def package_path(directory: Path, name: str, key: Sequence[object], *, freezing: bool, shared: bool = False,
                 threads: int | None = None) -> Path:
    """Where the package of step `name` for `key` is (or will be): `threads` is the torch thread count it
    is built and run under (default: the calling thread's)."""
    threads = torch.get_num_threads() if threads is None else threads
    parts = [name, torch.__version__, threads, freezing, shared, code_hash(), *key]
    return directory / "aoti" / f"{name}-{digest(parts)}.pt2"


def load_or_build(directory: Path, name: str, fn: Callable, model: torch.nn.Module, args: Sequence[torch.Tensor],
                  dynamic_shapes: Sequence[dict | None], *, freezing: bool, key: Sequence[object],
                  shared: bool = False, threads: int | None = None, build: bool = True,
                  wait: bool = True) -> Callable | None:
    """The package of `fn(model, *args)` with `dynamic_shapes` (one dict per arg: dim -> torch.export.Dim),
    loaded from `directory` when built before for the same `key` (plus torch, threads and code), else
    exported, compiled and saved there. Returns a callable of the same tensors -> the same outputs; with
    `shared`, of (*args, *weights(module)) for any module shaped as `model` (the key need not name its
    weights, only its structure). `threads`: as `package_path`; without `build`, None where it was never built;
    without `wait`, None where another process is building it."""
    if shared:  # the graph reads its weights' bytes as traced: another dtype or layout needs another graph
        key = (*key, *((str(t.dtype), tuple(t.shape), t.stride()) for t in weights(model)))
    path = package_path(directory, name, key, freezing=freezing, shared=shared, threads=threads)
    step = _load(path, name)
    if step is not None or not build:
        return step
    with file_lock(path.with_suffix(".lock"), wait) as held:  # a replica starting beside this one builds it once
        if not held:
            return None
        return _load(path, name) or _build(path, name, fn, model, args, dynamic_shapes, freezing, shared)


def load_or_build_each(*steps: Callable[..., Callable | None]) -> list[Callable]:
    """Each of `steps` (`load_or_build` calls that build, bound but for `wait`), those no other process is
    building first: two replicas starting side by side build one step's packages at the same time, each its
    own, rather than one building all of them while the other waits."""
    out: list[Callable | None] = [None] * len(steps)
    while todo := [i for i, step in enumerate(out) if step is None]:
        for i in todo:
            out[i] = steps[i](wait=False)
        if all(out[i] is None for i in todo):  # all being built elsewhere: wait for the first
            out[todo[0]] = steps[todo[0]](wait=True)
            if out[todo[0]] is None:
                raise RuntimeError("load_or_build_each: a step that does not build (build=False)")
    return out


def _load(path: Path, name: str) -> Callable | None:
    if not path.is_file():
        return None
    t0 = time.perf_counter()
    try:
        step = _runner(path)
    except Exception:  # a damaged or foreign file: build it again
        log.warning("%s: could not load %s; building it again", name, path, exc_info=True)
        return None
    log.info("%s: loaded %s in %.2f s", name, path.name, time.perf_counter() - t0)
    with contextlib.suppress(OSError):  # a package in use stays among the newest (prune)
        os.utime(path)
    return step


def _build(path: Path, name: str, fn: Callable, model: torch.nn.Module, args: Sequence[torch.Tensor],
           dynamic_shapes: Sequence[dict | None], freezing: bool, shared: bool) -> Callable:
    t0 = time.perf_counter()
    module, args, dynamic_shapes = _Step(fn, model), tuple(args), tuple(dynamic_shapes)
    if shared:
        module, w = _Shared(fn, model, len(args)), weights(model)
        args, dynamic_shapes = args + tuple(w), dynamic_shapes + (None,) * len(w)
    with torch.no_grad(), handles_as_inputs() if shared else contextlib.nullcontext():
        ep = torch.export.export(module, args, dynamic_shapes={"args": dynamic_shapes}, strict=False)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
    # inductor freezes only a graph compiled without autograd: with grad on it silently ignores `freezing`
    with torch.no_grad(), torch._inductor.config.patch(freezing=freezing):
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
    os.replace(tmp, path)  # atomic: a process loading it sees all of it or nothing
    log.info("%s: built %s in %.1f s", name, path.name, time.perf_counter() - t0)
    prune(path.parent, name)
    return _runner(path)


def prune(directory: Path, name: str, keep: int = KEEP, keep_bytes: int = KEEP_BYTES) -> None:
    """Keep the `keep` most recently built or loaded packages of a step (other weights, code or settings), and
    newer ones beyond those while they fit in `keep_bytes`: the folder stays bounded, and evaluating other
    checkpoints or benchmarking other engine settings does not evict the packages a service loads."""
    built = []
    for p in directory.glob(f"{name}-*.pt2"):
        if not p.name.endswith(".tmp.pt2"):  # not others' builds
            with contextlib.suppress(FileNotFoundError):  # pruned by another process meanwhile
                st = p.stat()
                built.append((st.st_mtime, st.st_size, p))
    total = 0
    for i, (_, size, p) in enumerate(sorted(built, key=lambda t: t[0], reverse=True)):
        total += size
        if i >= keep and total > keep_bytes:
            p.unlink(missing_ok=True)
            p.with_suffix(".lock").unlink(missing_ok=True)
