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
