"""`attnserve train translate --config configs/translate.json`: train the zh<->en translator.

The recipe of "Attention Is All You Need" (Adam(0.9, 0.98, 1e-9), inverse-sqrt warm-up, label smoothing,
batches by token count). Resumable: the whole state is saved, never pickled, every few minutes and on SIGTERM
or SIGINT, which then raise `Interrupted`. Logs JSON lines to `<run>/train.log`; at the end the last snapshots
are averaged and exported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model import paths
from model.checkpoint import build_model, read_config, save_checkpoint
from model.checkpoint import load_state as load_weights
from model.config import Seq2SeqConfig
from model.file_lock import file_lock
from model.generate import greedy, pad_batch
from model.progress import progress, write_line
from model.strict_fields import from_dict
from model.tokenizer import SentencePieceTokenizer
from model.training import back_translate, translate_data
from model.training.run_clock import RunClock
from model.translation import LANGS, TAGS, encode_source, other

NO_STEP_LIMIT = 10**9  # max_steps by default: the hour limit ends the run
LOCK_FILE = "train.lock"  # in the run folder, held while a process trains there


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped a run before its limit, its state saved (raised once the run's work is done)."""

    def __init__(self, signum: int, step: int, run: Path):
        super().__init__(f"{signal.Signals(signum).name} stopped the run at step {step}; its state is saved")
        self.signum, self.step, self.run = signum, step, run


@dataclass
class TrainConfig:
    model: dict = field(default_factory=dict)  # Seq2SeqConfig fields (vocab_size is set from spm)
    vocab_size: int = 16000
    spm_sentences: int = 400000
    max_len: int = 128  # tokens per side; longer pairs are skipped in training
    batch_tokens: int = 6000  # source + target tokens per batch
    lr_factor: float = 1.0
    warmup_steps: int = 1000
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    bf16: bool | str = "auto"  # autocast to bf16; "auto": where bf16 measures faster (model/cpu_features.py)
    threads: int = 2
    seed: int = 1
    max_hours: float = 2.5
    max_steps: int = NO_STEP_LIMIT
    ckpt_minutes: float = 5.0
    eval_minutes: float = 15.0
    eval_sentences: int = 200
    eval_splits: list = field(default_factory=lambda: ["dev"])  # held-out splits scored during training
    upsample: dict = field(default_factory=dict)  # train.source name -> copies per epoch, e.g. {"ted": 2}
    # train.source name -> the one language its pairs are trained into, e.g. {"ted_paragraphs": "en"}: a
    # side fit to read but not to imitate (Chinese subtitles without punctuation) is only ever a source
    one_way: dict = field(default_factory=dict)
    back_translation: bool = False  # also train on bt.tsv (`attnserve data backtranslate`), tagged, one way
    avg_last: int = 5
    log_every: int = 20
    rewarm_steps: int = 300  # --init-from: fresh Adam moments, so ramp the lr back up over these steps
    cooldown_steps: int = 0  # the lr falls linearly to zero over these last steps (warmup-stable-decay)
    compile_loss: bool = True  # the loss over the vocabulary through inductor: one fused pass each way
    # > 1: batches padded to a multiple of this, a fixed row count per length, so a GPU sees a few dozen
    # shapes instead of a new one per batch, each costly the first time
    shape_multiple: int = 1

    def __post_init__(self):
        if not isinstance(self.one_way, dict):
            raise ValueError(f"TrainConfig.one_way: a mapping of source -> language, got {self.one_way!r}")
        if bad := {k: v for k, v in self.one_way.items() if v not in LANGS}:
            raise ValueError(f"TrainConfig.one_way: a language must be one of {list(LANGS)}, got {bad}")
        if self.bf16 not in (True, False, "auto"):  # else torch.autocast refuses it at the first step
            raise ValueError(f'TrainConfig.bf16 must be true, false or "auto", got {self.bf16!r}')
        # avg_last 0 would keep and average every snapshot (snapshots[-0:]); log_every and warmup_steps divide;
        # sacreBLEU fails on no sentences
        for name, least in (("avg_last", 1), ("batch_tokens", 1), ("log_every", 1), ("warmup_steps", 1),
                            ("threads", 1), ("eval_sentences", 1), ("cooldown_steps", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"TrainConfig.{name} must be >= {least}, got {getattr(self, name)}")
        # smoothing is a share of the target's mass; a clip_norm below 0 flips every gradient's sign (0 zeroes
        # them) and an lr_factor below 0 climbs the loss: each would train without an error
        for name, ok, want in (("label_smoothing", 0 <= self.label_smoothing <= 1, "in [0, 1]"),
                               ("clip_norm", self.clip_norm > 0, "> 0"), ("lr_factor", self.lr_factor > 0, "> 0")):
            if not ok:
                raise ValueError(f"TrainConfig.{name} must be {want}, got {getattr(self, name)}")
        if self.cooldown_steps and self.max_steps == NO_STEP_LIMIT:
            raise ValueError("TrainConfig.cooldown_steps counts back from max_steps: set max_steps too")

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        return from_dict(cls, json.loads(Path(path).read_text()), where=str(path))


def token_loss(logits: torch.Tensor, tgt_out: torch.Tensor, pad_id: int, smoothing: float) -> torch.Tensor:
    """Label-smoothed cross-entropy over the real target tokens: logits (B, T, V), tgt_out (B, T)."""
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt_out.reshape(-1), ignore_index=pad_id,
                           label_smoothing=smoothing)


def compiled_loss(log):
    """token_loss through inductor; where that cannot build (no C++ compiler) the first call says so in the
    log and training goes on with the eager loss."""
    fn = torch.compile(token_loss, dynamic=True)

    def loss(*args):
        nonlocal fn
        if fn is not token_loss:
            try:
                return fn(*args)
            except Exception as e:
                log(event="compile_loss_unavailable", error=f"{type(e).__name__}: {str(e)[:300]}")
                fn = token_loss
        return token_loss(*args)

    return loss


def lr_at(step: int, d_model: int, warmup: int, factor: float) -> float:
    step = max(step, 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def scheduled_lr(step: int, cfg: TrainConfig, d_model: int, warm_start_step: int | None = None) -> float:
    """The inverse-square-root schedule, ramped up again after a warm start, decayed to zero over the
    last `cooldown_steps` before `max_steps`."""
    lr = lr_at(step, d_model, cfg.warmup_steps, cfg.lr_factor)
    if warm_start_step is not None:  # fresh optimizer moments: ramp up to the schedule again
        lr *= min(1.0, (step - warm_start_step) / max(1, cfg.rewarm_steps))
    if cfg.cooldown_steps:
        lr *= min(1.0, max(0, cfg.max_steps - step + 1) / cfg.cooldown_steps)
    return lr


def make_examples(pairs, tok, max_len: int, only: list[str | None] | None = None
                  ) -> list[tuple[list[int], list[int]]]:
    """Each (en, zh) pair gives two examples: <2en>+zh -> en and <2zh>+en -> zh; only the one into
    `only[i]` where that is given."""
    ex = []
    for i, (en, zh) in enumerate(progress(pairs, desc="encoding pairs", unit="pair")):
        into = only[i] if only else None
        ex += filter(None, (into != "zh" and _example(tok, zh, en, "en", max_len),
                            into != "en" and _example(tok, en, zh, "zh", max_len)))
    return ex


def make_bt_examples(rows, tok, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Each synthetic (en, zh, real) row gives one example, synthetic side -> real side, with the
    back-translation tag after the language tag."""
    bt_tag = tok.token_to_id(back_translate.TAG_PIECE)
    examples = (_example(tok, *((en, zh) if real == "zh" else (zh, en)), real, max_len, bt_tag)
                for en, zh, real in progress(rows, desc="encoding synthetic pairs", unit="pair"))
    return [e for e in examples if e]


def _example(tok, src: str, tgt: str, lang: str, max_len: int, extra_tag: int | None = None
             ) -> tuple[list[int], list[int]] | None:
    """(source ids, target ids) translating src into `lang` (`extra_tag` after the language tag), or
    None when a side is longer than max_len."""
    s = encode_source(tok, src, lang)
    if extra_tag is not None:
        s.insert(1, extra_tag)
    t = [tok.bos_id, *tok.encode(tgt), tok.eos_id]
    return (s, t) if len(s) <= max_len and len(t) <= max_len + 1 else None


def make_batches(examples, batch_tokens: int, rng: random.Random, multiple: int = 1) -> list[list[int]]:
    """Group examples of similar length, ~batch_tokens (padded) tokens a batch, sorted by source then target
    length so that neither side is mostly padding. With `multiple` > 1, see `shaped_batches`."""
    if multiple > 1:
        return shaped_batches(examples, batch_tokens, rng, multiple)
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]), len(examples[i][1]), rng.random()))
    batches, cur, longest = [], [], 0
    for i in order:
        s, t = examples[i]
        n = max(longest, len(s), len(t))
        if cur and n * 2 * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, n = [], max(len(s), len(t))
        cur.append(i)
        longest = n
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def padded_length(example: tuple[list[int], list[int]], multiple: int) -> int:
    """The length both sides of an example's batch are padded to: its longer side (source, or target
    less its first token) rounded up to `multiple`."""
    s, t = example
    return -(-max(len(s), len(t) - 1) // multiple) * multiple


def shaped_batches(examples, batch_tokens: int, rng: random.Random, multiple: int) -> list[list[int]]:
    """Batches of examples sharing one `padded_length`, batch_tokens // (2 x length) rows each (the last
    of a length fewer): at most two shapes per length."""
    by_len: dict[int, list[int]] = {}
    for i, ex in enumerate(examples):
        by_len.setdefault(padded_length(ex, multiple), []).append(i)
    batches = []
    for length, idx in sorted(by_len.items()):
        rng.shuffle(idx)
        rows = max(1, batch_tokens // (2 * length))
        batches += [idx[k:k + rows] for k in range(0, len(idx), rows)]
    rng.shuffle(batches)
    return batches


def collate(examples, idx, pad: int, multiple: int = 1):
    """src (B, S), tgt_in (B, T), tgt_out (B, T); with `multiple` > 1, S = T = the batch's padded_length."""
    width = max(padded_length(examples[i], multiple) for i in idx) if multiple > 1 else None
    src, _ = pad_batch([examples[i][0] for i in idx], pad, width=width)
    tgt, _ = pad_batch([examples[i][1] for i in idx], pad, width=None if width is None else width + 1)
    return src, tgt[:, :-1], tgt[:, 1:]


# --- resumable state, without pickle ------------------------------------------------------------

def save_state(run: Path, model, opt, meta: dict, weights: dict[str, torch.Tensor]) -> None:
    """The resumable state: `weights` (the model's, on CPU), Adam's moments, the RNG states, `meta`."""
    tensors = {f"model.{k}": v for k, v in weights.items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            tensors[f"opt.{names[id(p)]}.{k}"] = st[k].cpu().contiguous()
        meta["opt_step"] = float(st["step"])  # Adam's step count (one for all parameters)
    tensors["rng.torch"] = torch.get_rng_state()
    dev = next(model.parameters()).device
    if dev.type == "cuda":  # dropout masks on the GPU draw from its own generator
        tensors["rng.cuda"] = torch.cuda.get_rng_state(dev)
    tmp = run / "state.safetensors.tmp"
    # the metadata rides in the tensors' file, so one rename commits both (state.json is for people to read)
    save_file(tensors, str(tmp), metadata={"state": json.dumps(meta)})
    tmp.replace(run / "state.safetensors")
    (run / "state.json.tmp").write_text(json.dumps(meta, indent=2))
    (run / "state.json.tmp").replace(run / "state.json")


def load_state(run: Path, model, opt) -> dict:
    path = run / "state.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        kept = (f.metadata() or {}).get("state")
    # older runs keep it in state.json only
    meta = json.loads(kept) if kept is not None else json.loads((run / "state.json").read_text())
    if changed := changed_function(meta.get("model", {}), model.cfg):  # older runs did not record it
        raise ValueError(f"{path} does not fit the config's model ({changed}): resume with the config the run "
                         "was trained with, or pass --run-dir to start a new run")
    try:
        model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    except RuntimeError as e:  # a run folder of another recipe: say so in the CLI's one line, not a traceback
        first = next((line.strip(" .") for line in str(e).splitlines()[1:] if line.strip()), str(e))
        raise ValueError(f"{path} does not fit the config's model ({first}): resume with the config the run "
                         "was trained with, or pass --run-dir to start a new run") from None
    for n, p in model.named_parameters():
        if f"opt.{n}.exp_avg" in tensors:
            opt.state[p] = {"step": torch.tensor(meta["opt_step"]),
                            "exp_avg": tensors[f"opt.{n}.exp_avg"].to(p.device),
                            "exp_avg_sq": tensors[f"opt.{n}.exp_avg_sq"].to(p.device)}
    torch.set_rng_state(tensors["rng.torch"])
    # a run that moved from CPU has no CUDA generator state: that generator starts afresh
    dev = next(model.parameters()).device
    if dev.type == "cuda" and "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"], dev)
    return meta


def snapshots(run: Path) -> list[Path]:
    """The run's kept weight snapshots, oldest first."""
    return sorted((run / "snapshots").glob("step-*.safetensors"), key=lambda p: int(p.stem.split("-")[1]))


def average_snapshots(run: Path, model, last: int) -> list[str]:
    if not (snaps := snapshots(run)[-last:]):
        return []
    avg = None
    for s in snaps:
        sd = load_file(str(s))
        avg = {k: v.double() for k, v in sd.items()} if avg is None else {k: avg[k] + sd[k].double() for k in avg}
    model.load_state_dict({k: (v / len(snaps)).float() for k, v in avg.items()})
    return [s.name for s in snaps]


# --- evaluation -----------------------------------------------------------------------------------

def dev_bleu(model, tok, pairs, n: int, split: str = "dev") -> dict[str, float]:
    """Greedy BLEU on the first n pairs of a held-out split: {"bleu_zh2en": ..} for `dev`, else
    {"<split>_bleu_zh2en": ..}."""
    import sacrebleu

    model.eval()
    sub = pairs[:n]
    res = {}
    for tgt_lang in LANGS:
        srcs = [p[1] if tgt_lang == "en" else p[0] for p in sub]
        refs = [p[0] if tgt_lang == "en" else p[1] for p in sub]
        hyps = []
        for i in range(0, len(srcs), 50):
            ids = greedy(model, [encode_source(tok, s, tgt_lang, model.cfg.max_src_len) for s in srcs[i:i + 50]])
            hyps += [tok.decode(h) for h in ids]
        prefix = "" if split == "dev" else f"{split}_"
        res[f"{prefix}bleu_{other(tgt_lang)}2{tgt_lang}"] = round(sacrebleu.corpus_bleu(
            hyps, [refs], tokenize="zh" if tgt_lang == "zh" else "13a").score, 2)
    model.train()
    return res


# --- main loop ------------------------------------------------------------------------------------

def train(config_path: str | Path, run_dir: str | Path | None = None, *, resume: bool = False,
          data_dir: Path | None = None, export_to: str | Path | None = None,
          export_only: bool = False, threads: int | None = None,
          init_from: str | Path | None = None, avg_last: int | None = None, device: str = "cpu") -> Path:
    cfg = TrainConfig.load(config_path)
    try:  # a resource setting too: a run may move between CPU and GPU machines as it resumes
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) sees no CUDA device")
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)  # calls without a device (RNG state, bf16 support) then mean this one
    if threads:  # a resource setting, not part of the recipe: e.g. 1 while the cores are shared
        cfg = dataclasses.replace(cfg, threads=threads)
    if avg_last:  # export only: how many of the kept snapshots to average (at most the config's avg_last are kept)
        if not export_only:
            raise ValueError("avg_last overrides the export of --export-only; the recipe's avg_last sets what is kept")
        cfg = dataclasses.replace(cfg, avg_last=avg_last)
    run = Path(run_dir or paths.home() / "runs" / "translate" / Path(config_path).stem)
    run.mkdir(parents=True, exist_ok=True)
    out = Path(export_to or run / "export")
    if out.exists() and not out.is_dir() or any(p.exists() and not p.is_dir() for p in out.parents):
        # else a run trains to its limit and only then fails to export
        raise ValueError(f"{out} cannot take the export (a file, or under a file): pass --export-to a folder")
    with contextlib.ExitStack() as stack:
        # one training process a folder, else two train over each other's vocabulary, state and snapshots (an
        # export only reads them)
        if not export_only and not stack.enter_context(file_lock(run / LOCK_FILE, wait=False)):
            raise FileExistsError(f"{run} is in use by another training process (it holds {run / LOCK_FILE}): "
                                  "wait for it to stop, or pass --run-dir to start a new run elsewhere")
        return _train_in(run, cfg, dev, config_path, resume=resume, data_dir=data_dir, export_to=export_to,
                         export_only=export_only, init_from=init_from)


def _train_in(run: Path, cfg: TrainConfig, dev: torch.device, config_path: str | Path, *, resume: bool,
              data_dir: Path | None, export_to: str | Path | None, export_only: bool,
              init_from: str | Path | None) -> Path:
    """train() in its run folder, with the arguments checked."""
    # the tensors' file commits a state (save_state), before state.json is written: a kill between the two
    # renames of a run's first checkpoint leaves no state.json
    has_state = (run / "state.safetensors").is_file()  # past these checks, a run with a state resumes it
    if has_state and not (resume or export_only):
        # a new run here would mix its snapshots (and maybe its vocabulary) with the old run's
        raise FileExistsError(f"{run} already holds a training run (state.safetensors): pass --resume to continue "
                              "it, or --run-dir to start a new run elsewhere")
    if export_only and not has_state:  # else an untrained model would be exported
        raise FileNotFoundError(f"{run} holds no training run (state.safetensors) to export")
    if resume and not has_state:  # a supervisor may pass --resume from the first start; a misspelt folder shows
        write_line(f"{run}: no saved state to resume; starting a new run there")
    torch.set_num_threads(cfg.threads)
    if cfg.bf16 == "auto":
        from model.cpu_features import prefers_bf16

        # on CUDA only where the GPU computes bf16 natively (Ampere on): emulated bf16 is slow
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False) if dev.type == "cuda" else prefers_bf16()
        cfg = dataclasses.replace(cfg, bf16=bf16)
    torch.manual_seed(cfg.seed)

    def log(**kv):
        line = json.dumps({"time": round(time.time(), 1), **kv}, ensure_ascii=False)
        write_line(line)  # above the progress bar, when one is drawn
        with open(run / "train.log", "a", encoding="utf-8") as f:
            f.write(line + "\n")

    train_pairs, sources = translate_data.training_pairs(data_dir, {*cfg.upsample, *cfg.one_way})
    if not export_only:  # a misspelt source fails now, not after the vocabulary's training
        translate_data.check_sources(cfg.one_way, sources, "one_way")
        rows = translate_data.upsample(list(zip(train_pairs, sources, strict=True)), sources, cfg.upsample)
    dev_pairs = {split: translate_data.read_heldout(split, data_dir) for split in cfg.eval_splits}
    spm_path = run / "spm.model"
    # the vocabulary is written aside, then renamed: a kill mid-write leaves none, not one no start can read
    if init_from and not has_state:  # warm start: the checkpoint's own vocabulary
        shutil.copyfile(Path(init_from) / SentencePieceTokenizer.FILE, run / "spm.tmp.model")
        (run / "spm.tmp.model").replace(spm_path)
    if has_state and not spm_path.is_file():  # a new vocabulary would give the trained weights other ids
        raise FileNotFoundError(f"{run} holds a training state but not its vocabulary ({spm_path}): restore it, "
                                "or pass --run-dir to start a new run elsewhere")
    if not spm_path.is_file():
        t0 = time.time()
        texts = [s for p in train_pairs for s in p]
        SentencePieceTokenizer.train(texts, run / "spm.tmp", cfg.vocab_size, user_symbols=list(TAGS.values()),
                                     input_sentence_size=cfg.spm_sentences, num_threads=cfg.threads)
        (run / "spm.tmp.vocab").replace(run / "spm.vocab")
        (run / "spm.tmp.model").replace(spm_path)
        log(event="spm_trained", seconds=round(time.time() - t0, 1), vocab_size=cfg.vocab_size)
    tok = SentencePieceTokenizer(spm_path)
    mcfg = Seq2SeqConfig.from_dict({**cfg.model, "vocab_size": tok.vocab_size, "pad_id": tok.pad_id,
                                    "bos_id": tok.bos_id, "eos_id": tok.eos_id})
    model = build_model(mcfg).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
    meta = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "train_seconds": 0.0, "tokens": 0}
    if has_state:
        meta = load_state(run, model, opt)
        log(event="resumed", step=meta["step"], epoch=meta["epoch"])
    elif init_from:
        meta = warm_start(model, Path(init_from))
        log(event="warm_start", init_from=str(init_from), step=meta["step"], epoch=meta["epoch"])
    meta["model"] = mcfg.to_dict()  # what the state's weights compute, for a resume to check (load_state)
    if export_only:
        return export(run, model, tok, cfg, meta, export_to, log)

    examples = make_examples([p for p, _ in rows], tok, cfg.max_len,
                             [cfg.one_way.get(s) for _, s in rows] if cfg.one_way else None)
    if cfg.back_translation:
        synthetic = back_translate.read(data_dir)
        if not synthetic:  # the recipe asks for them: training on without would be another recipe, silently
            where = (data_dir or translate_data.data_dir()) / back_translate.FILE_NAME
            raise FileNotFoundError(f"the config sets back_translation but {where} holds no pairs: "
                                    "run `attnserve data backtranslate translate` first")
        examples += make_bt_examples(synthetic, tok, cfg.max_len)
    if not examples:  # else every epoch is empty, and the loop never reaches a step or hour limit
        raise ValueError(f"no training pair fits max_len {cfg.max_len} (tokens a side): raise it in {config_path}")
    # the longest batch the model will see, padded as collate pads it: else the model refuses it mid-run, and
    # again after each resume
    m = cfg.shape_multiple
    src_len = max(padded_length(e, m) if m > 1 else len(e[0]) for e in examples)
    tgt_len = max(padded_length(e, m) if m > 1 else len(e[1]) - 1 for e in examples)
    if src_len > mcfg.max_src_len or tgt_len > mcfg.max_tgt_len:
        raise ValueError(f"training batches reach {src_len} source and {tgt_len} target tokens, beyond the model's "
                         f"max_src_len {mcfg.max_src_len} / max_tgt_len {mcfg.max_tgt_len}: lower max_len or "
                         f"shape_multiple, or raise those, in {config_path}")
    n_params = sum(p.numel() for p in model.parameters())
    log(event="start", params=n_params, examples=len(examples), config=dataclasses.asdict(cfg))

    loss_of = compiled_loss(log) if cfg.compile_loss else token_loss
    stop = {"signum": None}
    # while the run lasts, either signal stops it at the end of a step (state saved); the caller's handlers after
    previous = {s: signal.signal(s, lambda signum, _: stop.update(signum=signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        model.train()
        last_ckpt = last_eval = time.time()
        clock = RunClock(meta["train_seconds"])
        win_tokens, win_t, win_loss, win_n = 0, time.time(), 0.0, 0
        bar = progress(desc="train", unit="step", initial=meta["step"], total=stop_step(meta, cfg))
        figures = {"loss": "-", "tok/s": "-"} | last_dev_bleu(run)  # the bar's postfix, from the first log line
        while stop["signum"] is None and not finished(meta, cfg):  # a resume or warm start may be done already
            rng = random.Random(cfg.seed * 1000 + meta["epoch"])
            batches = make_batches(examples, cfg.batch_tokens, rng, cfg.shape_multiple)
            seen = meta.get("epoch_batches")  # the batch list the position counts in (absent in older runs)
            # with the batching settings: another shape_multiple can give as many batches of other examples
            current = [len(examples), len(batches), cfg.batch_tokens, cfg.shape_multiple]
            if seen and seen != current and meta["batch_in_epoch"]:
                # other data or batching since the checkpoint: keep the epoch's fraction, not the index
                pos = round(meta["batch_in_epoch"] * len(batches) / seen[1])
                log(event="epoch_rebatched", step=meta["step"], examples=[seen[0], len(examples)],
                    batches=[seen[1], len(batches)], batch_in_epoch=[meta["batch_in_epoch"], pos])
                meta["batch_in_epoch"] = pos
            meta["epoch_batches"] = current
            while meta["batch_in_epoch"] < len(batches) and stop["signum"] is None and not finished(meta, cfg):
                idx = batches[meta["batch_in_epoch"]]
                src, tgt_in, tgt_out = (t.to(dev) for t in collate(examples, idx, mcfg.pad_id, cfg.shape_multiple))
                step = meta["step"] + 1
                lr = scheduled_lr(step, cfg, mcfg.d_model, meta.get("warm_start_step"))
                for g in opt.param_groups:
                    g["lr"] = lr
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                    logits = model(src, tgt_in)
                loss = loss_of(logits, tgt_out, mcfg.pad_id, cfg.label_smoothing)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
                opt.step()
                ntok = int((src != mcfg.pad_id).sum() + (tgt_out != mcfg.pad_id).sum())
                meta.update(step=step, batch_in_epoch=meta["batch_in_epoch"] + 1, tokens=meta["tokens"] + ntok)
                win_tokens += ntok
                win_loss += loss.item()
                win_n += 1
                bar.update(1)
                if stalled := clock.tick():
                    log(event="stalled", step=step, seconds=round(stalled), note="not counted as training time")
                    win_t += stalled  # nor in the pace the log and the progress bar's total come from
                meta["train_seconds"] = clock.seconds
                if step % cfg.log_every == 0:
                    now = time.time()
                    pace = max(now - win_t, 1e-6)
                    log(step=step, epoch=meta["epoch"], loss=round(win_loss / win_n, 4), lr=round(lr, 6),
                        tok_per_s=round(win_tokens / pace), hours=round(clock.seconds / 3600, 3))
                    bar.total = stop_step(meta, cfg, steps_per_s=win_n / pace)
                    figures.update({"loss": round(win_loss / win_n, 3), "tok/s": round(win_tokens / pace)})
                    bar.set_postfix(figures)
                    win_tokens, win_t, win_loss, win_n = 0, now, 0.0, 0
                if time.time() - last_ckpt > cfg.ckpt_minutes * 60:
                    checkpoint(run, model, opt, meta, cfg)
                    last_ckpt = time.time()
                if time.time() - last_eval > cfg.eval_minutes * 60:
                    bleu = {k: v for split, pairs in dev_pairs.items()
                            for k, v in dev_bleu(model, tok, pairs, cfg.eval_sentences, split).items()}
                    log(step=step, event="eval", **bleu)
                    figures.update(bleu_figures(bleu))
                    bar.set_postfix(figures)
                    last_eval = time.time()
            if meta["batch_in_epoch"] >= len(batches):
                meta.update(epoch=meta["epoch"] + 1, batch_in_epoch=0)
        bar.close()
        checkpoint(run, model, opt, meta, cfg)
        log(event="stopped", step=meta["step"], hours=round(meta["train_seconds"] / 3600, 3))
        if finished(meta, cfg):  # a cut run is not: Ctrl-C stops now, and a partial model never ships by accident
            export(run, model, tok, cfg, meta, export_to, log)
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
    if stop["signum"] and not finished(meta, cfg):  # else a supervisor could not tell it from a finished run
        raise Interrupted(stop["signum"], meta["step"], run)
    return run


def stop_step(meta: dict, cfg: TrainConfig, steps_per_s: float | None = None) -> int | None:
    """The step the run will stop at, for the progress bar: max_steps, or sooner where max_hours comes
    first at the current pace (None while there is no step limit and no pace yet)."""
    by_steps = cfg.max_steps if cfg.max_steps < NO_STEP_LIMIT else None
    if not steps_per_s:
        return by_steps
    by_hours = meta["step"] + round(max(0.0, cfg.max_hours * 3600 - meta["train_seconds"]) * steps_per_s)
    return by_hours if by_steps is None else min(by_steps, by_hours)


def bleu_figures(bleu: dict[str, float]) -> dict[str, float]:
    """dev_bleu's {"bleu_zh2en": x, "ted_dev_bleu_zh2en": y, ...} as the progress bar shows them:
    {"BLEU zh2en": x, "ted_dev BLEU zh2en": y, ...}."""
    return {k.replace("_bleu_", " BLEU ").replace("bleu_", "BLEU "): v for k, v in bleu.items()}


def last_dev_bleu(run: Path) -> dict[str, float]:
    """The latest dev BLEU a resumed run has logged, so its progress bar shows it before the next eval."""
    found: dict[str, float] = {}
    log = run / "train.log"
    for line in log.read_text(encoding="utf-8").splitlines() if log.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a crash
            if (rec := json.loads(line)).get("event") == "eval":
                found = bleu_figures({k: v for k, v in rec.items() if "bleu_" in k})
    return found


def finished(meta: dict, cfg: TrainConfig) -> bool:
    """The run has reached its hour or step limit (hours as recorded: a checkpoint rounds them to 3 decimals)."""
    return meta["train_seconds"] >= cfg.max_hours * 3600 or meta["step"] >= cfg.max_steps


# model settings that change what the weights compute but not their shapes (which loading checks): weights
# trained under one and loaded under another would train on without an error
SAME_FUNCTION = ("n_heads", "activation", "norm_first", "norm_eps", "scale_embeddings")


def changed_function(trained: dict, cfg: Seq2SeqConfig) -> str:
    """The SAME_FUNCTION settings where `cfg` differs from `trained` (the weights' config) as "name a -> b"
    ("" where none does)."""
    return ", ".join(f"{k} {trained[k]!r} -> {getattr(cfg, k)!r}" for k in SAME_FUNCTION
                     if k in trained and trained[k] != getattr(cfg, k))


def warm_start(model, ckpt: Path) -> dict:
    """Continue from a shipped checkpoint's weights and training counters, so the lr schedule (re-warmed, as
    Adam's moments are not shipped) and the logs go on."""
    ckpt_cfg, extra = read_config(ckpt)
    if changed := changed_function(ckpt_cfg.to_dict(), model.cfg):
        raise ValueError(f"{ckpt} was trained with another model ({changed}): give the config's model the "
                         "checkpoint's settings")
    load = widen_feed_forward if ckpt_cfg.d_ff != model.cfg.d_ff else load_weights
    load(model, ckpt / "model.safetensors")
    rec = extra.get("training", {})
    step = int(rec.get("steps", 0))
    return {"step": step, "epoch": int(rec.get("epochs", 0)), "batch_in_epoch": 0,
            "train_seconds": float(rec.get("hours", 0.0)) * 3600, "tokens": int(rec.get("tokens", 0)),
            "warm_start_step": step, "warm_start_from": str(ckpt)}


def widen_feed_forward(model, weights: Path) -> None:
    """Load a checkpoint with narrower feed-forward layers, computing the same function (Net2Net-style): the
    new units get zero `proj` columns, so they add nothing until training moves them."""
    state = load_file(str(weights))
    own = model.state_dict()
    for name, t in state.items():
        if name not in own:
            raise ValueError(f"{weights}: tensor {name} is not in the model")
        mine = own[name]
        if t.shape == mine.shape:
            continue
        if name.endswith("ff.fc.weight") or name.endswith("ff.fc.bias"):
            state[name] = torch.cat([t.to(mine), mine[t.shape[0]:]])  # (d_ff, d_model) / (d_ff,)
        elif name.endswith("ff.proj.weight") and t.shape[0] == mine.shape[0]:
            state[name] = torch.cat([t.to(mine), mine.new_zeros(t.shape[0], mine.shape[1] - t.shape[1])], dim=1)
        else:
            raise ValueError(f"{weights}: tensor {name} has shape {tuple(t.shape)}, the model "
                             f"{tuple(mine.shape)}; only the feed-forward width may grow")
        if state[name].shape != mine.shape:
            raise ValueError(f"{weights}: {name} {tuple(t.shape)} cannot widen to {tuple(mine.shape)}")
    if missing := sorted(set(own) - set(state)):
        raise ValueError(f"{weights}: missing tensors {missing[:5]}")
    model.load_state_dict(state)


def checkpoint(run: Path, model, opt, meta: dict, cfg: TrainConfig) -> None:
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_state(run, model, opt, meta, weights)
    snaps = run / "snapshots"
    snaps.mkdir(exist_ok=True)
    snap = snaps / f"step-{meta['step']}.safetensors"
    save_file(weights, str(snap.with_suffix(".tmp")))  # a kill mid-write leaves no torn snapshot to average
    snap.with_suffix(".tmp").replace(snap)
    for p in snapshots(run)[: -cfg.avg_last]:
        p.unlink()


def export(run: Path, model, tok, cfg: TrainConfig, meta: dict, export_to, log) -> Path:
    model = model.cpu()
    used = average_snapshots(run, model, cfg.avg_last)
    # into the run folder unless told: shipping replaces the served model, a choice made on the dev splits
    out = Path(export_to or run / "export")
    save_checkpoint(model, out, tokenizer=tok, dtype=torch.bfloat16,
                    extra={"training": {"steps": meta["step"], "epochs": meta["epoch"],
                                        "hours": round(meta["train_seconds"] / 3600, 3),
                                        "tokens": meta["tokens"], "averaged": used,
                                        **({"continued_from": meta["warm_start_from"],
                                            "continued_at_step": meta["warm_start_step"]}
                                           if "warm_start_from" in meta else {})}})
    log(event="exported", path=str(out), averaged=used)
    return out
