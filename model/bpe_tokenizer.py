"""Byte-level BPE tokenizer (GPT-2 / SmolLM2 style) built with the `tokenizers` library.

Built from a GGUF's vocabulary and merges, saved as Hugging Face `tokenizer.json` + `tokenizer_config.json`
(with the chat template). Control tokens are special: matched whole, never split into bytes. Pre-tokenization
is GPT-2's, as `transformers` builds it for a GGUF (our test oracle); llama.cpp's digit-first variants
(SmolLM2's "smollm", unknown to transformers) split off every digit first, as SmolLM2's tokenizer.json does.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from pathlib import Path

CONTROL = 3  # llama.cpp token type of control (special) tokens
# llama.cpp's `tokenizer.ggml.pre` values that split off each digit (\p{N}) before the GPT-2 regex
DIGITS_FIRST_PRE = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b")
CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
# the named special tokens of transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # spelled by the code points after 255, in order
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def _token_text(value):
    """transformers may save a special token as an AddedToken's fields ({"content": "<s>", ...}): its text."""
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value["content"] if isinstance(value, dict) and "content" in value else value


def piece_bytes(piece: str) -> bytes:
    """A SentencePiece-style token's bytes (Llama 2 or Mistral tokenizer.json): "▁" is a space, "<0x0A>" one byte."""
    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")


class BPETokenizer:
    """Satisfies `model.tokenizer.Tokenizer`."""

    def __init__(self, tokenizer, config: dict):
        self.tk = tokenizer  # tokenizers.Tokenizer
        self.config = config = {k: _token_text(v) for k, v in config.items()}
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = (self.token_to_id(config.get(f"{t}_token") or "")
                                                 for t in ("bos", "eos", "pad"))
        # a config without add_bos_token (Llama 3's) leaves BOS to the tokenizer.json's post-processor, as
        # transformers reads it: whether it puts BOS first
        self.post_processor_bos = (self.bos_id is not None
                                   and self.tk.encode("", add_special_tokens=True).ids[:1] == [self.bos_id])
        self.chat_template: str | None = config.get("chat_template")

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, tok: dict, chat_template: str | None = None) -> BPETokenizer:
        """`tok` is `model.importers.gguf.tokenizer_metadata(...)`: tokens, token_type, merges, ids."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        if tok.get("model") != "gpt2":
            raise ValueError(f"tokenizer model {tok.get('model')!r} is not byte-level BPE ('gpt2')")
        pre = tok.get("pre")
        if pre not in (None, "default", "gpt2", *DIGITS_FIRST_PRE):  # another regex (llama-bpe, qwen2, ...)
            raise ValueError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported: one of 'gpt2', "
                             f"'default', {', '.join(map(repr, DIGITS_FIRST_PRE))}")
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        tokens = list(tok["tokens"])
        types = tok.get("token_type") or [1] * len(tokens)
        # a token outside the byte alphabet is respelled byte by byte; a control token keeps its text,
        # the one it is matched by (DeepSeek's "<｜begin▁of▁sentence｜>" is not byte-level spelling)
        vocab = {t if ty == CONTROL or set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, (t, ty) in enumerate(zip(tokens, types, strict=True))}
        merges = [tuple(m.split(" ")) for m in tok["merges"]]
        tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        # without the digit split, spaces before a digit lose their merge: "a  1" -> a Ġ Ġ 1, not a ĠĠ 1
        tk.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                            if pre in DIGITS_FIRST_PRE else byte_level)
        tk.decoder = decoders.ByteLevel()
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
        specials = [t for t, ty in zip(tokens, types, strict=True) if ty == CONTROL]
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])

        def name(key):
            i = tok.get(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": name("bos_token_id"), "eos_token": name("eos_token_id"),
            "unk_token": name("unknown_token_id"), "pad_token": name("padding_token_id"),
            "add_bos_token": bool(tok.get("add_bos_token", False)),
            "add_eos_token": bool(tok.get("add_eos_token", False)),
            "additional_special_tokens": specials,
            "chat_template": chat_template,
        }
        return cls(tk, config)

    @classmethod
    def load(cls, directory: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        d = Path(directory)
        if not (d / TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"{d / TOKENIZER_FILE} not found")
        config = json.loads((d / CONFIG_FILE).read_text()) if (d / CONFIG_FILE).is_file() else {}
        if "chat_template" not in config and (d / TEMPLATE_FILE).is_file():  # where transformers now saves it
            config["chat_template"] = (d / TEMPLATE_FILE).read_text(encoding="utf-8")
        return cls(Tokenizer.from_file(str(d / TOKENIZER_FILE)), config)

    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tk.save(str(d / TOKENIZER_FILE))
        (d / CONFIG_FILE).write_text(json.dumps(self.config, indent=2, ensure_ascii=False) + "\n")

    # --- the Tokenizer protocol -----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Special tokens written in the text stay whole. With `add_bos_token` (or, without it, a post-processor
        that adds BOS), BOS goes first unless the text begins with it (a chat template's `{{ bos_token }}`): one
        BOS, as HF's apply_chat_template gives."""
        ids = self.tk.encode(text, add_special_tokens=False).ids
        add_bos = self.config.get("add_bos_token", self.post_processor_bos)
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat template's ids: its special tokens as written, no BOS added (the template writes
        the ones its model wants), as HF's apply_chat_template and vLLM's chat routes tokenize it."""
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token) if token else None

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(int(i))

    @functools.cache  # noqa: B019 - one table per tokenizer, read by the grammars and the logprobs alike
    def token_bytes(self) -> list[bytes]:
        """Every id's bytes in decoded text, for grammar libraries (special tokens: their name's UTF-8).
        Shared: callers do not modify it."""
        tokens = [self.id_to_token(i) or "" for i in range(self.vocab_size)]
        decoder = self.tk.decoder
        if decoder is not None and b'"ByteLevel"' not in decoder.__getstate__():  # SentencePiece-style pieces
            return [piece_bytes(t) for t in tokens]
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        return [bytes(byte_of[c] for c in t) if set(t) <= byte_of.keys() else t.encode("utf-8") for t in tokens]

    def special_tokens(self) -> dict[str, str]:
        """The special tokens' names a chat template may use ({{ bos_token }}, {{ pad_token }}, ...): those of
        HF's special_tokens_map that are set, as apply_chat_template passes them."""
        return {k: self.config[k] for k in NAMED_SPECIAL_TOKENS if self.config.get(k)}

    @property
    def special_ids(self) -> set[int]:
        names = self.config.get("additional_special_tokens") or []
        return {i for i in map(self.token_to_id, names) if i is not None}

    def stop_ids(self) -> set[int]:
        """Ids that end a generation: eos plus the chat end-of-turn and end-of-text tokens if present."""
        ends = map(self.token_to_id, ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"))
        return {i for i in (self.eos_id, *ends) if i is not None}
