"""`attnserve loadtest`: runs the Locust scenarios headless in a subprocess and summarises them.

    attnserve loadtest --scenario generate-stream --users 16 --duration 60s [--host URL]
    attnserve loadtest sweep --scenario chat-stream --users 1,4,16,64 --duration 30s
    attnserve loadtest --scenario chat-stream --rate 2 --users 32      # open loop, 2 req/s, <= 32 in flight

Each run writes Locust's CSVs, its HTML report and our per-request records into results/<timestamp>/
(one sub-folder per user count for a sweep, plus sweep.csv and PNG plots), then prints a summary table.
Locust runs as its own process: its gevent monkey-patching and Ray must never share one."""

from __future__ import annotations

import argparse
import csv
import ipaddress
import itertools
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from loadtests.datasets import by_direction, read_jsonl
from loadtests.records import read_records
from loadtests.scenarios import SCENARIOS
from loadtests.summary import Summary, format_table, summarize
from model.progress import progress
from service.config import GENERATOR_ID

REPO = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
DEFAULT_HOST = "http://127.0.0.1:8000"
LOCUST_STOP_S = 30.0  # for Locust to write its report after SIGTERM
WARM_POLLS = 8  # /readyz answers in a row with nothing warming before a run starts
WARM_TIMEOUT_S = 900.0


class UsageError(ValueError):
    """Bad command-line input: printed as a message, exit status 2."""


def parse_duration(text: str) -> float:
    """ "60s", "2m", "1m30s", "45" -> seconds."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        if float(text) <= 0:
            raise UsageError(f"duration must be positive, got {text!r}")
        return float(text)
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    if not text or not m:
        raise UsageError(f"bad duration {text!r}: use e.g. 30s, 2m, 1m30s")
    h, mnt, s = m.groups()
    total = int(h or 0) * 3600 + int(mnt or 0) * 60 + float(s or 0)
    if total <= 0:
        raise UsageError(f"duration must be positive, got {text!r}")
    return total


def parse_users(text: str) -> list[int]:
    """ "16" -> [16]; "1,4,16,64" -> [1, 4, 16, 64]."""
    try:
        users = [int(u) for u in text.split(",") if u.strip()]
    except ValueError:
        raise UsageError(f"bad --users {text!r}: use a number or a comma list like 1,4,16") from None
    if not users or any(u < 1 for u in users):
        raise UsageError(f"--users must be positive integers, got {text!r}")
    if len(set(users)) != len(users):  # each point has its own users-N folder; a repeat would append to it
        raise UsageError(f"--users {text!r} names a user count more than once")
    return users


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(url: str, allow_remote: bool) -> str:
    import httpx

    try:  # an unclosed "[" (IPv6) raises in urlparse, a non-numeric or out-of-range port in .port;
        # unchecked, they ended in a traceback (httpx's InvalidURL for the port)
        parsed = urlparse(url)
        port_ok = parsed.port is None or parsed.port > 0
        httpx.URL(url)  # stricter: urlparse reads `http://[::1]x:80` as loopback port 80, httpx refuses it
    except (ValueError, httpx.InvalidURL):
        parsed, port_ok = urlparse(""), False
    # urlparse ends the host part at "/", "?" or "#", requests (Locust's client) at "\\" too: with one there,
    # `http://evil.com\\@127.0.0.1` reads as loopback here but sends the load to evil.com.
    if parsed.scheme not in ("http", "https") or not parsed.hostname or "\\" in parsed.netloc or not port_ok:
        raise UsageError(f"bad --host {url!r}: use e.g. {DEFAULT_HOST}")
    if not allow_remote and not is_loopback(url):
        raise UsageError(
            f"refusing to load-test non-loopback host {parsed.hostname!r}; pass --allow-remote "
            "if you own it and mean it"
        )
    return url.rstrip("/")


def check_answers(url: str) -> None:
    """UsageError unless something answers HTTP at `url` (any status): a run against nothing records only
    connection errors."""
    import httpx

    try:
        httpx.get(url, timeout=10)
    except httpx.HTTPError as e:
        raise UsageError(f"nothing answers at {url} ({type(e).__name__}): start the service first "
                         f"(`make serve`)") from None
    except UnicodeError:  # a host name IDNA refuses (`http://localhost..`): only a request encodes it
        raise UsageError(f"bad --host {url!r}: use e.g. {DEFAULT_HOST}") from None


def wait_until_warm(url: str, timeout_s: float = WARM_TIMEOUT_S, poll_s: float = 0.5) -> None:
    """Returns once attnserve's /readyz has said ready with nothing warming WARM_POLLS times in a row (several
    replicas answer it in turn): a replica builds compiled steps behind its first requests after a first
    start (service/startup.py), and a run measured then measures that build. Another server: at once."""
    import httpx

    t0, quiet, said = time.monotonic(), 0, None
    while quiet < WARM_POLLS:
        try:
            r = httpx.get(url + "/readyz", timeout=10)
        except httpx.HTTPError:
            return
        try:
            body = r.json()
        except ValueError:  # Serve's proxy answers 503 in text while the app is not deployed yet
            body = None if r.status_code != 503 else {"phase": "the proxy answers, the app is not up", "warming": {}}
        if not isinstance(body, dict) or not isinstance(body.get("warming"), dict):
            return  # not attnserve's /readyz
        busy = body["warming"] if r.status_code == 200 else {"start-up": body.get("phase", "?")}
        quiet = 0 if busy else quiet + 1
        if busy and busy != said:
            said = busy
            what = "; ".join(f"{m}: {w}" for m, w in busy.items())
            print(f"[{time.monotonic() - t0:5.0f} s] waiting for the service to warm up ({what})", file=sys.stderr)
        if busy and time.monotonic() - t0 > timeout_s:
            print(f"still warming after {timeout_s:.0f} s: measuring anyway", file=sys.stderr)
            return
        time.sleep(poll_s)


def check_translate_file(path: str) -> None:
    """UsageError unless `path` is a JSONL of {text, target_lang} with sentences for both directions: the
    translate scenarios pick one at random, and one without sentences would raise inside Locust, where
    nothing records it as a failure."""
    if not Path(path).is_file():
        raise UsageError(f"--translate-file {path} does not exist")
    try:
        sentences = by_direction(read_jsonl(path))
    except (OSError, ValueError, KeyError, TypeError) as e:  # OSError: unreadable
        raise UsageError(f"--translate-file {path} is not a JSONL of {{text, source_lang, target_lang}} with "
                         f"target_lang en or zh ({type(e).__name__}: {e})") from None
    bad = next((t for texts in sentences.values() for t in texts if not (isinstance(t, str) and t.strip())), None)
    if bad is not None:  # the service answers each with a 400: a run of errors, not of load
        raise UsageError(f"--translate-file {path}: every text must be a non-empty string, got {bad!r}")
    for target, texts in sentences.items():
        if not texts:
            raise UsageError(f"--translate-file {path} has no sentence to translate into {target}: the "
                             "translate scenarios send both directions")


def check_results_dir(path: str) -> None:
    if Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"--results-dir {path} is a file, not a folder")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "mode",
        nargs="?",
        choices=["run", "sweep"],
        default="run",
        help="run: one load test (default); sweep: one run per --users value, with plots",
    )
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="chat-stream")
    p.add_argument("--users", default="4", help="concurrent users (sweep: comma list, e.g. 1,4,16,64)")
    p.add_argument("--duration", default="30s", help="length of each run, e.g. 30s, 2m")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"service base URL (default {DEFAULT_HOST})")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="open loop: Poisson arrivals per second (then --users caps requests in flight)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens per answer")
    p.add_argument("--beam-size", type=int, default=4)
    p.add_argument("--model", default=GENERATOR_ID, help="model id for the OpenAI endpoints")
    p.add_argument("--translate-file", default="", help="JSONL of {text, source_lang, target_lang} for the "
                   "translate scenarios (default: 100 sentences of the held-out test split)")
    p.add_argument("--results-dir", default=str(REPO / "results"), help="parent folder of the timestamped results")
    p.add_argument("--label", default="attnserve", help="name of the target in tables and plots")


def locust_command(args: argparse.Namespace, users: int, duration_s: float, out: Path) -> list[str]:
    """The Locust command line of one run (closed loop, or open loop with one arrival-generating user)."""
    open_loop = args.rate > 0
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--only-summary",
        "-u",
        "1" if open_loop else str(users),
        "-r",
        "1" if open_loop else str(users),
        "-t",
        f"{max(1, round(duration_s))}s",
        "-H",
        args.host,
        "--csv",
        str(out / "locust"),
        "--html",
        str(out / "report.html"),
        "--loglevel",
        "WARNING",
        "--records-file",
        str(out / "requests.jsonl"),
        "--max-tokens",
        str(args.max_tokens),
        "--temperature",
        str(args.temperature),
        "--beam-size",
        str(args.beam_size),
        "--model",
        args.model,
    ]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    if args.translate_file:
        cmd += ["--translate-file", str(Path(args.translate_file).resolve())]
    if open_loop:
        cmd += ["--arrival-rate", str(args.rate), "--max-inflight", str(users)]
    cmd.append(SCENARIOS[args.scenario])
    return cmd


def run_once(args: argparse.Namespace, users: int, duration_s: float, out: Path, tick=None) -> Summary:
    """One headless Locust run into `out`; returns its summary (ValueError when nothing was recorded).
    `tick()` is called about every second while Locust runs (a progress bar's refresh)."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = locust_command(args, users, duration_s, out)
    with open(out / "locust.log", "w") as log:
        # Locust exits 1 when any request failed; the failures are in the records, so that is not fatal here.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + duration_s + 180
        try:
            while True:
                try:
                    proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(cmd, duration_s + 180) from None
                    if tick:
                        tick()
        finally:
            if proc.poll() is None:  # timed out or interrupted: Locust must not outlive us
                stop_locust(proc)
    records = read_records(out / "requests.jsonl")
    if not records:
        tail = (out / "locust.log").read_text(errors="replace")[-1500:]
        raise ValueError(f"no requests recorded against {args.host}; locust log:\n{tail}")
    summary = summarize(records, scenario=args.scenario, users=users)
    write_summaries(out / "summary.csv", [(args.label, summary)])
    return summary


def stop_locust(proc: subprocess.Popen) -> None:
    """SIGTERM first, so Locust writes its CSVs and report; killed if it does not stop in time."""
    try:
        proc.terminate()
        proc.wait(timeout=LOCUST_STOP_S)
    except subprocess.TimeoutExpired:
        pass
    finally:  # also when a second Ctrl-C cuts the wait short
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def report_interrupted(args: argparse.Namespace, rows: list[tuple[str, Summary]], users: int, out: Path) -> int:
    """Ctrl-C during the run at `users`: the table of what was measured, that run's part included -> 130."""
    records = read_records(out / "requests.jsonl")
    if records:
        rows = [*rows, (args.label, summarize(records, scenario=args.scenario, users=users))]
    if not rows:
        print("attnserve loadtest: interrupted before any request finished; nothing was measured", file=sys.stderr)
        return 130
    print(format_table(rows))
    cut = f"the users={users} row covers only the part that ran" if records else f"users={users} measured nothing"
    print(f"attnserve loadtest: interrupted; {cut} (results: {out})", file=sys.stderr)
    return 130


def write_summaries(path: Path, rows: list[tuple[str, Summary]]) -> None:
    """One CSV row per (target, summary); the format plots.read_sweep reads."""
    dicts = [{"target": label, **s.to_row()} for label, s in rows]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(dicts[0]))
        w.writeheader()
        w.writerows(dicts)


def new_results_dir(parent: str | Path, tag: str) -> Path:
    """A new folder in `parent` (made where missing); UsageError where it cannot be made."""
    base = f"{time.strftime('%Y%m%d-%H%M%S')}-{tag}"
    try:
        # the parent first: a FileExistsError of its own (a dangling link) must not read as a taken name
        Path(parent).mkdir(parents=True, exist_ok=True)
        for i in itertools.count(1):  # another run may have started within the same second: never share its folder
            path = Path(parent) / (base if i == 1 else f"{base}-{i}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
    except OSError as e:  # under a file, a link to nowhere, a folder this user cannot write
        raise UsageError(f"--results-dir {parent}: cannot create a folder there ({e.strerror})") from None


def run(args: argparse.Namespace) -> int:
    try:
        args.host = check_host(args.host, args.allow_remote)
        duration_s = parse_duration(args.duration)
        users = parse_users(args.users)
        if args.mode == "run" and len(users) != 1:
            raise UsageError("a single run takes one --users value; use `attnserve loadtest sweep` for a list")
        if not (math.isfinite(args.rate) and args.rate >= 0):
            raise UsageError(f"--rate must be a number >= 0, got {args.rate}")
        for name, value, low in (("--max-tokens", args.max_tokens, 1), ("--beam-size", args.beam_size, 1),
                                 ("--temperature", args.temperature, 0)):
            if not value >= low:
                raise UsageError(f"{name} must be >= {low}, got {value}")
        if args.translate_file:
            check_translate_file(args.translate_file)
        check_results_dir(args.results_dir)
        check_answers(args.host)
        wait_until_warm(args.host)
        out = new_results_dir(args.results_dir, f"{args.mode}-{args.scenario}")
    except UsageError as e:
        print(f"attnserve loadtest: {e}", file=sys.stderr)
        return 2
    shape = f"open loop {args.rate}/s" if args.rate > 0 else "closed loop"
    print(f"{args.scenario} against {args.host}, {shape}, {args.duration} per run -> {out}", file=sys.stderr)
    rows: list[tuple[str, Summary]] = []
    interrupted_at = None
    failure = ""
    with progress(desc=f"loadtest {args.mode}", total=len(users), unit="point") as bar:
        for u in users:
            sub = out if args.mode == "run" else out / f"users-{u}"
            bar.set_postfix({"users": u})
            try:
                rows.append((args.label, run_once(args, u, duration_s, sub, tick=bar.refresh)))
            except KeyboardInterrupt:  # Locust is stopped (run_once); reported once the bar is closed
                interrupted_at = u
                break
            except ValueError as e:
                failure = str(e)
                break
            except subprocess.TimeoutExpired as e:  # Locust outlived its run by minutes: it was killed
                failure = (f"Locust did not finish within {e.timeout:.0f} s of a {duration_s:.0f} s run "
                           f"(see {sub / 'locust.log'})")
                break
            bar.update(1)
    if interrupted_at is not None:
        return report_interrupted(args, rows, interrupted_at, sub)
    if rows:  # a failed point keeps the points measured before it
        print(format_table(rows))
        if args.mode == "sweep":
            from loadtests.plots import plot_sweep

            write_summaries(out / "sweep.csv", rows)
            for p in plot_sweep(out / "sweep.csv", title=f"{args.scenario}: throughput vs concurrency"):
                print(f"plot: {p}", file=sys.stderr)
    if failure:
        kept = f"; the {len(rows)} point(s) before it are kept" if rows else ""
        print(f"attnserve loadtest: users={u}: {failure}{kept} (results: {out})", file=sys.stderr)
        return 1
    print(f"results: {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.cli", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
