"""Where attnserve keeps downloads, converted checkpoints, data and training runs."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_TRANSLATOR = REPO_ROOT / "weights" / "attnserve-zh-en"  # the translator we train and serve


def home() -> Path:
    """`$ATTNSERVE_HOME`, default `~/.cache/attnserve`."""
    return Path(os.environ.get("ATTNSERVE_HOME", Path.home() / ".cache" / "attnserve"))


def downloads() -> Path:
    return home() / "downloads"
