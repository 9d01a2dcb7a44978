"""save_checkpoint over an existing checkpoint (an export over the served translator): the files are
replaced whole or not at all, and files it does not write (the model card) stay."""

from __future__ import annotations

import pytest
import torch
from engine_util import CharTokenizer, tiny_seq2seq

from model import checkpoint
from model.checkpoint import load_checkpoint, save_checkpoint


class SavingTokenizer(CharTokenizer):
    def save(self, directory):
        (directory / "tokenizer.model").write_bytes(b"chars")


def test_an_export_over_a_checkpoint_replaces_its_files_and_keeps_the_others(tmp_path):
    d = tmp_path / "attnserve-zh-en"
    old = tiny_seq2seq()
    save_checkpoint(old, d, tokenizer=SavingTokenizer())
    (d / "MODEL_CARD.md").write_text("card")
    new = tiny_seq2seq()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1.0)
    save_checkpoint(new, d, tokenizer=SavingTokenizer())
    assert (d / "MODEL_CARD.md").read_text() == "card"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attnserve-zh-en"]  # no temporary folder left
    got = load_checkpoint(d).state_dict()
    assert all(torch.equal(got[k], v) for k, v in new.state_dict().items())


def test_a_write_that_fails_leaves_the_checkpoint_as_it_was(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    model = tiny_seq2seq()
    save_checkpoint(model, d, tokenizer=SavingTokenizer())
    before = {p.name: p.read_bytes() for p in d.iterdir()}

    def full_disk(*args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_save_tensors", full_disk)
    with pytest.raises(OSError, match="space"):
        save_checkpoint(tiny_seq2seq(), d, tokenizer=SavingTokenizer())
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_a_folder_a_kill_left_mid_save_is_ignored_by_git(tmp_path):
    """A kill during an export over weights/attnserve-zh-en leaves its temporary folder beside it: `git add -A`
    committed the model-sized files."""
    import subprocess

    from model.paths import REPO_ROOT

    tmp = f"weights/.attnserve-zh-en.{12345}.tmp/model.safetensors"
    r = subprocess.run(["git", "check-ignore", "--no-index", "-q", tmp], cwd=REPO_ROOT)
    assert r.returncode == 0
