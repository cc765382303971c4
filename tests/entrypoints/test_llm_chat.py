"""``LLM.chat``'s arguments as vLLM names and orders them: ``lora_request`` fourth,
``continue_final_message``, a per-call ``chat_template`` and ``chat_template_kwargs``. Each
prompt is checked against jinja2's own rendering of the messages, token for token."""

from __future__ import annotations

import inspect

import jinja2
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.lora.request import LoRARequest
from tests.kv_checks import assert_pools_full
from tests.tiny_models import make_llm

TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def llm(llama3_folder):
    return make_llm(llama3_folder, chat_template=TEMPLATE)


def _prompt_ids(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_the_fourth_argument_is_the_lora_request_as_in_vllm(llm):
    """vLLM's ``chat(messages, sampling_params, use_tqdm, lora_request, ...)``: a LoRA request
    passed fourth was read as add_generation_prompt and the chat ran without it."""
    adapter = LoRARequest("sql", 1, "/no/such/adapter")
    with pytest.raises(ValueError, match="LoRA adapter sql: LoRA is off"):
        llm.chat(MESSAGES, GREEDY, False, adapter)
    # What follows lora_request is keyword-only, so no later vLLM argument binds to another.
    keyword_only = {name for name, p in inspect.signature(LLM.chat).parameters.items()
                    if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keyword_only >= {"add_generation_prompt", "tools"}
    assert_pools_full(llm.engine.kv)


def test_continue_final_message_extends_the_assistants_turn(llm):
    """The prompt ends with the final message's text, with nothing the template writes after
    it (vLLM's argument, which transformers implements)."""
    messages = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    rendered = jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=False)
    assert rendered.endswith("[ASSISTANT] The answer is\n")
    assert out.prompt_token_ids == _prompt_ids(llm, rendered.removesuffix("\n"))


def test_continue_final_message_with_a_generation_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt "
                                         "cannot both be true"):
        llm.chat(MESSAGES, GREEDY, use_tqdm=False, continue_final_message=True)
    assert_pools_full(llm.engine.kv)


OTHER_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}"
                  "{% if enable_thinking %}<think>{% endif %}")


def test_a_chat_template_given_to_the_call_replaces_the_engines(llm):
    out = llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=OTHER_TEMPLATE)[0]
    rendered = jinja2.Template(OTHER_TEMPLATE).render(messages=MESSAGES,
                                                      add_generation_prompt=True)
    assert rendered == "<user>hello<assistant>"
    assert out.prompt_token_ids == _prompt_ids(llm, rendered)


def test_chat_template_kwargs_reach_the_template(llm):
    """vLLM's way to set a template's own switches (Qwen3's ``enable_thinking``)."""
    out = llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=OTHER_TEMPLATE,
                   chat_template_kwargs={"enable_thinking": True})[0]
    assert out.prompt_token_ids == _prompt_ids(llm, "<user>hello<assistant><think>")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(chat_template="{% for m in messages %}"), ValueError,
     r"^chat_template: the inline template is not a valid Jinja template \(line 1"),
    (dict(chat_template=3), TypeError, "chat_template must be"),
    (dict(chat_template_kwargs=["enable_thinking"]), TypeError,
     "chat_template_kwargs must be a dict"),
    (dict(chat_template_kwargs={"add_generation_prompt": False}), ValueError,
     "chat_template_kwargs: add_generation_prompt is an argument of the template.s call"),
], ids=["syntax", "not-text", "kwargs-list", "kwargs-own-argument"])
def test_a_bad_template_or_template_kwargs_is_named(llm, kwargs, error, message):
    with pytest.raises(error, match=message):
        llm.chat(MESSAGES, GREEDY, use_tqdm=False, **kwargs)
    assert_pools_full(llm.engine.kv)
    assert llm.chat(MESSAGES, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
