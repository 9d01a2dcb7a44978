"""A tiny end-to-end translator training run: loss drops, checkpoints resume exactly, export loads."""

import json
import time
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint, load_tokenizer
from model.training.train_translate import train


def _log(run):
    return [json.loads(line) for line in (run / "train.log").read_text().splitlines()]


def test_tiny_training_run_drops_loss_and_resumes(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    losses = [r["loss"] for r in _log(run) if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
    assert json.loads((run / "state.json").read_text())["step"] == 150

    cfg["max_steps"] = 170
    path.write_text(json.dumps(cfg))
    # the state's metadata is committed with its tensors: a state.json left stale (a kill between two
    # renames) does not move the resume
    (run / "state.json").write_text(json.dumps({**json.loads((run / "state.json").read_text()), "step": 7}))
    train(path, run, data_dir=data, resume=True, export_to=tmp_path / "export2")
    log = _log(run)
    assert [r for r in log if r.get("event") == "resumed"][-1]["step"] == 150
    steps = [r["step"] for r in log if "loss" in r]
    assert steps[-2:] == [160, 170]  # continued from 150, not restarted
    assert json.loads((run / "state.json").read_text())["opt_step"] == 170  # Adam's own count went on too

    with pytest.raises(FileExistsError, match="--resume"):  # a new run would mix with this one's snapshots
        train(path, run, data_dir=data, export_to=tmp_path / "export3")
    with pytest.raises(FileNotFoundError, match="no training run"):  # nothing to export: say so, export nothing
        train(path, tmp_path / "empty", data_dir=data, export_only=True, export_to=tmp_path / "export4")
    assert not (tmp_path / "export4").exists()

    model = load_checkpoint(tmp_path / "export")
    assert load_tokenizer(tmp_path / "export").vocab_size == model.cfg.vocab_size

    # --avg-last N picks how many kept snapshots the export averages: 1 = the last snapshot as it is
    from safetensors.torch import load_file

    train(path, run, data_dir=data, export_only=True, export_to=tmp_path / "last1", avg_last=1)
    exported = json.loads((tmp_path / "last1" / "config.json").read_text())
    assert exported["training"]["averaged"] == ["step-170.safetensors"]
    last = load_file(str(run / "snapshots" / "step-170.safetensors"))
    for name, w in load_checkpoint(tmp_path / "last1").state_dict().items():
        assert torch.equal(w, last[name].to(torch.bfloat16).float()), name  # shipped in bf16
    averaged = json.loads((tmp_path / "export2" / "config.json").read_text())["training"]["averaged"]
    assert averaged == ["step-150.safetensors", "step-170.safetensors"]  # the recipe's avg_last = 2
    with pytest.raises(ValueError, match="export"):
        train(path, run, data_dir=data, resume=True, avg_last=1)


@pytest.mark.parametrize("where", ["a_file", "a_file/export"])
def test_an_export_folder_that_is_a_file_or_under_one_is_refused_before_training(tiny_run, tmp_path, where):
    path, cfg, data, run = tiny_run
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="cannot take the export"):
        train(path, run, data_dir=data, export_to=tmp_path / where)
    assert not (run / "state.safetensors").exists()  # refused up front, not after the run trained


def test_a_second_training_process_in_a_run_folder_is_refused_while_the_first_trains(tiny_run, tmp_path,
                                                                                    monkeypatch):
    from model.training import train_translate as tt

    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 6
    path.write_text(json.dumps(cfg))
    lr, tried = tt.scheduled_lr, []

    def lr_and_a_second_run(step, *args):
        if step == 3 and not tried:  # before the first checkpoint: the folder holds no state yet
            for resume in (False, True):
                tried.append(resume)
                with pytest.raises(FileExistsError, match="in use by another training process"):
                    train(path, run, data_dir=data, resume=resume, export_to=tmp_path / "export2")
        return lr(step, *args)

    monkeypatch.setattr(tt, "scheduled_lr", lr_and_a_second_run)
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    assert tried == [False, True] and not (tmp_path / "export2").exists()
    assert [r["step"] for r in _log(run) if r.get("event") == "stopped"] == [6]  # the first run alone
    train(path, run, data_dir=data, export_only=True, export_to=tmp_path / "export3")  # the lock is given back


def test_a_kill_while_the_vocabulary_is_written_leaves_none_and_the_next_start_trains_it(tiny_run, tmp_path,
                                                                                       monkeypatch):
    from model.tokenizer import SentencePieceTokenizer

    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 2
    path.write_text(json.dumps(cfg))
    spm_train = SentencePieceTokenizer.train

    def killed_mid_write(texts, prefix, *args, **kwargs):
        spm_train(texts, prefix, *args, **kwargs)
        model = Path(f"{prefix}.model")
        model.write_bytes(model.read_bytes()[:100])  # the file as a kill mid-write leaves it
        raise KeyboardInterrupt

    monkeypatch.setattr(SentencePieceTokenizer, "train", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        train(path, run, data_dir=data, export_to=tmp_path / "export")
    monkeypatch.setattr(SentencePieceTokenizer, "train", spm_train)
    train(path, run, data_dir=data, export_to=tmp_path / "export")  # not a torn spm.model's RuntimeError
    assert [r["step"] for r in _log(run) if r.get("event") == "stopped"] == [2]


def test_a_kill_between_the_state_and_its_json_at_the_first_checkpoint_still_resumes(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 10
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    (run / "state.json").unlink()  # state.safetensors, with its metadata, committed; state.json not yet written
    with pytest.raises(FileExistsError, match="--resume"):  # a new run would overwrite the committed state
        train(path, run, data_dir=data, export_to=tmp_path / "export")
    cfg["max_steps"] = 20
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, resume=True, export_to=tmp_path / "export")
    assert [r for r in _log(run) if r.get("event") == "resumed"][-1]["step"] == 10
    assert [r["step"] for r in _log(run) if "loss" in r] == [10, 20]


def test_resuming_with_another_models_config_says_which_not_a_traceback(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 2
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    cfg.update(max_steps=4, model={**cfg["model"], "d_ff": 128})  # a run folder from another config
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not fit the config's model.*ff.fc.weight"):  # the CLI's one line
        train(path, run, data_dir=data, resume=True, export_to=tmp_path / "export")
    assert json.loads((run / "state.json").read_text())["step"] == 2

    cfg["model"] = {**cfg["model"], "d_ff": 64, "n_heads": 4}  # every weight keeps its shape: loading cannot tell
    path.write_text(json.dumps(cfg))
    for flags in ({"resume": True}, {"export_only": True}):
        with pytest.raises(ValueError, match="does not fit the config's model \\(n_heads 2 -> 4\\)"):
            train(path, run, data_dir=data, export_to=tmp_path / "export2", **flags)
    assert json.loads((run / "state.json").read_text())["step"] == 2 and not (tmp_path / "export2").exists()


def test_warm_start_from_a_shipped_checkpoint_continues_its_step_count(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    train(path, run, data_dir=data, export_to=tmp_path / "export")  # 150 steps, exported (averaged)
    shipped = load_checkpoint(tmp_path / "export")

    cfg["max_steps"] = 150  # a warm start at the shipped step trains nothing more: weights come back as loaded
    path.write_text(json.dumps(cfg))
    run2 = tmp_path / "run2"
    train(path, run2, data_dir=data, init_from=tmp_path / "export", export_to=tmp_path / "export2")
    log = _log(run2)
    assert [r for r in log if r.get("event") == "warm_start"][0]["step"] == 150
    assert (run2 / "spm.model").read_bytes() == (tmp_path / "export" / "tokenizer.model").read_bytes()
    again = load_checkpoint(tmp_path / "export2")
    for (name, a), (_, b) in zip(shipped.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name

    cfg["max_steps"] = 180  # and more steps continue from it, starting at a low, re-warming lr
    path.write_text(json.dumps(cfg))
    train(path, run2, data_dir=data, resume=True, export_to=tmp_path / "export3")
    steps = [r for r in _log(run2) if "loss" in r]
    assert [r["step"] for r in steps] == [160, 170, 180]
    assert steps[0]["lr"] < steps[-1]["lr"]
    meta = json.loads((tmp_path / "export2" / "config.json").read_text())
    assert meta["training"]["continued_at_step"] == 150

    cfg.update(max_steps=10**9, max_hours=meta["training"]["hours"])  # the hour limit, as recorded, counts too
    path.write_text(json.dumps(cfg))
    run3 = tmp_path / "run3"
    train(path, run3, data_dir=data, init_from=tmp_path / "export", export_to=tmp_path / "export4")
    assert [r for r in _log(run3) if r.get("event") == "stopped"][-1]["step"] == 150


@pytest.mark.parametrize("setting, value", [("n_heads", 4), ("activation", "gelu"), ("scale_embeddings", False)])
def test_a_warm_start_under_settings_of_the_same_shapes_but_another_function_is_refused(tiny_run, tmp_path,
                                                                                      setting, value):
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 2
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    cfg.update(max_steps=4, model={**cfg["model"], setting: value})  # every weight keeps its shape
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"another model \\({setting} "):
        train(path, tmp_path / "run2", data_dir=data, init_from=tmp_path / "export", export_to=tmp_path / "export2")
    assert not (tmp_path / "run2" / "state.safetensors").exists()


def test_back_translated_pairs_train_one_way_with_a_tag_and_ted_dev_is_scored(tiny_run, tmp_path):
    from model.tokenizer import SentencePieceTokenizer
    from model.training.back_translate import TAG_PIECE
    from model.training.train_translate import make_bt_examples

    path, cfg, data, run = tiny_run
    (data / "ted_dev.tsv").write_text((data / "dev.tsv").read_text(encoding="utf-8"), encoding="utf-8")
    rows = ["one two\t一二\tzh", "three four five\t三四五\ten", "six\t六\tzh"]
    (data / "bt.tsv").write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    cfg.update(max_steps=10, eval_minutes=0, eval_sentences=2, back_translation=True, eval_splits=["dev", "ted_dev"])
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    log = _log(run)
    n_train = len((data / "train.tsv").read_text(encoding="utf-8").splitlines())
    assert [r for r in log if r.get("event") == "start"][0]["examples"] == 2 * n_train + 3
    scored = [r for r in log if r.get("event") == "eval"][0]
    assert {"bleu_zh2en", "bleu_en2zh", "ted_dev_bleu_zh2en", "ted_dev_bleu_en2zh"} <= set(scored)

    tok = SentencePieceTokenizer(run / "spm.model")
    (src, tgt), (src2, tgt2), _ = make_bt_examples([r.split("\t") for r in rows], tok, 64)
    bt = tok.token_to_id(TAG_PIECE)
    assert src[:2] == [tok.token_to_id("<2zh>"), bt] and tok.decode(src[2:-1]) == "one two"  # synthetic English in
    assert tok.decode(tgt[1:-1]) == "一二"  # the real Chinese out
    assert src2[:2] == [tok.token_to_id("<2en>"), bt] and tok.decode(tgt2[1:-1]) == "three four five"


def test_a_recipe_with_back_translation_refuses_to_train_without_the_synthetic_pairs(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    cfg.update(max_steps=10, back_translation=True)
    path.write_text(json.dumps(cfg))
    assert not (data / "bt.tsv").exists()
    with pytest.raises(FileNotFoundError, match="bt.tsv holds no pairs: run `attnserve data backtranslate"):
        train(path, run, data_dir=data, export_to=tmp_path / "export")


def test_a_recipe_scoring_an_empty_split_refuses_before_training_not_at_its_first_evaluation(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    (data / "ted_dev.tsv").write_text("", encoding="utf-8")  # every talk went to ted_test
    cfg.update(max_steps=3, eval_minutes=0, eval_sentences=2, eval_splits=["dev", "ted_dev"])
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="ted_dev.tsv holds no pairs"):
        train(path, run, data_dir=data, export_to=tmp_path / "export")
    assert not (run / "state.json").exists()


@pytest.mark.parametrize("model_len,multiple", [(8, 1), (12, 32)])
def test_batches_longer_than_the_model_takes_are_refused_before_training(tiny_run, tmp_path, model_len, multiple):
    # the model refused the longest batch whenever it came up (a step or hours in), and again after a resume;
    # (12, 32): shape_multiple pads every batch to 32
    path, cfg, data, run = tiny_run
    cfg["model"].update(max_src_len=model_len, max_tgt_len=model_len)
    cfg.update(shape_multiple=multiple)
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"beyond the model's max_src_len {model_len} / max_tgt_len {model_len}"):
        train(path, run, data_dir=data, export_to=tmp_path / "export")
    assert not [r for r in _log(run) if "loss" in r]  # no step was taken


@pytest.mark.timeout(120)
def test_a_max_len_no_pair_fits_is_refused_before_training_not_an_endless_loop(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    cfg.update(max_len=2)  # a language tag, one piece and eos are 3 tokens: every pair is skipped
    path.write_text(json.dumps(cfg))
    # the loop went on from one empty epoch to the next, never reaching a step or hour limit
    with pytest.raises(ValueError, match="no training pair fits max_len 2"):
        train(path, run, data_dir=data, export_to=tmp_path / "export")
    assert not (run / "state.safetensors").exists()


def test_a_run_hands_sigterm_and_sigint_back_as_it_found_them(tiny_run, tmp_path, monkeypatch):
    # while it trains, either signal stops it at the end of a step, state saved; afterwards the caller's
    # handlers apply again (else Ctrl-C and a SIGTERM would only set a flag nobody reads any more)
    import signal

    from model.training import train_translate as tt

    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 2
    path.write_text(json.dumps(cfg))
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        train(path, run, data_dir=data, export_to=tmp_path / "export")
        assert {s: signal.getsignal(s) for s in before} == before

        def disk_full(*args):
            raise OSError("No space left on device")

        monkeypatch.setattr(tt, "checkpoint", disk_full)  # and where the run fails after its steps
        with pytest.raises(OSError, match="No space"):
            train(path, tmp_path / "run2", data_dir=data, export_to=tmp_path / "export2")
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_compiled_loss_matches_the_eager_loss_and_gradient_across_batch_shapes():
    """`compile_loss` (the recipes' default) runs token_loss through inductor with dynamic shapes."""
    from model.training.train_translate import token_loss

    compiled = torch.compile(token_loss, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for b, t in ((3, 5), (7, 2), (2, 9)):
        logits = torch.randn(b, t, 50, generator=g).bfloat16()
        tgt = torch.randint(1, 50, (b, t), generator=g)
        tgt[0, -1] = 0  # a pad: ignored
        grads = []
        for fn in (token_loss, compiled):
            x = logits.clone().requires_grad_()
            loss = fn(x, tgt, 0, 0.1)
            loss.backward()
            grads.append((loss.detach(), x.grad))
        torch.testing.assert_close(grads[0][0], grads[1][0])
        torch.testing.assert_close(grads[0][1], grads[1][1])
        assert bool((grads[0][1][0, -1] == 0).all())


def test_batches_group_similar_source_and_target_lengths_and_cover_every_example():
    import random

    from model.training.train_translate import make_batches

    rng = random.Random(0)
    # two directions mixed: a source length says little about its target's
    examples = [([1] * rng.randint(3, 40), [1] * rng.randint(3, 60)) for _ in range(20000)]
    batches = make_batches(examples, 2000, random.Random(1))
    assert sorted(i for b in batches for i in b) == list(range(len(examples)))
    real = sum(len(examples[i][1]) for b in batches for i in b)
    padded = sum(max(len(examples[i][1]) for i in b) * len(b) for b in batches)
    assert real / padded > 0.85  # sorted by source length alone: 0.55
    assert all(max(max(len(examples[i][0]), len(examples[i][1])) for i in b) * 2 * len(b) <= 2000
               for b in batches if len(b) > 1)


def test_shaped_batches_give_few_tensor_shapes_and_cover_every_example():
    import random

    from model.training.train_translate import collate, make_batches

    rng = random.Random(0)
    examples = [([5] * rng.randint(3, 100), [1] + [6] * rng.randint(2, 120)) for _ in range(5000)]
    batches = make_batches(examples, 4000, random.Random(1), multiple=8)
    assert sorted(i for b in batches for i in b) == list(range(len(examples)))
    shapes = set()
    for b in batches:
        src, tgt_in, tgt_out = collate(examples, b, 0, multiple=8)
        assert src.shape == tgt_in.shape == tgt_out.shape and src.shape[1] % 8 == 0
        assert src.shape[0] * src.shape[1] * 2 <= 4000 or len(b) == 1
        for row, i in enumerate(b):  # every token kept, in place, then padding
            s, t = examples[i]
            assert src[row, :len(s)].tolist() == s and not src[row, len(s):].any()
            assert tgt_in[row, :len(t) - 1].tolist() == t[:-1] and tgt_out[row, :len(t) - 1].tolist() == t[1:]
        shapes.add(tuple(src.shape))
    lengths = {s[1] for s in shapes}
    assert len(shapes) <= 2 * len(lengths) <= 2 * 16  # a full and a last batch per length
    assert len(make_batches(examples, 4000, random.Random(1))) > 0  # the default path unchanged


def test_resume_with_another_shape_multiple_rebatches_by_the_epochs_fraction(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 6
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    cfg.update(max_steps=8, shape_multiple=8)
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, resume=True, export_to=tmp_path / "export")
    event = [r for r in _log(run) if r.get("event") == "epoch_rebatched"][-1]
    assert event["batch_in_epoch"][0] == 6
    after = json.loads((run / "state.json").read_text())
    assert after["step"] == 8 and after["epoch_batches"][2:] == [cfg["batch_tokens"], 8]


def test_resume_on_other_data_keeps_the_epochs_fraction_not_a_stale_batch_index(tiny_run, tmp_path):
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 10  # part of the first epoch
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    before = json.loads((run / "state.json").read_text())
    n_examples, n_batches = before["epoch_batches"][:2]
    assert before["batch_in_epoch"] == 10 and before["epoch"] == 0
    with open(data / "train.tsv", "a", encoding="utf-8") as f:  # twice the data: about twice the batches
        f.write((data / "train.tsv").read_text(encoding="utf-8"))
    cfg["max_steps"] = 11
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, resume=True, export_to=tmp_path / "export")
    event = [r for r in _log(run) if r.get("event") == "epoch_rebatched"][-1]
    after = json.loads((run / "state.json").read_text())
    assert event["examples"] == [n_examples, after["epoch_batches"][0]]
    assert after["epoch_batches"][0] == 2 * n_examples
    assert event["batch_in_epoch"] == [10, round(10 * after["epoch_batches"][1] / n_batches)]
    assert after["batch_in_epoch"] == event["batch_in_epoch"][1] + 1 and after["epoch"] == 0


def test_where_the_loss_cannot_compile_training_says_so_and_goes_on_eagerly(tiny_run, tmp_path, monkeypatch):
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 3
    path.write_text(json.dumps(cfg))

    def no_compiler(fn, **kw):
        def broken(*a):
            raise RuntimeError("no C++ compiler")
        return broken

    monkeypatch.setattr(torch, "compile", no_compiler)
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    events = [r for r in _log(run) if r.get("event") == "compile_loss_unavailable"]
    assert len(events) == 1 and "no C++ compiler" in events[0]["error"]
    assert json.loads((run / "state.json").read_text())["step"] == 3


def test_upsampling_repeats_a_sources_pairs_in_each_epoch_and_rejects_unknown_sources(tiny_run, tmp_path):
    from model.training.translate_data import upsample

    pairs, sources = [("a", "甲"), ("b", "乙"), ("c", "丙")], ["hk", "ted", "hk"]
    assert upsample(pairs, sources, {"ted": 3}) == [("a", "甲"), ("b", "乙"), ("b", "乙"), ("b", "乙"), ("c", "丙")]
    with pytest.raises(ValueError, match="tedx"):
        upsample(pairs, sources, {"tedx": 2})
    with pytest.raises(ValueError, match="whole numbers"):
        upsample(pairs, sources, {"ted": 1.5})

    path, cfg, data, run = tiny_run
    n_train = len((data / "train.tsv").read_text(encoding="utf-8").splitlines())
    (data / "train.source").write_text("ted\n" * 100 + "hk\n" * (n_train - 100), encoding="utf-8")
    cfg.update(max_steps=2, upsample={"ted": 3})
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    start = [r for r in _log(run) if r.get("event") == "start"][0]
    assert start["examples"] == 2 * (n_train + 2 * 100)  # both directions of each copy


def test_one_way_sources_train_only_into_their_language(tiny_run, tmp_path):
    from model.training.train_translate import TrainConfig, make_examples

    path, cfg, data, run = tiny_run
    n_train = len((data / "train.tsv").read_text(encoding="utf-8").splitlines())
    (data / "train.source").write_text("ted_paragraphs\n" * 10 + "hk\n" * (n_train - 10), encoding="utf-8")
    cfg.update(max_steps=2, upsample={"ted_paragraphs": 2}, one_way={"ted_paragraphs": "en"})
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    start = [r for r in _log(run) if r.get("event") == "start"][0]
    assert start["examples"] == 2 * (n_train - 10) + 2 * 10  # two copies of ten pairs, one direction each

    class Tok:  # ids by character: enough to see which side became the target
        bos_id, eos_id = 1, 2

        def encode(self, text):
            return [ord(c) for c in text]

        def token_to_id(self, piece):
            return 3

    ex = make_examples([("ab", "甲"), ("cd", "乙")], Tok(), 16, [None, "zh"])
    targets = [t[1:-1] for _, t in ex]
    assert targets == [[ord("a"), ord("b")], [ord("甲")], [ord("乙")]]
    path.write_text(json.dumps({"one_way": {"ted": "fr"}}))
    with pytest.raises(ValueError, match="one_way"):
        TrainConfig.load(path)
    cfg.update(one_way={"tedx": "en"})
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="one_way: no training pairs from \\['tedx'\\]"):
        train(path, tmp_path / "run2", data_dir=data, export_to=tmp_path / "export2")


def test_cooldown_decays_the_lr_linearly_to_zero_at_max_steps_and_needs_max_steps(tmp_path):
    from model.training.train_translate import TrainConfig, lr_at, scheduled_lr

    cfg = TrainConfig(warmup_steps=100, lr_factor=1.0, max_steps=1000, cooldown_steps=200)
    assert scheduled_lr(700, cfg, 256) == lr_at(700, 256, 100, 1.0)  # before the cooldown: the schedule
    assert scheduled_lr(901, cfg, 256) == pytest.approx(lr_at(901, 256, 100, 1.0) * 0.5)
    assert scheduled_lr(1000, cfg, 256) == pytest.approx(lr_at(1000, 256, 100, 1.0) / 200)
    assert scheduled_lr(1001, cfg, 256) == 0.0
    # a warm start's ramp and the cooldown multiply
    assert scheduled_lr(901, cfg, 256, warm_start_step=751) == pytest.approx(lr_at(901, 256, 100, 1.0) * 0.25)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"cooldown_steps": 10}))
    with pytest.raises(ValueError, match="max_steps"):
        TrainConfig.load(path)
    path.write_text(json.dumps({"cooldown_steps": -10, "max_steps": 100}))  # a negative lr: gradient ascent
    with pytest.raises(ValueError, match="cooldown_steps must be >= 0"):
        TrainConfig.load(path)


@pytest.mark.parametrize("key,value", [("avg_last", 0), ("avg_last", -2), ("log_every", 0), ("warmup_steps", 0),
                                       ("batch_tokens", 0), ("threads", 0), ("eval_sentences", 0)])
def test_counts_below_one_are_refused_when_the_recipe_loads(tmp_path, key, value):
    # avg_last 0, read as "no averaging", kept every snapshot and exported their average (snapshots[-0:]);
    # log_every and warmup_steps 0 divided by zero at the first step, after the data had been encoded;
    # eval_sentences 0 crashed sacreBLEU (IndexError on no sentences) at the run's first evaluation
    from model.training.train_translate import TrainConfig

    path = tmp_path / "c.json"
    path.write_text(json.dumps({key: value}))
    with pytest.raises(ValueError, match=f"{key} must be >= 1"):
        TrainConfig.load(path)


@pytest.mark.parametrize("value", ["on", "false", "bf16"])
def test_a_bf16_setting_other_than_true_false_or_auto_is_refused_when_the_recipe_loads(tmp_path, value):
    # it loaded, and torch.autocast raised a TypeError at the first step, after the vocabulary's training
    from model.training.train_translate import TrainConfig

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"bf16": value}))
    with pytest.raises(ValueError, match='bf16 must be true, false or "auto"'):
        TrainConfig.load(path)
    for ok in (True, False, "auto"):
        path.write_text(json.dumps({"bf16": ok}))
        assert TrainConfig.load(path).bf16 == ok


@pytest.mark.parametrize("key,value,want", [
    ("label_smoothing", -0.1, r"in \[0, 1\]"), ("label_smoothing", 1.5, r"in \[0, 1\]"), ("clip_norm", -1.0, "> 0"),
    ("clip_norm", 0, "> 0"), ("lr_factor", -0.5, "> 0"), ("lr_factor", 0, "> 0")])
def test_a_recipe_that_would_train_wrongly_is_refused_when_it_loads(tmp_path, key, value, want):
    # these loaded: label smoothing out of range failed at the first step, after the vocabulary's training;
    # a negative clip_norm (clip_grad_norm_ scales by max_norm / norm) or lr_factor climbed the loss silently
    from model.training.train_translate import TrainConfig

    path = tmp_path / "c.json"
    path.write_text(json.dumps({key: value}))
    with pytest.raises(ValueError, match=f"TrainConfig.{key} must be {want}, got {value}"):
        TrainConfig.load(path)


def test_a_finished_run_exports_into_its_run_folder_not_over_the_shipped_model(tiny_run, tmp_path, monkeypatch):
    from model import paths

    shipped = tmp_path / "shipped"
    monkeypatch.setattr(paths, "SHIPPED_TRANSLATOR", shipped)  # where older code exported by default
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 20
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data)
    assert (run / "export" / "model.safetensors").is_file()
    assert not shipped.exists()
    assert [r for r in _log(run) if r.get("event") == "exported"][-1]["path"] == str(run / "export")


@pytest.mark.parametrize("recipe", sorted(p.name for p in (Path(__file__).parents[1] / "configs").glob("*.json")))
def test_every_shipped_recipe_loads_with_its_model_config(recipe):
    from model.config import Seq2SeqConfig
    from model.training.train_translate import TrainConfig

    cfg = TrainConfig.load(Path(__file__).parents[1] / "configs" / recipe)
    assert Seq2SeqConfig.from_dict({**cfg.model, "vocab_size": cfg.vocab_size}).d_model > 0


def test_a_wider_feed_forward_starts_as_the_checkpoint_it_grew_from(tmp_path):
    import dataclasses

    from safetensors.torch import save_file

    from model.checkpoint import build_model
    from model.config import Seq2SeqConfig
    from model.training.train_translate import widen_feed_forward

    cfg = Seq2SeqConfig(vocab_size=50, d_model=16, n_encoder_layers=2, n_decoder_layers=2, n_heads=2, d_ff=32,
                        max_src_len=16, max_tgt_len=16, dropout=0.0)
    torch.manual_seed(0)
    narrow = build_model(cfg).eval()
    shipped = {k: v.to(torch.bfloat16).contiguous() for k, v in narrow.state_dict().items()}  # shipped in bf16
    save_file(shipped, str(tmp_path / "model.safetensors"))
    narrow.load_state_dict(shipped)
    wide = build_model(dataclasses.replace(cfg, d_ff=64)).eval()
    widen_feed_forward(wide, tmp_path / "model.safetensors")
    src, tgt = torch.randint(3, 50, (2, 7)), torch.randint(3, 50, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(wide(src, tgt), narrow(src, tgt))
    assert wide.encoder[0].ff.fc.weight[32:].abs().sum() > 0  # the new units can learn: only proj starts at 0

    other = build_model(dataclasses.replace(cfg, d_model=32, d_ff=64))
    with pytest.raises(ValueError, match="only the feed-forward width may grow"):
        widen_feed_forward(other, tmp_path / "model.safetensors")


def test_a_pause_is_left_out_of_the_logged_pace(tiny_run, tmp_path, monkeypatch):
    # a job stopped for an hour (kill -STOP) mid-window: its tok/s and the progress bar's pace leave it out
    import types

    from model.training import train_translate as tt

    shift = [0.0]
    monkeypatch.setattr(tt, "time", types.SimpleNamespace(time=lambda: time.time() + shift[0]))

    class PausedOnce(tt.RunClock):
        ticks = 0

        def tick(self) -> float:
            PausedOnce.ticks += 1
            if PausedOnce.ticks == 35:
                shift[0] += 3600.0
                return 3600.0
            return super().tick()

    monkeypatch.setattr(tt, "RunClock", PausedOnce)
    path, _, data, run = tiny_run
    tt.train(path, run, data_dir=data, export_to=tmp_path / "export")
    logged = [json.loads(line) for line in (run / "train.log").read_text().splitlines()]
    assert any(r.get("event") == "stalled" and r["seconds"] == 3600 for r in logged)
    pace = {r["step"]: r["tok_per_s"] for r in logged if "tok_per_s" in r}
    others = sorted(v for step, v in pace.items() if step != 40)
    assert pace[40] > 0.2 * others[len(others) // 2]  # an hour in the window would cut it ~1000-fold


def test_resume_of_a_folder_without_a_run_says_it_starts_a_new_one(tiny_run, tmp_path, capsys):
    """A supervisor may pass --resume from the first start, so it trains; but a misspelt --run-dir trained
    from scratch without a word."""
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 2
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, resume=True, export_to=tmp_path / "export")
    assert f"{run}: no saved state to resume; starting a new run there" in capsys.readouterr().out
    assert json.loads((run / "state.json").read_text())["step"] == 2


def test_a_run_whose_vocabulary_is_gone_is_not_resumed(tiny_run, tmp_path):
    """spm.model deleted: the resume trained a new vocabulary of the same size, and the state's weights went on
    under other ids without a word."""
    path, cfg, data, run = tiny_run
    cfg["max_steps"] = 2
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    (run / "spm.model").unlink()
    cfg["max_steps"] = 4
    path.write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="holds a training state but not its vocabulary"):
        train(path, run, data_dir=data, resume=True, export_to=tmp_path / "export")
    assert not (run / "spm.model").exists()
