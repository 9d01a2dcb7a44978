"""Side by side: the same Locust scenario against attnserve and llama.cpp's `llama-server` on the very
same SmolLM2 GGUF, with 2 threads, in one run -> one table, one sweep.csv, one set of plots.

    make loadtest-compare            # builds llama-server once (~8 min, both cores), then runs this
    python -m loadtests.compare_llamacpp --users 1,4,16,64 --duration 60s [--attnserve URL]

attnserve must already be running (`make serve`). llama-server is started here on a free loopback port
with `-t 2 -tb 2 -np 16 -c 4096 --cont-batching` (each slot gets 256 tokens of context). Both targets get
the OpenAI chat endpoint, greedy, the same prompts and max_tokens; answers may end at EOS at different
lengths (Q4_1 kernels vs fp32), so compare output tokens/s rather than requests/s. Not part of CI."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtests import cli
from loadtests.plots import plot_sweep
from loadtests.summary import Summary, format_table

HOME = Path(os.environ.get("ATTNSERVE_HOME", Path.home() / ".cache" / "attnserve"))
LLAMA_SERVER = HOME / "llama.cpp" / "build" / "bin" / "llama-server"
GGUF = HOME / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """The SmolLM2 GGUF attnserve imports from (fetched with `attnserve weights fetch smollm2`)."""
    if GGUF.is_file():
        return GGUF
    hits = sorted(HOME.rglob("SmolLM2-135M-Instruct*.gguf"))
    if not hits:
        raise SystemExit(f"no SmolLM2 GGUF under {HOME}: run `attnserve weights fetch smollm2` first")
    return hits[0]


def start_llama_server(binary: Path, gguf: Path, parallel: int, log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2",
           "-np", str(parallel), "-c", str(256 * parallel), "--cont-batching"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama-server not healthy after 120 s; see {log}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.compare_llamacpp", description=__doc__.split("\n")[0])
    p.add_argument("--attnserve", default=cli.DEFAULT_HOST, help="URL of the running attnserve")
    p.add_argument("--scenario", default="chat-stream", choices=["chat-stream"])
    p.add_argument("--users", default="1,4,16,64")
    p.add_argument("--duration", default="60s")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--parallel", type=int, default=16, help="llama-server slots (-np)")
    p.add_argument("--llama-server", default=str(LLAMA_SERVER))
    p.add_argument("--results-dir", default=str(cli.REPO / "results"))
    a = p.parse_args(argv)
    try:
        cli.check_host(a.attnserve, allow_remote=False)
        users, duration_s = cli.parse_users(a.users), cli.parse_duration(a.duration)
    except cli.UsageError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    binary = Path(a.llama_server)
    if not binary.is_file():
        print(f"compare: {binary} missing; build it with loadtests/build_llama_server.sh (~8 min)", file=sys.stderr)
        return 2
    out = cli.new_results_dir(a.results_dir, "compare-llamacpp")
    proc, llama_url = start_llama_server(binary, find_gguf(), a.parallel, out / "llama-server.log")
    rows: list[tuple[str, Summary]] = []
    try:
        for label, host in (("attnserve", a.attnserve.rstrip("/")), ("llama-server", llama_url)):
            for u in users:
                ns = argparse.Namespace(host=host, scenario=a.scenario, rate=0.0, max_tokens=a.max_tokens,
                                        temperature=0.0, ignore_eos=False, beam_size=1, model="smollm2-135m-instruct",
                                        translate_file="", label=label)
                rows.append((label, cli.run_once(ns, u, duration_s, out / f"{label}-users-{u}")))
                print(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(format_table(rows))
    cli.write_summaries(out / "sweep.csv", rows)
    plot_sweep(out / "sweep.csv", title=f"{a.scenario}: attnserve vs llama-server (-np {a.parallel} -t 2)")
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
