"""One Ray Serve instance per pytest session, shared by every `ray` test (start-up costs ~15 s).

It serves random tiny checkpoints (a tiny Llama and a tiny encoder-decoder with a small
SentencePiece tokenizer) through the real deployment, config path and HTTP proxy; a second
application on /batched runs the `@serve.batch` mode.
"""

from __future__ import annotations

import time

import httpx
import pytest

from loadtests.ports import free_port

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXTS = ["the cat sat on the mat", "hello world, how are you?", "a quick brown fox jumps over the lazy dog",
         "你好世界", "今天天气很好", "机器翻译", "numbers 0123456789 and symbols !?.,"] * 20



def tiny_checkpoints(root):
    import torch

    from model.checkpoint import save_checkpoint
    from model.config import TINY_LLAMA, TINY_SEQ2SEQ
    from model.decoder import DecoderLM
    from model.seq2seq import EncoderDecoder
    from model.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer.train(TEXTS, root / "sp", vocab_size=320, model_type="bpe",
                                       user_symbols=["<2en>", "<2zh>"], num_threads=1)
    torch.manual_seed(0)
    dec = DecoderLM(TINY_LLAMA.__class__(**{**TINY_LLAMA.to_dict(), "vocab_size": tok.vocab_size,
                                            "eos_id": tok.eos_id, "bos_id": tok.bos_id}))
    s2s = EncoderDecoder(TINY_SEQ2SEQ.__class__(**{**TINY_SEQ2SEQ.to_dict(), "vocab_size": tok.vocab_size}))
    return (save_checkpoint(dec, root / "gen", tokenizer=tok), save_checkpoint(s2s, root / "tr", tokenizer=tok))


def service_args(gen_dir, tr_dir, batching: str = "engine") -> dict:
    return {"batching": batching,
            "generator": {"checkpoint": str(gen_dir), "chat_template": TEMPLATE, "device": "auto",
                          "engine": {"max_slots": 4, "max_seq_len": 128, "threads": 1}},
            "translator": {"checkpoint": str(tr_dir), "engine": {"max_slots": 8, "max_seq_len": 64, "threads": 1}}}


def _deployment(name: str) -> dict:
    return {"name": "AttnServe", "max_ongoing_requests": 16, "ray_actor_options": {"num_cpus": 0.5},
            "user_config": {"limits": {"max_prompt_chars": 2000}}}


@pytest.fixture(scope="session")
def serve_url(tmp_path_factory):
    from service import ray_local

    root = tmp_path_factory.mktemp("serve")
    gen, tr = tiny_checkpoints(root)
    port = free_port()
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port, "keep_alive_timeout_s": 75},
        "applications": [
            {"name": "attnserve", "route_prefix": "/", "import_path": "service.deployments:build",
             "args": service_args(gen, tr), "deployments": [_deployment("attnserve")]},
            {"name": "batched", "route_prefix": "/batched", "import_path": "service.deployments:build",
             "args": service_args(gen, tr, "serve_batch"), "deployments": [_deployment("batched")]},
        ],
    }
    ray_local.start_ray(num_cpus=2)
    try:
        ray_local.deploy(config, timeout_s=300)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while httpx.get(url + "/readyz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "service never became ready"
            time.sleep(0.5)
        yield url
    finally:
        ray_local.shutdown()
