#!/usr/bin/env bash
# Installs what the browser tests (pytest -m browser) need: Debian's chromium + chromium-driver,
# and selenium into the venv. Idempotent; the Makefile's test target calls it only when something is missing.
set -euo pipefail
VENV="${VENV:-.venv}"
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-noto-cjk
fi
if ! "$VENV/bin/python" -c "import selenium" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "selenium>=4.20"
fi
