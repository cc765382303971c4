"""``LLM.chat(..., tools=)``: the tools, an assistant's tool calls and the tool's result reach
the chat template, which writes the prompt the model sees."""

from __future__ import annotations

import json
import shutil

from pagedserve import SamplingParams
from tests.tiny_models import make_llm

# A template in the style of the Hermes/Qwen ones: tools in the system turn, calls as
# <tool_call> blocks, results as tool turns.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    "</tools>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_passes_tools_and_tool_turns_to_the_template(llama3_folder, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    shutil.copytree(llama3_folder, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.save_pretrained(folder)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    llm = make_llm(folder)
    out = llm.chat(messages, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False,
                   tools=tools)[0]
    expected = ("<tools>get_weather;</tools>\n<|user|>Weather in Paris?\n<|assistant|>"
                f"<tool_call>get_weather{json.dumps({'city': 'Paris'})}</tool_call>\n"
                "<|tool|>21 C\n<|assistant|>")
    assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
