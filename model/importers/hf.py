"""Hugging Face layout <-> our DecoderLM: config.json + model.safetensors with Llama (Qwen2, Mistral) or GPT-2
names.

`export_hf` writes a folder `transformers` loads as `LlamaForCausalLM`, `Qwen2ForCausalLM` or `GPT2LMHeadModel`;
`import_hf` reads those and Mistral's. We fuse q/k/v and gate/up into one matrix each; GPT-2's `Conv1D` stores
weights transposed, (in, out).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model.checkpoint import cast_refused
from model.config import DecoderConfig


class HFFormatError(ValueError):
    """The folder or model cannot be mapped; the message says what is unsupported or missing."""


# --- which layout ------------------------------------------------------------------------------

def hf_family(cfg: DecoderConfig) -> str:
    """'llama', 'qwen2' or 'gpt2': the Hugging Face architecture that computes exactly what `cfg` computes
    (Qwen2 is Llama with biased q/k/v and nothing else biased)."""
    if (cfg.norm, cfg.positions, cfg.mlp) == ("rmsnorm", "rope", "swiglu") and not cfg.norm_bias:
        if cfg.o_proj_bias == cfg.attn_bias:
            return "llama"
        if cfg.attn_bias and not cfg.mlp_bias:
            return "qwen2"
    if ((cfg.norm, cfg.positions, cfg.mlp) == ("layernorm", "learned", "gelu") and cfg.kv_heads == cfg.n_heads
            and cfg.attn_bias and cfg.o_proj_bias and cfg.mlp_bias and cfg.norm_bias and cfg.tie_embeddings
            and cfg.dim_head * cfg.n_heads == cfg.d_model):
        return "gpt2"
    raise HFFormatError(f"no Hugging Face architecture matches this config (norm={cfg.norm}, positions="
                        f"{cfg.positions}, mlp={cfg.mlp}, kv_heads={cfg.kv_heads}, biases attn={cfg.attn_bias} "
                        f"attn out={cfg.o_proj_bias} mlp={cfg.mlp_bias} norm={cfg.norm_bias}); supported: Llama-, "
                        f"Qwen2- and GPT-2-style")


def hf_config(cfg: DecoderConfig, dtype: torch.dtype = torch.float32) -> dict:
    dt = str(dtype).removeprefix("torch.")
    family = hf_family(cfg)
    if family != "gpt2":
        c = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_head,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
            "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attn_bias, "mlp_bias": cfg.mlp_bias,
            "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "torch_dtype": dt, "dtype": dt,
        }
        if family == "qwen2":  # its q/k/v are always biased, nothing else is
            c.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
            del c["attention_bias"], c["mlp_bias"]
        return c
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.d_ff,
        "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
        "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "torch_dtype": dt, "dtype": dt,
    }


def config_from_hf(c: dict, where: str = "config.json") -> DecoderConfig:
    mt, eos = c.get("model_type"), c.get("eos_token_id")
    ids = {"bos_id": c.get("bos_token_id"), "eos_id": eos[0] if isinstance(eos, list) and eos else eos}
    try:
        if mt in ("llama", "mistral", "qwen2"):
            rope = c.get("rope_parameters") or {}
            scaling = c.get("rope_scaling") or rope
            if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
                raise HFFormatError(f"{where}: RoPE scaling {scaling.get('rope_type') or scaling.get('type')!r} "
                                    "is not supported")
            if c.get("hidden_act", "silu") != "silu":  # our SwiGLU gates with SiLU only
                raise HFFormatError(f"{where}: Llama activation {c['hidden_act']!r} is not supported (only silu)")
            if mt == "qwen2" and c.get("use_sliding_window"):
                raise HFFormatError(f"{where}: Qwen2's sliding-window attention is not supported")
            heads = c["num_attention_heads"]
            context = c.get("max_position_embeddings", 2048)
            if mt == "mistral" and c.get("sliding_window"):  # within the window, attention is full attention
                context = min(context, c["sliding_window"])
            return DecoderConfig.from_dict(dict(  # from_dict: a value of the wrong type is named here
                vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads, d_ff=c["intermediate_size"],
                max_seq_len=context, norm="rmsnorm",
                norm_eps=c.get("rms_norm_eps", 1e-6), positions="rope",
                rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))), mlp="swiglu",
                attn_bias=mt == "qwen2" or bool(c.get("attention_bias", False)),
                attn_out_bias=False if mt == "qwen2" else None, mlp_bias=bool(c.get("mlp_bias", False)),
                norm_bias=False, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                head_dim=c.get("head_dim") if c.get("head_dim") not in (None, c["hidden_size"] // heads) else None,
                **ids,
            ))
        if mt == "gpt2":
            act = c.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh"):
                raise HFFormatError(f"{where}: GPT-2 activation {act!r} is not supported (only tanh GELU)")
            # our attention always scales by 1/sqrt(head dim), and by nothing else
            if not c.get("scale_attn_weights", True) or c.get("scale_attn_by_inverse_layer_idx", False):
                raise HFFormatError(f"{where}: GPT-2 attention scaling other than 1/sqrt(head dim) is not supported")
            d = c["n_embd"]
            return DecoderConfig.from_dict(dict(
                vocab_size=c["vocab_size"], d_model=d, n_layers=c["n_layer"], n_heads=c["n_head"],
                d_ff=c.get("n_inner") or 4 * d, max_seq_len=c.get("n_positions", 1024),
                norm_eps=c.get("layer_norm_epsilon", 1e-5), **ids,
            ))
    except KeyError as e:
        raise HFFormatError(f"{where}: missing config field {e}") from None
    except HFFormatError:
        raise
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:  # a value of the wrong type or size
        raise HFFormatError(f"{where}: bad config: {e}") from None
    raise HFFormatError(f"{where}: model_type {mt!r} not supported; supported: ['llama', 'mistral', 'qwen2', 'gpt2']")


# --- tensor names ------------------------------------------------------------------------------

def _name_map(cfg: DecoderConfig) -> list[tuple[str, list[str], list[int] | None, bool]]:
    """(our tensor, the Hugging Face tensors it concatenates on dim 0, their row counts, stored transposed)
    for every parameter of the model; one table for both directions."""
    q_dim, kv_dim = cfg.n_heads * cfg.dim_head, cfg.kv_heads * cfg.dim_head
    rows: list[tuple[str, list[str], list[int] | None, bool]] = []
    if hf_family(cfg) != "gpt2":  # Llama's names, Qwen2's too
        rows += [("embed.weight", ["model.embed_tokens.weight"], None, False),
                 ("norm.weight", ["model.norm.weight"], None, False)]
        if not cfg.tie_embeddings:
            rows.append(("lm_head.weight", ["lm_head.weight"], None, False))
        for i in range(cfg.n_layers):
            p, h = f"blocks.{i}.", f"model.layers.{i}."
            rows += [(p + "attn_norm.weight", [h + "input_layernorm.weight"], None, False),
                     (p + "mlp_norm.weight", [h + "post_attention_layernorm.weight"], None, False)]
            for s in ("weight", "bias") if cfg.attn_bias else ("weight",):
                rows.append((p + f"attn.qkv_proj.{s}", [h + f"self_attn.{n}_proj.{s}" for n in "qkv"],
                             [q_dim, kv_dim, kv_dim], False))
            for s in ("weight", "bias") if cfg.o_proj_bias else ("weight",):
                rows.append((p + f"attn.o_proj.{s}", [h + f"self_attn.o_proj.{s}"], None, False))
            for s in ("weight", "bias") if cfg.mlp_bias else ("weight",):
                rows += [(p + f"mlp.gate_up.{s}", [h + f"mlp.gate_proj.{s}", h + f"mlp.up_proj.{s}"],
                          [cfg.d_ff, cfg.d_ff], False),
                         (p + f"mlp.down.{s}", [h + f"mlp.down_proj.{s}"], None, False)]
        return rows
    rows += [("embed.weight", ["transformer.wte.weight"], None, False),
             ("pos_embed.weight", ["transformer.wpe.weight"], None, False),
             ("norm.weight", ["transformer.ln_f.weight"], None, False),
             ("norm.bias", ["transformer.ln_f.bias"], None, False)]
    for i in range(cfg.n_layers):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        rows += [(f"{p}{ours}.{s}", [f"{h}{theirs}.{s}"], None, False)
                 for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")) for s in ("weight", "bias")]
        for ours, theirs in (("attn.qkv_proj", "attn.c_attn"), ("attn.o_proj", "attn.c_proj"),
                             ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            rows += [(p + ours + ".weight", [h + theirs + ".weight"], None, True),  # Conv1D: (in, out)
                     (p + ours + ".bias", [h + theirs + ".bias"], None, False)]
    return rows


def to_hf_state(model) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face names (split fused matrices, transpose GPT-2 Conv1D weights)."""
    sd, out = model.state_dict(), {}
    for ours, theirs, rows, transposed in _name_map(model.cfg):
        x = sd[ours].t() if transposed else sd[ours]
        out.update(zip(theirs, x.split(rows, 0) if rows else [x], strict=True))
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_state(hf: dict[str, torch.Tensor], cfg: DecoderConfig, where: str = "") -> dict[str, torch.Tensor]:
    """Hugging Face names -> our state dict; raises HFFormatError naming a missing tensor."""
    prefix = "transformer." if hf_family(cfg) == "gpt2" else "model."
    # accept checkpoints saved without the base-model prefix (old GPT-2 files, bare LlamaModel)
    hf = {(k if k.startswith(prefix) or k == "lm_head.weight" else prefix + k): v for k, v in hf.items()}
    table = _name_map(cfg)
    missing = next((n for _, theirs, _, _ in table for n in theirs if n not in hf), None)
    if missing is not None:
        raise HFFormatError(f"{where}: tensor {missing!r} missing")
    sd: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for ours, theirs, _, transposed in table:
        pieces = [hf[n] for n in theirs]
        # checked before joining: torch.cat would raise on these, or promote an integer piece to float unseen
        kinds = {(p.dim(), tuple(p.shape[1:]), p.is_floating_point()) for p in pieces}
        if len(kinds) > 1 or len(pieces) > 1 and pieces[0].dim() == 0 or transposed and pieces[0].dim() > 2:
            raise HFFormatError(f"{where}: tensors {theirs} do not make {ours}: shapes "
                                f"{[tuple(p.shape) for p in pieces]}, dtypes {[str(p.dtype) for p in pieces]}")
        x = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
        sd[ours] = x.t().contiguous() if transposed else x
        used.update(theirs)
    if cfg.tie_embeddings and "lm_head.weight" in hf:  # a tied head stored anyway: it must be the embedding
        if not torch.equal(hf["lm_head.weight"], sd["embed.weight"]):
            raise HFFormatError(f"{where}: the config ties the embeddings, but lm_head.weight differs from them")
        used.add("lm_head.weight")
    # buffers some exporters store (GPT-2's causal masks, RoPE's inverse frequencies) carry no weights
    unused = sorted(n for n in set(hf) - used if not n.endswith((".attn.bias", ".attn.masked_bias", ".inv_freq")))
    if unused:  # e.g. more layers than num_hidden_layers: a config that does not describe the weights
        raise HFFormatError(f"{where}: {len(unused)} tensors the config has no place for, e.g. {unused[:3]}")
    return sd


# --- folders -----------------------------------------------------------------------------------

def export_hf(model, directory: str | Path, *, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files) in the Hugging Face layout."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = to_hf_state(model)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    first = next(iter(state.values()))
    (d / "config.json").write_text(json.dumps(hf_config(model.cfg, first.dtype), indent=2) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(d)
    return d


def _read_hf_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = d / "model.safetensors.index.json"
    try:
        if (d / "model.safetensors").is_file():
            return load_file(str(d / "model.safetensors"))
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {name: t for s in shards for name, t in load_file(str(d / s)).items()}
    # torn, an index without a map, or one naming a shard that is missing (OSError)
    except (SafetensorError, KeyError, TypeError, AttributeError, ValueError, OSError) as e:
        raise HFFormatError(f"{d}: cannot read the weights ({type(e).__name__}: {e})") from None
    raise HFFormatError(f"{d}: no model.safetensors or model.safetensors.index.json (pytorch_model.bin is "
                        "not read: it needs unpickling)")


def generation_stop_ids(directory: str | Path) -> set[int]:
    """The ids generation_config.json ends generating at (`eos_token_id`: one or a list, as Llama 3 lists
    its end-of-turn tokens); none without the file."""
    path = Path(directory) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (ValueError, AttributeError) as e:  # not JSON, or not an object
        raise HFFormatError(f"{path}: not a generation config ({e})") from None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):  # JSON's true is no id
        raise HFFormatError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return set(ids)


def import_hf(directory: str | Path):
    """A Hugging Face Llama, Mistral, Qwen2 or GPT-2 folder -> our DecoderLM (eval mode)."""
    from model.decoder import DecoderLM

    d = Path(directory)
    if not (d / "config.json").is_file():
        raise HFFormatError(f"{d}: config.json missing")
    cfg = config_from_hf(json.loads((d / "config.json").read_text()), str(d / "config.json"))
    sd = from_hf_state(_read_hf_weights(d), cfg, str(d))
    model = DecoderLM(cfg)
    expected = model.state_dict()
    for name, t in sd.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise HFFormatError(f"{d}: tensor for {name} has shape {tuple(t.shape)}, config implies "
                                f"{tuple(expected[name].shape)}")
        if why := cast_refused(t, expected[name]):
            raise HFFormatError(f"{d}: tensor for {name} {why}")
    model.load_state_dict(sd, strict=False)
    return model.eval()
