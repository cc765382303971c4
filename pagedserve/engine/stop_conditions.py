"""When a stream stops after it has sampled a token."""

from __future__ import annotations

from pagedserve.core.request import Request, RequestStatus


def stop_status(request: Request, token: int, stop_string: str | None) -> RequestStatus | None:
    """The finished status ``token`` puts the stream in, or None to go on. EOS, stop tokens and
    stop strings (``stop_string``: what the detokenizer matched) count only once min_tokens
    are out; the length limit always does. Sets ``request.stop_reason`` for stop tokens and
    strings, as the OpenAI API reports them."""
    params = request.params
    past_min = request.num_output_tokens >= params.min_tokens
    if past_min and not params.ignore_eos and token in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if past_min and token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if past_min and stop_string is not None:
        request.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
