"""Unit tests of the load-test tooling that need no service: records, SSE parsing, the summary, CLI
argument handling (loopback refusal), the Locust command line, plots from a recorded sweep CSV, and the
translation inputs built from a test split. Never imports Locust (gevent must not patch pytest's process)."""

import argparse
import csv
import sys

import pytest

from loadtests import cli, datasets
from loadtests.plots import plot_sweep, read_sweep
from loadtests.ports import free_port
from loadtests.records import RecordWriter, RequestRecord, read_records
from loadtests.sse import parse_sse_line
from loadtests.summary import format_table, summarize


def _rec(start, end, ok=True, status=200, ttft=None, itl=(), tokens=0, scenario="chat-stream"):
    return RequestRecord(scenario, start, end, ok, status, ttft, list(itl), tokens)


def test_summary_percentiles_throughput_and_failures():
    recs = [_rec(100.0 + i, 101.0 + i, ttft=0.1 * (i + 1), itl=[0.01 * (i + 1)] * 2, tokens=10) for i in range(5)]
    recs.append(_rec(101.0, 101.5, ok=False, status=429))
    recs.append(_rec(102.0, 102.1, ok=False, status=429))
    recs.append(_rec(103.0, 103.1, ok=False, status=0))
    s = summarize(recs, scenario="chat-stream", users=4)
    assert s.requests == 8 and s.failures == 3
    assert s.window_s == pytest.approx(5.0)  # 100.0 -> 105.0
    assert s.req_per_s == pytest.approx(5 / 5.0)
    assert s.output_tok_per_s == pytest.approx(50 / 5.0)
    assert s.ttft_p50_s == pytest.approx(0.3)
    assert s.ttft_p99_s == pytest.approx(0.4 + 0.1 * 0.96)  # linear interpolation between 0.4 and 0.5
    assert s.itl_p50_s == pytest.approx(0.03)
    assert s.e2e_p50_s == pytest.approx(1.0)
    assert s.failures_by_status == {"429": 2, "0": 1}
    assert s.error_rate == pytest.approx(3 / 8)
    table = format_table([("attnserve", s)])
    assert "429:2" in table and "300/" in table and "10.0" in table


def test_requests_cut_by_the_end_count_their_tokens_not_as_failures_or_latencies():
    """A closed-loop run ends with every user mid-request: what those streams received was served in the
    window, so it counts toward throughput (leaving it out favoured the server with the longer requests)."""
    recs = [_rec(0.0, 4.0, ttft=0.5, itl=[0.1], tokens=40), _rec(1.0, 6.0, ttft=0.2, tokens=20)]
    recs.append(RequestRecord("chat-stream", 4.0, 10.0, False, 200, 3.0, [0.5], 12, "cut by the end of the run",
                              cut=True))
    s = summarize(recs)
    assert s.requests == 2 and s.failures == 0 and s.window_s == pytest.approx(10.0)
    assert s.output_tok_per_s == pytest.approx((40 + 20 + 12) / 10.0) and s.mean_output_tokens == 30
    assert s.ttft_p95_s < 0.5 + 1e-9 and s.req_per_s == pytest.approx(0.2)


def test_summary_without_streams_has_no_ttft_and_empty_run_is_an_error():
    s = summarize([_rec(0.0, 2.0, tokens=7, scenario="generate")])
    assert s.ttft_p50_s is None and s.itl_p95_s is None and s.output_tok_per_s == pytest.approx(3.5)
    assert "-/-/-" in format_table([("x", s)])
    with pytest.raises(ValueError, match="no requests"):
        summarize([])


def test_records_roundtrip_skips_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    w = RecordWriter(path)
    w.write(_rec(1.0, 2.0, ttft=0.5, itl=[0.1, 0.2], tokens=3))
    w.write(_rec(2.0, 3.0, ok=False, status=503))
    w.close()
    with open(path, "a") as f:
        f.write('{"scenario": "chat-stream", "start": 1')  # a writer killed mid-line
    recs = read_records(path)
    assert len(recs) == 2
    with open(path, "ab") as f:  # killed inside a character of a non-ASCII error text
        f.write(b'\n{"scenario": "chat-stream", "error": "' + "模型".encode()[:4])
    assert len(read_records(path)) == 2
    assert recs[0].itl_s == [0.1, 0.2] and recs[0].e2e_s == pytest.approx(1.0) and recs[1].status == 503
    assert read_records(tmp_path / "missing.jsonl") == []


@pytest.mark.parametrize(
    "line, text, tokens, finish",
    [
        ('data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}', "Hi", None, None),
        ('data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', "", None, None),
        ('data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}', "", 9, None),
        ('data: {"choices":[{"index":0,"text":" there","finish_reason":"length"}]}', " there", None, "length"),
        ('data: {"id":"gen-1","text":"你好","token_ids":[5,6]}', "你好", None, None),
        ('data: {"text":"","finish_reason":"stop","usage":{"completion_tokens":4}}', "", 4, "stop"),
        (b'data: {"content":"x","tokens_predicted":3}', "x", 3, None),
    ],
)
def test_sse_shapes(line, text, tokens, finish):
    chunk = parse_sse_line(line)
    assert (chunk.text, chunk.usage_completion_tokens, chunk.finish_reason) == (text, tokens, finish)
    assert chunk.error is None and not chunk.done


def test_sse_done_error_and_ignored_lines():
    assert parse_sse_line("data: [DONE]").done
    assert parse_sse_line('data: {"error":{"message":"engine stopped","code":503}}').error == "engine stopped"
    assert parse_sse_line("data: {not json").error.startswith("unparseable")
    for line in ("", ": keep-alive comment", "event: ping"):
        assert parse_sse_line(line) is None


def test_duration_users_and_loopback_rules():
    assert cli.parse_duration("60s") == 60 and cli.parse_duration("2m") == 120
    assert cli.parse_duration("1m30s") == 90 and cli.parse_duration("45") == 45
    for bad in ("", "ten", "0s", "5x", "0"):
        with pytest.raises(cli.UsageError):
            cli.parse_duration(bad)
    assert cli.parse_users("1,4,16,64") == [1, 4, 16, 64] and cli.parse_users("16") == [16]
    for bad in ("0", "a,b", "", "-4"):
        with pytest.raises(cli.UsageError):
            cli.parse_users(bad)
    for ok in ("http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000", "http://127.3.2.1"):
        assert cli.check_host(ok, allow_remote=False) == ok.rstrip("/")
    for remote in ("http://10.0.0.5:8000", "http://example.com", "http://0.0.0.0:8000"):
        with pytest.raises(cli.UsageError, match="--allow-remote"):
            cli.check_host(remote, allow_remote=False)
        assert cli.check_host(remote, allow_remote=True) == remote
    with pytest.raises(cli.UsageError, match="bad --host"):
        cli.check_host("127.0.0.1:8000", allow_remote=False)  # no scheme


def _args(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_cli_refuses_remote_host_and_user_lists_before_running(tmp_path, capsys):
    base = ["--results-dir", str(tmp_path)]
    assert cli.run(_args(["--host", "http://192.168.1.20:8000", *base])) == 2
    assert "refusing" in capsys.readouterr().err
    assert cli.run(_args(["--users", "1,4", *base])) == 2  # a list needs `sweep`
    assert "sweep" in capsys.readouterr().err
    assert cli.run(_args(["--duration", "soon", *base])) == 2
    free = f"http://127.0.0.1:{free_port()}"  # nothing listens: a run would record only connection errors
    for argv, says in ((["--duration", "0"], "positive"), (["--rate", "nan"], "--rate"),
                       (["--max-tokens", "-5"], "--max-tokens"), (["--beam-size", "0"], "--beam-size"),
                       (["--translate-file", str(tmp_path / "none.jsonl")], "does not exist"), ([], "nothing answers")):
        assert cli.run(_args(["--host", free, *argv, *base])) == 2
        assert says in capsys.readouterr().err, argv
    assert list(tmp_path.iterdir()) == []  # nothing was started or written
    a_file = tmp_path / "f"
    a_file.write_text("")
    assert cli.run(_args(["--host", free, "--results-dir", str(a_file)])) == 2
    assert "is a file" in capsys.readouterr().err


def test_locust_command_closed_and_open_loop(tmp_path):
    a = _args(["--scenario", "generate-stream", "--max-tokens", "32"])
    cmd = cli.locust_command(a, 16, 60.0, tmp_path)
    assert cmd[:3] == [sys.executable, "-m", "locust"] and cmd[-1] == "GenerateStreamUser"
    assert cmd[cmd.index("-u") + 1] == "16" and cmd[cmd.index("-t") + 1] == "60s"
    assert "--headless" in cmd and "--arrival-rate" not in cmd
    assert cmd[cmd.index("--records-file") + 1] == str(tmp_path / "requests.jsonl")
    assert cmd[cmd.index("--max-tokens") + 1] == "32"
    o = _args(["--scenario", "mixed", "--rate", "2.5"])
    cmd = cli.locust_command(o, 32, 10.0, tmp_path)
    assert cmd[cmd.index("-u") + 1] == "1"  # one user generates the Poisson arrivals
    assert cmd[cmd.index("--arrival-rate") + 1] == "2.5" and cmd[cmd.index("--max-inflight") + 1] == "32"
    assert cmd[-1] == "MixedUser"


def test_plots_from_recorded_sweep_csv(tmp_path):
    rows = []
    for target, scale in (("attnserve", 1.0), ("llama-server", 0.7)):
        for users in (1, 4, 16):
            s = summarize(
                [_rec(0.0, 2.0, ttft=0.05 * users, itl=[0.02 * scale, 0.03], tokens=int(60 * users * scale))],
                users=users,
            )
            rows.append((target, s))
    cli.write_summaries(tmp_path / "sweep.csv", rows)
    data = read_sweep(tmp_path / "sweep.csv")
    assert set(data) == {"attnserve", "llama-server"}
    assert [r["users"] for r in data["attnserve"]] == [1, 4, 16]
    assert data["llama-server"][2]["output_tok_per_s"] == pytest.approx(60 * 16 * 0.7 / 2.0, rel=0.02)
    paths = plot_sweep(tmp_path / "sweep.csv", tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["itl.png", "throughput.png", "ttft.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_plot_of_empty_csv_is_an_error(tmp_path):
    path = tmp_path / "sweep.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerow(["target", "users", "output_tok_per_s"])
    with pytest.raises(ValueError, match="no rows"):
        plot_sweep(path)


def test_translate_inputs_from_test_split_balanced_and_filtered(tmp_path):
    tsv = tmp_path / "test.tsv"
    lines = [f"This is English sentence number {i} for testing.\t这是第{i}个用于测试的中文句子。" for i in range(300)]
    lines += ["Heading\t标题", "broken line without a tab"]
    tsv.write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "inputs.jsonl"
    rows = datasets.load_translate_inputs(tsv, out)
    assert out.exists() and len(rows) == 100
    d = datasets.by_direction(rows)
    assert len(d["zh"]) == 50 and len(d["en"]) == 50
    assert all(t.startswith("This is English") for t in d["zh"]) and all("中文" in t for t in d["en"])


def test_translate_inputs_fall_back_to_our_sentences(tmp_path):
    rows = datasets.load_translate_inputs(tmp_path / "no-such-split.tsv", tmp_path / "inputs.jsonl")
    d = datasets.by_direction(rows)
    assert len(d["zh"]) >= 8 and len(d["en"]) >= 8  # enough for an 8-sentence batch each way
    assert not (tmp_path / "inputs.jsonl").exists()


def test_prompt_set_is_chat_messages():
    prompts = datasets.load_prompts()
    assert len(prompts) >= 20
    assert all(m[0]["role"] == "user" and m[0]["content"].strip() for m in prompts)


def test_host_that_locust_would_send_elsewhere_is_refused():
    """urlparse reads `http://evil.com\\@127.0.0.1` as loopback, but requests (Locust's client) sends to
    evil.com: a backslash in the authority must not pass the loopback rule, even with --allow-remote."""
    import requests

    sneaky = "http://example.com\\@127.0.0.1:8000"
    assert requests.Request("GET", sneaky + "/v1/models").prepare().url.startswith("http://example.com/")
    for url in (sneaky, "http://example.com\\@localhost", "http://127.0.0.1\\:8000"):
        for allow_remote in (False, True):
            with pytest.raises(cli.UsageError, match="bad --host"):
                cli.check_host(url, allow_remote=allow_remote)


def test_host_with_a_bad_port_is_a_usage_error(tmp_path, capsys):
    """A non-numeric or out-of-range port, or an IPv6 host without its "]", is a bad --host (exit 2), not a
    traceback (httpx's InvalidURL, urlparse's ValueError)."""
    for url in ("http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://[::1", "http://[::1:8000/"):
        with pytest.raises(cli.UsageError, match="bad --host"):
            cli.check_host(url, allow_remote=False)
        assert cli.run(_args(["--host", url, "--results-dir", str(tmp_path)])) == 2
        assert "bad --host" in capsys.readouterr().err
    assert cli.check_host("http://127.0.0.1:8000", allow_remote=False) == "http://127.0.0.1:8000"


def test_host_httpx_cannot_send_to_is_a_usage_error(tmp_path, capsys):
    """urlparse reads `http://[::1]x:80` as loopback, httpx raised InvalidURL on it; a host name IDNA refuses
    raised UnicodeError from the first request: both were tracebacks."""
    for argv in (["--host", "http://[::1]x:80"], ["--host", "http://localhost..:8000", "--allow-remote"]):
        assert cli.run(_args([*argv, "--results-dir", str(tmp_path)])) == 2, argv
        assert "bad --host" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_sweep_refuses_a_repeated_user_count(tmp_path, capsys):
    """Both runs of `--users 4,4` would write users-4/: the second appends to the first's requests.jsonl and
    its summary mixes both runs (a window spanning the two)."""
    free = f"http://127.0.0.1:{free_port()}"
    assert cli.run(_args(["sweep", "--users", "1,4,4", "--host", free, "--results-dir", str(tmp_path)])) == 2
    assert "more than once" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(cli.UsageError, match="more than once"):  # compare_llamacpp's lists too
        cli.parse_users("16,64,16")


def test_translate_file_must_hold_both_directions(tmp_path, capsys):
    """The translate scenarios pick zh->en or en->zh at random; with no sentence for one direction that task
    raised inside Locust, which recorded nothing for it: the summary showed half the load and 0% errors."""
    free = f"http://127.0.0.1:{free_port()}"
    one_way = tmp_path / "one.jsonl"
    one_way.write_text('{"text": "Prices rose in May.", "source_lang": "en", "target_lang": "zh"}\n')
    not_jsonl = tmp_path / "bad.jsonl"
    not_jsonl.write_text("Prices rose in May.\n")
    french = tmp_path / "fr.jsonl"
    french.write_text('{"text": "Prices rose in May.", "source_lang": "en", "target_lang": "fr"}\n')
    number = tmp_path / "number.jsonl"
    number.write_text(one_way.read_text() + '{"text": 5, "source_lang": "zh", "target_lang": "en"}\n')
    res = tmp_path / "results"
    for path, says in ((one_way, "into en"), (not_jsonl, "not a JSONL"), (french, "not a JSONL"),
                       (number, "every text must be a non-empty string, got 5")):
        argv = ["--scenario", "translate", "--translate-file", str(path), "--host", free, "--results-dir", str(res)]
        assert cli.run(_args(argv)) == 2
        assert says in capsys.readouterr().err, path
    assert not res.exists()
    both = tmp_path / "both.jsonl"
    both.write_text(one_way.read_text() + '{"text": "五月物价上涨。", "source_lang": "zh", "target_lang": "en"}\n')
    assert cli.run(_args(["--translate-file", str(both), "--host", free, "--results-dir", str(res)])) == 2
    assert "nothing answers" in capsys.readouterr().err  # the file passed; only the missing service stops it


def test_results_dirs_started_in_the_same_second_do_not_collide(tmp_path, monkeypatch):
    """Two runs of one scenario started within a second (a script, two shells) named the same folder: the
    second died with FileExistsError instead of running."""
    monkeypatch.setattr(cli.time, "strftime", lambda fmt, *a: "20250101-120000")
    first = cli.new_results_dir(tmp_path, "run-chat-stream")
    second = cli.new_results_dir(tmp_path, "run-chat-stream")
    assert first != second and first.is_dir() and second.is_dir()
    assert second.name.startswith(first.name)


def test_results_dir_that_cannot_be_made_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """--results-dir under a file ended in NotADirectoryError's traceback; one naming a link to nowhere made
    every candidate name raise FileExistsError, read as taken, so the loop tried names forever."""
    a_file = tmp_path / "f"
    a_file.write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(cli, "check_answers", lambda url: None)
    for parent in (a_file / "sub", tmp_path / "link"):
        with pytest.raises(cli.UsageError, match="cannot create a folder there"):
            cli.new_results_dir(parent, "run-chat-stream")
        assert cli.run(_args(["--results-dir", str(parent)])) == 2
        assert "--results-dir" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "link"]


def test_overload_records_an_admitted_answer_that_is_not_json_as_wrong_not_lost():
    """The overload harness counts every request it sends: a 200 whose body is not the expected JSON is an
    admitted, wrong answer (it raised before, and the gather that collects the tasks dropped it)."""
    import asyncio

    import httpx

    from loadtests.reliability.overload import BODY, one_request

    bodies = [b"not json", b'{"usage": {}}', b'{"usage": {"completion_tokens": %d}}' % BODY["max_tokens"]]

    async def main():
        records: list = []
        for body in bodies:
            transport = httpx.MockTransport(lambda req, body=body: httpx.Response(200, content=body))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1") as c:
                await one_request(c, records)
        return records

    assert [(r[0], r[3]) for r in asyncio.run(main())] == [(200, False), (200, False), (200, True)]


def _fake_locust(monkeypatch, runs):
    """Popen stand-in for Locust, one (requests it records, Ctrl-C lands while the CLI waits, it ignores
    SIGTERM) per run; returns the processes started."""
    import subprocess
    from pathlib import Path

    procs, plans = [], iter(runs)

    class Locust:
        def __init__(self, cmd, **kw):
            n, self.ctrl_c, self.ignores_term = next(plans)
            w = RecordWriter(Path(cmd[cmd.index("--records-file") + 1]))
            for i in range(n):
                w.write(_rec(i, i + 0.5, tokens=10))
            w.close()
            self.returncode, self.signals = None, []
            procs.append(self)

        def poll(self):
            return self.returncode

        def wait(self, timeout=None):
            if self.returncode is None:
                if not self.signals:
                    if self.ctrl_c:
                        raise KeyboardInterrupt
                    self.returncode = 0  # its run ended
                elif self.signals[-1] == "terminate" and self.ignores_term:
                    raise subprocess.TimeoutExpired("locust", timeout)
                else:
                    self.returncode = -15 if self.signals[-1] == "terminate" else -9
            return self.returncode

        def terminate(self):
            self.signals.append("terminate")

        def kill(self):
            self.signals.append("kill")

    monkeypatch.setattr(cli.subprocess, "Popen", Locust)
    monkeypatch.setattr(cli, "check_answers", lambda url: None)
    return procs


def _interrupted_run(argv):
    try:
        return cli.run(_args(argv))
    except KeyboardInterrupt:  # as a failure, not the end of the test session
        pytest.fail("Ctrl-C escaped `attnserve loadtest`")


def test_ctrl_c_stops_locust_and_reports_what_was_measured(tmp_path, monkeypatch, capsys):
    """Ctrl-C mid-sweep: Locust is asked to stop (SIGTERM: it writes its report), killed only if it lingers;
    the table shows the points measured, the cut one included, and the exit status is the shell's for SIGINT."""
    procs = _fake_locust(monkeypatch, [(4, False, False), (2, True, False)])
    argv = ["sweep", "--users", "1,4,16", "--duration", "1s", "--results-dir", str(tmp_path)]
    assert _interrupted_run(argv) == 130
    out, err = capsys.readouterr()
    assert [line.split()[1] for line in out.splitlines()[2:]] == ["1", "4"]  # the users column
    assert "interrupted" in err and "users=4" in err and "Traceback" not in err
    assert [p.signals for p in procs] == [[], ["terminate"]]  # 16 users never started

    procs = _fake_locust(monkeypatch, [(0, True, True)])  # nothing recorded, and Locust ignores SIGTERM
    assert _interrupted_run(["--duration", "1s", "--results-dir", str(tmp_path)]) == 130
    out, err = capsys.readouterr()
    assert out == "" and "nothing was measured" in err
    assert procs[0].signals == ["terminate", "kill"] and procs[0].poll() is not None


def test_a_sweep_point_that_fails_keeps_the_points_before_it(tmp_path, monkeypatch, capsys):
    """A point that recorded nothing (the service went away at 16 users) returned 1 with nothing written:
    the minutes measured at 1 and 4 users were lost."""
    def fake_run_once(args, users, duration_s, out, tick=None):
        if users == 16:
            raise ValueError("no requests recorded against the host")
        return summarize([_rec(0.0, 1.0, ttft=0.1, itl=[0.01], tokens=10 * users)], users=users)

    monkeypatch.setattr(cli, "run_once", fake_run_once)
    monkeypatch.setattr(cli, "check_answers", lambda host: None)
    argv = ["sweep", "--users", "1,4,16,64", "--host", "http://127.0.0.1:8000", "--results-dir", str(tmp_path)]
    assert cli.run(_args(argv)) == 1
    err = capsys.readouterr().err
    assert "users=16: no requests recorded" in err and "2 point(s) before it are kept" in err
    (out,) = tmp_path.iterdir()
    assert [r["users"] for r in csv.DictReader(open(out / "sweep.csv"))] == ["1", "4"]


def test_a_run_waits_while_the_service_warms_up(monkeypatch, capsys):
    """After a first start a replica builds its compiled steps behind its first requests: a run started then
    measured the build (a 1-stream point at 0.6x the warm figure). /readyz answers from two replicas in turn."""
    import httpx

    building = {"attnserve-zh-en": "building its compiled steps"}
    quiet = [(200, {"warming": {}})]
    answers = [(503, {"phase": "loading", "warming": {}}), (200, {"warming": building}), *quiet,
               (200, {"warming": building}), *quiet * cli.WARM_POLLS, (200, {"warming": building})]
    asked = []

    class Answer:
        def __init__(self, status, body):
            self.status_code, self.body = status, body

        def json(self):
            if isinstance(self.body, Exception):
                raise self.body
            return self.body

    def fake_get(url, timeout):
        asked.append(url)
        return Answer(*answers[len(asked) - 1])

    monkeypatch.setattr(httpx, "get", fake_get)
    cli.wait_until_warm("http://127.0.0.1:8000", poll_s=0)
    assert len(asked) == 4 + cli.WARM_POLLS and asked[0] == "http://127.0.0.1:8000/readyz"
    err = capsys.readouterr().err
    assert "start-up: loading" in err and err.count("building its compiled steps") == 1
    # Serve's proxy before the app is deployed: a 503 in text is start-up, not another server
    answers[:] = [(503, ValueError("not JSON")), *quiet * cli.WARM_POLLS]
    asked.clear()
    cli.wait_until_warm("http://127.0.0.1:8000", poll_s=0)
    assert len(asked) == 1 + cli.WARM_POLLS and "the app is not up" in capsys.readouterr().err
    # another server (no attnserve /readyz): no wait
    answers[:] = [(404, {"detail": "Not Found"})]
    asked.clear()
    cli.wait_until_warm("http://127.0.0.1:8000", poll_s=0)
    assert len(asked) == 1
