"""``--chat-template``: a Jinja chat template used instead of the model's own, given inline or
as the path of a file holding one (as vLLM takes it). A base model, a GGUF file without
``tokenizer.chat_template`` or a template with a defect can then still serve chat requests.

Read once, when the config is built, so that a missing file or a syntax error fails in one
line before any model loads, and every process of the engine gets the same text.
"""

from __future__ import annotations

from typing import Any

from pagedserve.errors import ConfigError
from pagedserve.sampling_params import InvalidSamplingParam
from pagedserve.user_paths import expand_user

# What marks a value as a template rather than a path: Jinja's statement and expression tags.
_JINJA_TAGS = ("{%", "{{")


def read_chat_template(value: str, name: str = "--chat-template") -> str:
    """The template's text: the file's, where ``value`` names one, else ``value`` itself if
    it holds Jinja tags; checked for Jinja syntax. Errors name ``name`` (the flag, or
    ``LLM.chat``'s argument)."""
    path = expand_user(value)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # too long a name (an inline template), a NUL
        is_file = False
    if is_file:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{name}: cannot read {value}: {exc}") from exc
    elif _has_tags(value):
        text = value
    else:
        raise ConfigError(f"{name}: {value!r:.200} is neither a file nor a Jinja "
                          "template")
    if not _has_tags(text):  # it would render no message; and its text must read as inline
        raise ConfigError(f"{name}: {value} holds no Jinja tag "
                          f"({' or '.join(_JINJA_TAGS)})")
    _check_syntax(text, f"{name}: {value}" if is_file else f"{name}: the inline template")
    return text


def _has_tags(text: str) -> bool:
    return any(tag in text for tag in _JINJA_TAGS)


def _check_syntax(text: str, where: str) -> None:
    import jinja2

    # transformers renders with the loop-control extension ({% break %}, {% continue %}).
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        environment.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where} is not a valid Jinja template "
                          f"(line {exc.lineno}: {exc.message})") from exc


# apply_chat_template's own arguments, which chat_template_kwargs may not set.
_TEMPLATE_ARGUMENTS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"))


def render_options(add_generation_prompt: bool, continue_final_message: bool,
                   chat_template_kwargs: Any) -> dict[str, Any]:
    """``apply_chat_template``'s arguments for how a conversation ends (vLLM's names, for the
    offline ``LLM.chat`` and the chat endpoint alike): the assistant's turn opened, or the
    last message's text left open to be continued; and the template's own variables
    (Qwen3's ``enable_thinking``). ``InvalidSamplingParam`` names the argument at fault."""
    if continue_final_message and add_generation_prompt:
        raise InvalidSamplingParam(
            "continue_final_message", "continue_final_message and add_generation_prompt "
            "cannot both be true; set add_generation_prompt to false to continue the final "
            "message")
    variables = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(variables, dict) or not all(isinstance(k, str) for k in variables):
        raise TypeError("chat_template_kwargs must be a dict of variable names to values, got "
                        f"{chat_template_kwargs!r:.80}")
    taken = sorted(_TEMPLATE_ARGUMENTS.intersection(variables))
    if taken:
        raise InvalidSamplingParam(
            "chat_template_kwargs", f"chat_template_kwargs: {taken[0]} is an argument of the "
            "template's call, set by its own field, not a template variable")
    return dict(variables, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message)
