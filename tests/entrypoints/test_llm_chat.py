"""``LLM.chat``'s arguments as vLLM names and orders them: ``lora_request`` fourth,
``continue_final_message``, a per-call ``chat_template`` and ``chat_template_kwargs``. Each
prompt is checked against jinja2's own rendering of the messages, token for token."""

from __future__ import annotations

import inspect

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
