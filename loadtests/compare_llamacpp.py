"""Side by side: the same Locust scenario against attnserve, llama.cpp's `llama-server` and
llama-cpp-python's server on the very same SmolLM2 GGUF, with 2 threads, in one run -> one table, one
sweep.csv, one set of plots.

    make loadtest-compare            # builds llama-server once (~8 min, both cores), then runs this
    python -m loadtests.compare_llamacpp --llama-server BIN --users 1,4,16,64 --py-users 16,64 --duration 60s
        [--attnserve URL]

attnserve must already be running (`make serve`). llama-server is started here on a free loopback port
(`llama-server -t 2 -tb 2 -np 16 -c 4096 --cont-batching`, each slot gets 256 tokens of context) and
the two are measured point by point, alternating which goes first, so each stream count compares runs
taken minutes apart; the end prints one table per stream count with both servers and their ratio. Then
`python -m llama_cpp.server` (n_threads 2, --interrupt_requests False; it serialises requests, so it gets
the shorter --py-users list). Every target gets the OpenAI chat endpoint, greedy, the
same prompts and max_tokens; answers may end at EOS at different lengths (Q4_1 kernels vs fp32), so
compare output tokens/s rather than requests/s. Not part of CI."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtests import cli
from loadtests.plots import plot_sweep
from loadtests.ports import free_port, stop_server
from loadtests.summary import Summary, format_table
from model.cpu_features import cpu_label
from model.progress import progress, write_line
from service.config import GENERATOR_ID

HOME = Path(os.environ.get("ATTNSERVE_HOME", Path.home() / ".cache" / "attnserve"))
LLAMA_CPP_PYTHON = HOME / "llama.cpp" / "py-venv" / "bin" / "python"  # made by setup_llama_cpp_python.sh
GGUF = HOME / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    """The SmolLM2 GGUF attnserve imports from (fetched with `attnserve weights fetch smollm2`)."""
    if GGUF.is_file():
        return GGUF
    hits = sorted(HOME.rglob("SmolLM2-135M-Instruct*.gguf"))
    if not hits:
        raise SystemExit(f"no SmolLM2 GGUF under {HOME}: run `attnserve weights fetch smollm2` first")
    return hits[0]


def format_ratios(rows: list[tuple[str, Summary]], ours: str, peer: str) -> str:
    """Per stream count: both servers' output tok/s, TTFT p50/p95, ITL p50, and ours / peer tok/s."""
    by = {(label, s.users): s for label, s in rows}
    counts = sorted({s.users for label, s in rows if label in (ours, peer)})

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    head = (f"{'streams':>7}  {ours + ' tok/s':>16}  {peer + ' tok/s':>18}  {'ratio':>5}  "
            f"{'TTFT p50/p95 ms (ours | peer)':>31}  {'ITL p50 ms (ours | peer)':>24}")
    lines = [head, "-" * len(head)]
    for u in counts:
        a, b = by.get((ours, u)), by.get((peer, u))
        if a is None or b is None:
            continue
        ratio = f"{a.output_tok_per_s / b.output_tok_per_s:.2f}" if b.output_tok_per_s else "-"
        ttft = f"{ms(a.ttft_p50_s)}/{ms(a.ttft_p95_s)} | {ms(b.ttft_p50_s)}/{ms(b.ttft_p95_s)}"
        itl = f"{ms(a.itl_p50_s)} | {ms(b.itl_p50_s)}"
        lines.append(f"{u:>7}  {a.output_tok_per_s:>16.1f}  {b.output_tok_per_s:>18.1f}  {ratio:>5}  {ttft:>31}  "
                     f"{itl:>24}")
    return "\n".join(lines)



def _start(cmd: list[str], url: str, health: str, log: Path, name: str) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"{name} not healthy after 180 s; see {log}")


def start_llama_server(binary: Path, gguf: Path, parallel: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2",
           "-np", str(parallel), "-c", str(256 * parallel), "--cont-batching"]
    return _start(cmd, f"http://127.0.0.1:{port}", "/health", log, "llama-server")


def start_llama_cpp_python(python: Path, gguf: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", GENERATOR_ID,
           "--host", "127.0.0.1", "--port", str(port), "--n_threads", "2", "--n_threads_batch", "2",
           "--n_ctx", "4096", "--interrupt_requests", "False"]
    return _start(cmd, f"http://127.0.0.1:{port}", "/v1/models", log, "llama_cpp.server")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.compare_llamacpp", description=__doc__.split("\n")[0])
    p.add_argument("--attnserve", default=cli.DEFAULT_HOST, help="URL of the running attnserve")
    p.add_argument("--scenario", default="chat-stream", choices=["chat-stream"])
    p.add_argument("--users", default="1,4,16,64")
    p.add_argument("--py-users", default="16,64", help="users for llama-cpp-python's server; '' skips it")
    p.add_argument("--duration", default="60s")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--parallel", type=int, default=16, help="llama-server slots (-np)")
    p.add_argument("--llama-server", required=True,
                   help="the llama-server binary (benchmarks/build_llama_server.sh prints this host's)")
    p.add_argument("--llama-cpp-python", default=str(LLAMA_CPP_PYTHON), help="python of its venv")
    p.add_argument("--results-dir", default=str(cli.REPO / "results"))
    a = p.parse_args(argv)
    try:
        cli.check_host(a.attnserve, allow_remote=False)
        users, duration_s = cli.parse_users(a.users), cli.parse_duration(a.duration)
        py_users = cli.parse_users(a.py_users) if a.py_users else []
        cli.check_results_dir(a.results_dir)
    except cli.UsageError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    binary = Path(a.llama_server)
    if not binary.is_file():
        print(f"compare: {binary} missing (or not a file); build it with benchmarks/build_llama_server.sh "
              f"(~8 min)", file=sys.stderr)
        return 2
    python = Path(a.llama_cpp_python)
    if py_users and not python.is_file():
        print(f"compare: {python} missing; run benchmarks/setup_llama_cpp_python.sh (or --py-users '')",
              file=sys.stderr)
        return 2
    try:
        cli.check_answers(a.attnserve)
        cli.wait_until_warm(a.attnserve)
        out = cli.new_results_dir(a.results_dir, "compare-llamacpp")
    except cli.UsageError as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    gguf = find_gguf()
    rows: list[tuple[str, Summary]] = []
    bar = progress(desc="compare", total=2 * len(users) + len(py_users), unit="point")

    def sweep(label: str, host: str, user_list: list[int]) -> None:
        for u in user_list:
            ns = argparse.Namespace(host=host, scenario=a.scenario, rate=0.0, max_tokens=a.max_tokens,
                                    temperature=0.0, ignore_eos=False, beam_size=1, model=GENERATOR_ID,
                                    translate_file="", label=label)
            bar.set_postfix_str(f"{label}, users={u}")
            rows.append((label, cli.run_once(ns, u, duration_s, out / f"{label}-users-{u}", tick=bar.refresh)))
            bar.update(1)
            write_line(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr)

    proc, llama_url = start_llama_server(binary, gguf, a.parallel, out / "llama-server.log")
    try:  # alternate who goes first at each point (an idle server takes next to no CPU)
        for i, u in enumerate(users):
            targets = [("attnserve", a.attnserve.rstrip("/")), ("llama-server", llama_url)]
            for label, host in targets if i % 2 == 0 else targets[::-1]:
                sweep(label, host, [u])
    finally:
        stop_server(proc)
    if py_users:  # serialises requests: measured alone, after the others
        proc, url = start_llama_cpp_python(python, gguf, out / "llama-cpp-python.log")
        try:
            sweep("llama-cpp-python", url, py_users)
        finally:
            stop_server(proc)
    bar.close()
    host = cpu_label()
    print(f"host: {host}")  # the flags that change both servers' kernels, beside their figures
    print()
    print(format_table(rows))
    print()
    print(format_ratios(rows, "attnserve", "llama-server"))
    cli.write_summaries(out / "sweep.csv", rows)
    peers = f"attnserve, llama-server -np {a.parallel}" + (", llama-cpp-python" if py_users else "")
    plot_sweep(out / "sweep.csv", title=f"{a.scenario}: {peers} ({host})")
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
