"""A model file's chat template is untrusted: sandboxed, bounded in time and size (issue 17 item 9)."""

import time

import pytest

from streamattn.text import chat_template
from streamattn.text.chat_template import TemplateError, render

MSGS = [{"role": "user", "content": "Hi"}]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_plain_template_renders():
    assert render(CHATML, messages=MSGS, add_generation_prompt=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("source,match", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", r"range of 100000 items"),
    ("{% for i in range(10000) %}{% for j in range(10000) %}{{ j.real }}{% endfor %}{% endfor %}",
     r"longer than|output longer"),
    ("{% for i in range(10000) %}{% for j in range(10000) %}{% if j.real %}{% endif %}{% endfor %}{% endfor %}",
     r"rendering took longer than"),
    ("{{ 'a' * 10**9 }}", r"'\*' would build 1000000000 items"),
    ("{{ 7 ** 99999999 }}", r"exponent 99999999 is too large"),
    ("{% for i in range(5000) %}{{ 'x' * 1000 }}{% endfor %}", r"output longer than 1048576 characters"),
    ("{{ raise_exception('no system role') }}", r"no system role"),
    ("{% for %}", r"TemplateSyntaxError"),
    ("{{ messages.__class__.__mro__ }}", r"SecurityError|UndefinedError|Undefined"),
    ("{{ messages.append(1) }}", r"SecurityError"),
])
def test_hostile_templates_end_in_a_named_error_quickly(source, match):
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=rf"^chat template: .*({match})"):
        render(source, messages=MSGS, add_generation_prompt=True)
    assert time.monotonic() - t0 < chat_template.MAX_SECONDS + 5     # bounded, not hung


def test_apply_chat_uses_the_bounded_renderer():
    from streamattn.text.tokenizer import Tokenizer
    import dataclasses

    class FakeHF:
        def id_to_token(self, i):
            return "<s>"
    tok = Tokenizer.__new__(Tokenizer)
    fields = {f.name: None for f in dataclasses.fields(Tokenizer)}
    for k, v in fields.items():
        object.__setattr__(tok, k, v)
    object.__setattr__(tok, "hf", FakeHF())
    object.__setattr__(tok, "chat_template", "{{ 'a' * 10**9 }}")
    with pytest.raises(ValueError, match=r"chat template: '\*' would build"):
        tok.apply_chat(MSGS)
