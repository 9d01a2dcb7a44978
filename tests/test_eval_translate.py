"""`attnserve eval translate` on a 10-line fixture: its BLEU / chrF against sacreBLEU computed here, for a
stand-in translator with known outputs and for the shipped translator through the served engine; the
loop rate it reports."""

import json

import pytest
import sacrebleu

from model import paths
from model.training.eval_translate import loop_rate, loops
from service import cli, local

PAIRS = [
    ("The Fund may invest in money market instruments.", "本基金可投资于货币市场工具。"),
    ("Investors should read the offering document carefully.", "投资者应仔细阅读销售文件。"),
    ("The Court of Appeal dismissed the appeal.", "上诉法庭驳回上诉。"),
    ("The Financial Secretary announced the budget today.", "财政司司长今天公布财政预算案。"),
    ("The value of the investment may go down as well as up.", "投资价值可升亦可跌。"),
    ("The Commission will publish its annual report in June.", "证监会将于六月发表年报。"),
    ("Past performance is not indicative of future results.", "过往表现并不代表将来的表现。"),
    ("The applicant was ordered to pay the costs.", "申请人被命令支付讼费。"),
    ("The Ordinance came into operation on 1 April 2019.", "该条例于2019年4月1日开始实施。"),
    ("Please contact your financial adviser if in doubt.", "如有疑问，请联络阁下的财务顾问。"),
]


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for split in ("test", "ted_test"):
        (d / f"{split}.tsv").write_text("".join(f"{en}\t{zh}\n" for en, zh in PAIRS), encoding="utf-8")
    return d


def _fake_en(en: str) -> str:
    return " ".join(en.split()[:-2]) + " results."  # last two words wrong


def _fake_zh(zh: str) -> str:
    return zh[:-3] + "的,。"  # two characters wrong, one ASCII comma


BY_SOURCE = {zh: _fake_en(en) for en, zh in PAIRS} | {en: _fake_zh(zh) for en, zh in PAIRS}


def _fake_translate(engine, texts, **request):
    """Outputs known in advance: a degraded reference per source."""
    assert engine == "stand-in engine"

    class Result:
        translations = [BY_SOURCE[t] for t in texts]
    return Result()


def test_eval_bleu_matches_sacrebleu(data, tmp_path, monkeypatch):
    monkeypatch.setattr(local, "load_translator", lambda spec: "stand-in engine")
    monkeypatch.setattr(local, "translate", _fake_translate)
    out = tmp_path / "report.json"
    assert cli.main(["eval", "translate", "--model", "stand-in", "--data", str(data), "--split", "ted_test",
                     "--beams", "1,4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["split"] == "ted_test" and report["ted_test_pairs"] == 10
    en_hyps, zh_hyps = [_fake_en(en) for en, _ in PAIRS], [_fake_zh(zh) for _, zh in PAIRS]
    en_refs, zh_refs = [en for en, _ in PAIRS], [zh for _, zh in PAIRS]
    zh2en = sacrebleu.corpus_bleu(en_hyps, [en_refs], tokenize="13a").score
    en2zh = sacrebleu.corpus_bleu(zh_hyps, [zh_refs], tokenize="zh").score
    assert 10 < zh2en < 90 and 10 < en2zh < 90 and abs(zh2en - en2zh) > 1  # distinct, neither trivial
    for beam in (1, 4):
        r = report["results"]
        assert r[f"zh2en_beam{beam}"]["bleu"] == round(zh2en, 2)
        assert r[f"en2zh_beam{beam}"]["bleu"] == round(en2zh, 2)
        assert r[f"en2zh_beam{beam}"]["chrf"] == round(sacrebleu.corpus_chrf(zh_hyps, [zh_refs]).score, 2)
        # 10 "。" and the "，" of the last sentence against 10 ","
        assert r[f"en2zh_beam{beam}"]["fullwidth_punct_share"] == round(11 / 21, 4)
        assert "fullwidth_punct_share" not in r[f"zh2en_beam{beam}"]
        # each fake English output is one word shorter than its reference: sacreBLEU's lengths
        bleu = sacrebleu.corpus_bleu(en_hyps, [en_refs], tokenize="13a")
        assert r[f"zh2en_beam{beam}"]["length_ratio"] == round(bleu.sys_len / bleu.ref_len, 3) < 1
        assert r[f"zh2en_beam{beam}"]["brevity_penalty"] == round(bleu.bp, 3) < 1
    assert report["samples"]["en2zh"][0] == {"source": PAIRS[0][0], "reference": PAIRS[0][1], "output": zh_hyps[0]}


def test_eval_of_the_shipped_translator_matches_sacrebleu(data, tmp_path):
    """The real path: the shipped checkpoint, greedy, the HK split name."""
    out = tmp_path / "report.json"
    model = paths.SHIPPED_TRANSLATOR
    assert cli.main(["eval", "translate", "--model", str(model), "--data", str(data), "--beams", "1",
                     "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    zh_hyps = local.translate(local.load_translator(local.translator_spec(model)), [en for en, _ in PAIRS],
                              target_lang="zh", beam_size=1).translations
    en_hyps = local.translate(local.load_translator(local.translator_spec(model)), [zh for _, zh in PAIRS],
                              target_lang="en", beam_size=1).translations
    en2zh = sacrebleu.corpus_bleu(zh_hyps, [[zh for _, zh in PAIRS]], tokenize="zh").score
    zh2en = sacrebleu.corpus_bleu(en_hyps, [[en for en, _ in PAIRS]], tokenize="13a").score
    assert report["results"]["en2zh_beam1"]["bleu"] == round(en2zh, 2) > 5
    assert report["results"]["zh2en_beam1"]["bleu"] == round(zh2en, 2) > 5
    assert report["results"]["en2zh_beam1"]["fullwidth_punct_share"] >= 0.99  # Chinese output punctuation


def test_loop_rate_counts_outputs_with_a_4gram_three_times():
    assert loops("各国各国各国各国", "zh") and not loops("各国各国", "zh")
    assert loops("of the Heritage Foundation of the Heritage Foundation of the Heritage Foundation", "en")
    assert not loops("the cat sat on the mat and the cat sat", "en")  # a 4-gram twice is not a loop
    assert loop_rate(["a b c d a b c d a b c d", "a b c d", "x"], "en") == 1 / 3


def test_eval_passes_decoding_options_to_the_translator(data, tmp_path, monkeypatch):
    """--length-penalty, --no-repeat-ngram and --min-length-ratio reach every request; left out, the service's
    defaults apply."""
    seen = []

    def spy(engine, texts, **request):
        options = ("length_penalty", "no_repeat_ngram", "min_length_ratio")
        seen.append({k: v for k, v in request.items() if k in options})
        return _fake_translate(engine, texts, **request)

    monkeypatch.setattr(local, "load_translator", lambda spec: "stand-in engine")
    monkeypatch.setattr(local, "translate", spy)
    args = ["eval", "translate", "--model", "x", "--data", str(data), "--beams", "4", "--out", str(tmp_path / "r.json")]
    assert cli.main(args + ["--length-penalty", "1.7", "--no-repeat-ngram", "2", "--min-length-ratio", "0.5"]) == 0
    assert seen == [{"length_penalty": 1.7, "no_repeat_ngram": 2, "min_length_ratio": 0.5}] * 2  # both directions
    seen.clear()
    assert cli.main(args) == 0
    assert seen == [{}] * 2


def test_an_empty_split_is_an_error_that_says_so_not_a_traceback(data, tmp_path, monkeypatch, capsys):
    # `data prepare --heldout-sentences` large enough puts every talk in ted_test and leaves ted_dev empty
    (data / "ted_dev.tsv").write_text("", encoding="utf-8")
    monkeypatch.setattr(local, "load_translator", lambda spec: "stand-in engine")
    monkeypatch.setattr(local, "translate", _fake_translate)
    out = tmp_path / "r.json"
    args = ["eval", "translate", "--model", "x", "--data", str(data), "--split", "ted_dev", "--out", str(out)]
    assert cli.main(args) != 0
    assert "ted_dev.tsv holds no pairs" in capsys.readouterr().err
    assert not out.exists()
