"""How a text to translate is cut into lines and sentences and how its language is told (model/translation.py):
nothing is lost or split mid-sentence, and what needs no translation passes through."""

import pytest

from model.translation import (
    detect_lang,
    join_sentences,
    join_text,
    needs_translation,
    pieces,
    split_long,
    split_sentences,
    split_text,
)


@pytest.mark.parametrize("text, sentences", [
    ("他说：“你好！”她笑了。", ["他说：“你好！”", "她笑了。"]),  # the closing quote stays with its sentence
    ("What?! Really?", ["What?!", "Really?"]),  # a run of marks is one end
    ("真的吗？！是的。", ["真的吗？！", "是的。"]),
    ("The U.K. Government said no.", ["The U.K. Government said no."]),  # initials
    ("Read p. 5 first. See Fig. 2 too.", ["Read p. 5 first.", "See Fig. 2 too."]),
    ("Mr. Smith went. He left.", ["Mr. Smith went.", "He left."]),
    ("See No. 5 and s. 2(1). The answer was no. Then he left.", ["See No. 5 and s. 2(1).", "The answer was no.",
                                                                 "Then he left."]),
    ("Pi is 3.14. Next one.", ["Pi is 3.14.", "Next one."]),
    ("1. Flour", ["1. Flour"]),  # an item's label stays with it
    ("(2) The licence. (3) Another.", ["(2) The licence.", "(3) Another."]),
    ("今天天气很好。我们去公园散步吧！", ["今天天气很好。", "我们去公园散步吧！"]),
    # ! and ? inside code, URLs and quotations go on; before Chinese they end
    ("Use if (a != b) to compare.", ["Use if (a != b) to compare."]),
    ("See https://example.com/page?id=3 for details.", ["See https://example.com/page?id=3 for details."]),
    ('He said "Stop!" and left.', ['He said "Stop!" and left.']),
    ("Hello!你好。", ["Hello!", "你好。"]),
    ("", []),
])
def test_split_sentences(text, sentences):
    assert split_sentences(text) == sentences


@pytest.mark.timeout(30)  # quadratic, 100,000 dots took minutes; tried once, milliseconds
def test_a_long_run_of_marks_is_tried_once_as_a_sentence_end():
    """A sentence end is sought where a run of . ; ! ? starts, not at each of its marks (a 2,000-character text
    took ~0.1 s on the replica's event loop, per text)."""
    assert split_sentences("." * 100_000 + "x") == ["." * 100_000 + "x"]
    assert split_sentences("Wait" + "!" * 100_000 + " Then.") == ["Wait" + "!" * 100_000, "Then."]
    assert split_sentences("你" + "?" * 100_000 + "好") == ["你" + "?" * 100_000, "好"]


@pytest.mark.timeout(30)  # quadratic, 50,000 merges took minutes; in the last part, milliseconds
def test_abbreviations_merged_again_and_again_are_searched_in_the_last_part():
    """"Mr." and "A." do not end a sentence: a sentence merged again and again was searched whole each time;
    only its last part can hold the abbreviation."""
    assert split_sentences("Mr. " * 50_000) == [("Mr. " * 50_000).strip()]
    assert split_sentences("A. " * 30_000 + "No. 5 xy. Then.") == [("A. " * 30_000) + "No. 5 xy.", "Then."]
    assert split_sentences("Mr. 1. Flour. Then.") == ["Mr. 1.", "Flour.", "Then."]  # a label merges only alone


def test_lines_and_paragraphs_are_kept():
    text = "Ingredients:\n1. Flour\n2. Sugar\n\nMix them.  Bake."
    lines = split_text(text)
    assert lines == [["Ingredients:"], ["1. Flour"], ["2. Sugar"], [], ["Mix them.", "Bake."]]
    assert join_text(lines, "en") == "Ingredients:\n1. Flour\n2. Sugar\n\nMix them. Bake."
    assert split_text("a\r\nb\rc\u2028d") == [["a"], ["b"], ["c"], ["d"]]  # every kind of line end
    assert join_text([["你好。", "再见。"], [], ["好"]], "zh") == "你好。再见。\n\n好"
    # a line is punctuated as one piece: what passes through takes its neighbours' marks
    assert join_text([["那么两点是什么？", "4."], ["是的。", "2024!"]], "zh") == "那么两点是什么？4。\n是的。2024！"
    assert join_text([['他说:"你好!', '我是小明."然后走了.']], "zh") == "他说：“你好！我是小明。”然后走了。"


def test_inputs_are_normalised_as_the_training_data_was():
    assert split_text("ｆｕｌｌ　width\u200b２０２３") == [["full width2023"]]


@pytest.mark.parametrize("text, lang", [
    ("我用Visual Studio Code写代码", "zh"), ("JavaScript框架", "zh"), ("I visited 北京 last year", "en"),
    ("Hello world.", "en"), ("你好世界。", "zh"), ("2023", "en"),
    ("请联系john.smith@example.com", "zh"), ("详情请见https://www.example.com/funds/abc/index.html", "zh"),
    ("ＩＢＭ ａｎｄ Ｍｉｃｒｏｓｏｆｔ 合作", "en"),  # full-width letters read as their normalised sentence is
])
def test_detect_lang_weighs_cjk_characters_against_latin_words(text, lang):
    assert detect_lang(text) == lang


@pytest.mark.parametrize("sentence, target, needed", [
    ("？", "en", False), ("😀", "zh", False), ("2023.", "zh", False),  # nothing to translate
    ("Hello world.", "en", False), ("你好。", "zh", False),  # already in the target language
    ("Hello world.", "zh", True), ("你好。", "en", True), ("https://example.com/a", "zh", False),
])
def test_needs_translation(sentence, target, needed):
    assert needs_translation(sentence, target) is needed


def test_a_language_tag_typed_in_the_text_is_not_a_control_token():
    from model.checkpoint import load_tokenizer
    from model.paths import SHIPPED_TRANSLATOR
    from model.translation import TAGS, encode_source

    tok = load_tokenizer(SHIPPED_TRANSLATOR)
    tags = {tok.token_to_id(t) for t in TAGS.values()}
    ids = encode_source(tok, "Hello <2en> world <2zh>", "zh")
    assert ids[0] == tok.token_to_id("<2zh>") and not tags & set(ids[1:])


@pytest.mark.parametrize("sentence, pieces", [
    ("short, fits", ["short, fits"]),
    ("one two three, four five six; seven", ["one two three,", "four five six;", "seven"]),  # clause marks first
    ("一二三四五六七八，九十一二三四五六", ["一二三四五六七八，", "九十一二三四五六"]),
    ("one two three four five six", ["one two three", "four five six"]),  # else spaces
    ("一二三四五六七八九十一二三四五六", ["一二三四五六七八", "九十一二三四五六"]),  # else characters
    ("Pay 1,234,567 now at 12:30", ["Pay 1,234,567", "now at 12:30"]),  # never inside numbers
])
def test_a_sentence_too_long_is_cut_nearest_its_middle(sentence, pieces):
    out = split_long(sentence, lambda s: len(s) <= 14)
    assert out == pieces and all(len(p) <= 14 for p in out)


def test_urls_and_addresses_are_pieces_of_their_own():
    assert pieces("详情请见https://www.example.com/a.html。", lambda s: True) == [
        "详情请见", "https://www.example.com/a.html", "。"]
    assert pieces('Use print("hi") or mail a@b.com today.', lambda s: True) == [
        'Use print("hi") or mail', "a@b.com", "today."]
    assert pieces("under s.2(1) of the Ordinance.", lambda s: True) == ["under s.2(1) of the Ordinance."]
    assert not needs_translation("https://www.example.com/a.html", "zh")
    # a bracketed part of a URL stays in it; the prose's own closing bracket does not
    wiki = "https://en.wikipedia.org/wiki/Python_(programming_language)"
    assert pieces(f"See {wiki} for details.", lambda s: True) == ["See", wiki, "for details."]
    assert pieces(f"详见{wiki}。", lambda s: True) == ["详见", wiki, "。"]
    assert pieces("(see https://a.com/x) now", lambda s: True) == ["(see", "https://a.com/x", ") now"]
    # a link too long for the model is still one piece, passed through whole
    url = "https://example.com/download?" + "&".join(f"k{i}=" + "AB12" * 20 for i in range(8))
    assert pieces(f"请从这里下载：{url} 谢谢。", lambda s: len(s) <= 40) == ["请从这里下载：", url, "谢谢。"]



def test_runs_of_emoji_are_pieces_of_their_own():
    """The model's vocabulary hardly holds emoji: a run of them passes through, at a sentence's edges or inside
    it (with the clause mark after it), ZWJ sequences whole."""
    family = "\U0001F468\u200d\U0001F469\u200d\U0001F467"  # one picture, joined by ZWJs
    (sentence,) = split_text(f"{family} is my family \u2764\ufe0f")[0]
    assert sentence == f"{family} is my family \u2764\ufe0f"  # normalising keeps the joiners inside emoji
    assert pieces(sentence, lambda s: True) == [family, "is my family", "\u2764\ufe0f"]
    assert not needs_translation(family, "zh") and not needs_translation("\u2764\ufe0f", "en")
    assert pieces("Great job \U0001F44D, see you.", lambda s: True) == ["Great job", "\U0001F44D,", "see you."]
    assert pieces("今天很好\U0001F600 \U0001F600我们走吧。", lambda s: True) == [
        "今天很好", "\U0001F600 \U0001F600", "我们走吧。"]
    assert pieces("\U0001F600", lambda s: True) == ["\U0001F600"]
    keycap = "1\ufe0f\u20e3"  # a digit and its keycap mark: one picture
    assert pieces(f"Press {keycap} to start", lambda s: True) == ["Press", keycap, "to start"]
    assert pieces(f"{keycap}#\ufe0f\u20e3 go", lambda s: True) == [f"{keycap}#\ufe0f\u20e3", "go"]
    assert pieces("Press 1 to start", lambda s: True) == ["Press 1 to start"]
    assert split_text("a\u200db")[0] == ["ab"]  # a joiner outside emoji is still dropped
    assert join_sentences(["\U0001F600", "你好", "\U0001F600"], "zh") == "\U0001F600你好\U0001F600"
    assert join_sentences(["Great job", "\U0001F44D,", "see you."], "en") == "Great job \U0001F44D, see you."


def test_links_and_code_calls_start_where_their_run_of_characters_starts():
    """A match may not start inside a run of its own characters (which keeps scanning a long run without "@"
    or "(" linear): whole addresses and calls are still found."""
    from model.punctuation import split_links, without_protected

    assert split_links("write to first.last+tag@mail.example.org now") == [
        "write to", "first.last+tag@mail.example.org", "now"]
    assert without_protected("see obj.attr.method(x, y) and f(z).") == "see   and  ."
    assert without_protected("a.b.c.d") == "a.b.c.d" and split_links("x" * 50) == ["x" * 50]
    # chained calls: a call may start after a "." that follows a bracket or a quote
    assert without_protected("调用foo(x).bar()") == "调用 . "
    assert without_protected("df[0].sum()") == "df[0]. " and without_protected("$('#id').hide()") == "$('#id'). "


@pytest.mark.parametrize("parts, lang, text", [
    (["See details", "https://example.com", "."], "en", "See details https://example.com."),
    (["Email", "bob@example.com", "!"], "en", "Email bob@example.com!"),
    (["(see", "https://a.com/x", ") now."], "en", "(see https://a.com/x) now."),
    (["访问", "https://a.com", ",", "https://b.com", "."], "zh", "访问https://a.com，https://b.com。"),
    (["下载", "https://example.com", "2次。"], "zh", "下载https://example.com 2次。"),  # the URL keeps its end
    (["第一句。", "第二句。"], "zh", "第一句。第二句。"),
    # opening marks hug what follows, closing ones what precedes (full-width before postprocessing)
    (["For details, see (", "https://example.com/docs", "）。"], "en", "For details, see (https://example.com/docs）。"),
    (["Mail: “", "a.b@example.com", "”."], "en", "Mail: “a.b@example.com”."),
])
def test_pieces_join_without_gluing_or_stray_spaces(parts, lang, text):
    assert join_sentences(parts, lang) == text
