"""``--chat-template``: inline or from a file, checked when the config is built (a missing
file, a syntax error, a text without tags fail in one line naming the flag), carried as text to
every process, and used by ``LLM.chat`` in place of the model's own: the prompt is jinja2's
rendering of the messages, token for token."""

from __future__ import annotations

import dataclasses

import jinja2
import pytest

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.errors import ConfigError
from pagedserve.models.chat_template import read_chat_template
from tests.tiny_models import make_llm

TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_inline_and_file_give_the_same_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert read_chat_template(TEMPLATE) == read_chat_template(str(path)) == TEMPLATE
    config = EngineConfig(model="m", chat_template=str(path))
    assert config.chat_template == TEMPLATE
    # The config sent to the engine core is built again from the text: it stays the text.
    assert dataclasses.replace(config, model="other").chat_template == TEMPLATE


@pytest.mark.parametrize("value, message", [
    ("/no/such/template.jinja", "is neither a file nor a Jinja template"),
    ("~no-such-user-here/t.jinja", "is neither a file nor a Jinja template"),
    ("{% for m in messages %}{{ m['content'] }}", r"the inline template is not a valid Jinja "
                                                  r"template \(line 1: .*endfor"),
])
def test_bad_templates_fail_naming_the_flag(value, message):
    with pytest.raises(ConfigError, match="^--chat-template: .*" + message):
        EngineConfig(model="m", chat_template=value)


def test_a_file_that_is_no_template_fails(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("just words", encoding="utf-8")
    with pytest.raises(ConfigError, match="holds no Jinja tag"):
        read_chat_template(str(plain))
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{{ messages[0]['content'] }\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"{broken} is not a valid Jinja template \\(line 2"):
        read_chat_template(str(broken))
    latin = tmp_path / "latin1.jinja"
    latin.write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot read"):
        read_chat_template(str(latin))


def test_llm_chat_renders_with_the_given_template(llama3_folder):
    """The tiny model has no template of its own: without the flag chat is refused, with it
    the prompt is exactly jinja2's rendering, tokenized without added special tokens."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="has no chat template"):
        make_llm(llama3_folder).chat(MESSAGES, params, use_tqdm=False)
    llm = make_llm(llama3_folder, chat_template=TEMPLATE)
    out = llm.chat(MESSAGES, params, use_tqdm=False)[0]
    text = jinja2.Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    assert text.startswith("[SYSTEM] be brief\n[USER] hello\n[ASSISTANT]")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
