"""model/chat.py renders a chat template as Hugging Face's apply_chat_template does."""

from __future__ import annotations

import pytest

from model.chat import ChatTemplateError, render_chat

HI = [{"role": "user", "content": "hi"}]


def test_tools_and_documents_are_none_as_hf_passes_them():
    # Mistral's templates test `tools is not none`: an undefined would open a tools block for no tools
    tpl = ("{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
           "{{ messages[0].content }}")
    assert render_chat(tpl, HI) == "hi"


def test_the_generation_tag_renders_its_body_as_in_hf():
    # templates written for training (return_assistant_tokens_mask) wrap the assistant's turn in it
    tpl = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{% set x = 1 %}"
           "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}|{% endfor %}{{ x }}")
    assert render_chat(tpl, [*HI, {"role": "assistant", "content": "yo"}]) == "hi|yo|"


@pytest.mark.parametrize("tpl, error", [
    ("{{ 1 / (messages | length - 1) }}", "ZeroDivisionError"),
    ("{{ messages[0].content * 10 ** 20 }}", "OverflowError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
])
def test_a_template_failing_on_the_messages_is_a_chat_template_error(tpl, error):
    # the routes answer ChatTemplateError with a 400 naming messages; any other exception was a 500
    with pytest.raises(ChatTemplateError, match=f"chat template failed: {error}"):
        render_chat(tpl, HI)


def test_a_template_sees_every_named_special_token_as_hf_passes_them():
    from tokenizers import Tokenizer, models

    from model.bpe_tokenizer import BPETokenizer

    names = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", "sep_token": "<sep>",
             "cls_token": "<cls>", "mask_token": "<mask>"}
    tok = BPETokenizer(Tokenizer(models.BPE()), {**names, "additional_special_tokens": ["<x>"]})
    assert tok.special_tokens() == names
    tpl = "{{ bos_token }}{{ unk_token }}{{ pad_token }}{{ sep_token }}{{ cls_token }}{{ mask_token }}{{ eos_token }}"
    assert render_chat(tpl, HI, **tok.special_tokens()) == "<s><unk><pad><sep><cls><mask></s>"


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STRIPPING = "{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}</s>{% endfor %}"


@pytest.mark.parametrize("tpl", [CHATML, STRIPPING])
@pytest.mark.parametrize("reply", ["The answer is", "The answer is ", "", "hi"])
def test_continue_final_message_cuts_the_text_as_hf_does(tpl, reply):
    from transformers.utils.chat_template_utils import render_jinja_template

    # "hi" also opens the conversation: the cut is after the last message, not the first match
    msgs = [*HI, {"role": "assistant", "content": reply}]
    ours = render_chat(tpl, msgs, add_generation_prompt=False, continue_final_message=True)
    ref, _ = render_jinja_template([msgs], chat_template=tpl, continue_final_message=True)
    assert ours == ref[0]
    assert not ours.endswith(("<|im_end|>\n", "</s>"))


def test_continue_final_message_refuses_a_template_that_drops_the_last_message():
    tpl = "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="continue_final_message"):
        render_chat(tpl, [*HI, {"role": "assistant", "content": "x"}], False, continue_final_message=True)
