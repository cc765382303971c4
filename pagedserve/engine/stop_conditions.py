"""When a stream stops after it has sampled a token."""

from __future__ import annotations

from pagedserve.core.sequence import Sequence, SequenceStatus


def stop_status(seq: Sequence, token: int, stop_string: str | None) -> SequenceStatus | None:
    """The finished status ``token`` puts the stream in, or None to go on. EOS, stop tokens and
    stop strings (``stop_string``: what the detokenizer matched) count only once min_tokens
    are out; the length limit always does. Sets ``seq.stop_reason`` for stop tokens and
    strings, as the OpenAI API reports them."""
    params = seq.params
    num_output = len(seq.output_token_ids)
    past_min = num_output >= params.min_tokens
    if past_min and not params.ignore_eos and token in seq.eos_token_ids:
        return SequenceStatus.FINISHED_STOPPED
    if past_min and token in params.stop_token_ids:
        seq.stop_reason = token
        return SequenceStatus.FINISHED_STOPPED
    if past_min and stop_string is not None:
        seq.stop_reason = stop_string
        return SequenceStatus.FINISHED_STOPPED
    if num_output >= seq.max_tokens:
        return SequenceStatus.FINISHED_LENGTH
    return None


def stops_on_token(seq: Sequence, token: int) -> bool:
    """Whether ``token`` (just appended) ends the stream as an EOS or stop token: then, as in
    vLLM, its text is not part of the output unless ``include_stop_str_in_output``."""
    params = seq.params
    if len(seq.output_token_ids) < params.min_tokens:
        return False
    return (not params.ignore_eos and token in seq.eos_token_ids) \
        or token in params.stop_token_ids
