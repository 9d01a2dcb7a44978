"""A compiled package is keyed by the code it was generated from: the model modules the steps import (read
from their import statements), our C++ kernels and the compile code; training and importer code is not
part of it, so changing it rebuilds no package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from service.engine.aot_package import ROOT, code_of, step_sources


def relative() -> set[str]:
    return {str(f.relative_to(ROOT)) for f in step_sources()}


def test_the_step_code_and_kernels_are_in_the_key_training_and_importers_are_not():
    files = relative()
    assert {"model/attention.py", "model/kv_cache.py", "model/decoder.py", "model/seq2seq.py",
            "model/cpu_features.py", "model/csrc/prefix_attention.cpp", "model/csrc/int4_linear.cpp",
            "service/engine/compiled.py", "service/engine/aot_package.py"} <= files
    assert not [f for f in files if f.startswith(("model/training/", "model/importers/"))]
    assert "model/tokenizer.py" not in files and "model/punctuation.py" not in files


def test_every_model_module_the_compile_code_loads_is_in_the_key():
    """What a fresh interpreter has imported from model/ once the compile code and the quantized kernels'
    lazy imports are loaded: none of it may change without changing the key."""
    code = ("import sys, service.engine.compiled, model.native_ops, model.cpu_features; "
            "print('\\n'.join(m.__file__ for n, m in list(sys.modules.items()) "
            "if n == 'model' or n.startswith('model.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = {str(Path(p).resolve().relative_to(ROOT)) for p in out.split()}
    assert loaded and loaded <= relative()


def test_comments_docstrings_and_layout_leave_the_key_code_does_not():
    """A package is keyed by what its code does: rewording a comment or docstring, or reflowing a line,
    rebuilds nothing; any change to the code does."""
    source = (ROOT / "model" / "attention.py").read_text(encoding="utf-8")
    reworded = ('"""Reworded."""\n' + source.split('"""', 2)[2]).replace("# (B", "#  (B")
    reworded = reworded.replace("\n\n\nclass ", "\n\n# a new comment\nclass ", 1)
    reworded = reworded.replace("chunk(2, dim=-1)", "chunk(\n            2, dim=-1)", 1)  # reflowed
    assert reworded != source and code_of(reworded) == code_of(source)
    for before, after in (("chunk(2, dim=-1)", "chunk(2, dim=-2)"), ("transpose(1, 2)", "transpose(2, 1)")):
        assert before in source
        assert code_of(source.replace(before, after, 1)) != code_of(source)
