"""The shipped zh<->en checkpoint (weights/attnserve-zh-en) loads and translates in-domain sentences through
the engine that serves /v1/translate (service/local.py, as `attnserve translate` runs it)."""

import pytest

from model import paths

SHIPPED = paths.SHIPPED_TRANSLATOR


class _Engine:
    def __init__(self):
        from service import local

        self.engine = local.load_translator(local.translator_spec(SHIPPED))

    def translate(self, texts: list[str], **request) -> list[str]:
        from service import local

        return local.translate(self.engine, texts, **request).translations


@pytest.fixture(scope="module")
def translator():
    return _Engine()


def test_card_and_size():
    assert (SHIPPED / "MODEL_CARD.md").is_file()
    total = sum(p.stat().st_size for p in SHIPPED.iterdir())
    assert total <= 60 * 2**20


def test_zh_to_en_money_market(translator):
    out = translator.translate(["本基金亦可投资于货币市场工具和持有现金。"], target_lang="en", beam_size=4)[0]
    assert "money market" in out.lower(), out


def test_en_to_zh_money_market(translator):
    out = translator.translate(["The Fund may also invest in money market instruments."], target_lang="zh",
                               beam_size=4)[0]
    assert "货币市场" in out, out


def test_direction_is_detected(translator):
    en, zh = translator.translate(["本基金亦可投资于货币市场工具。", "The Fund may invest in bonds."], beam_size=1)
    assert en.isascii() and not zh.isascii()
