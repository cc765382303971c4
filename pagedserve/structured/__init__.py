"""Constrained decoding: what a request's output must match (``spec``), its grammar compiled
off the step loop (``compiler``), and each sequence's position in it (``grammar_state``),
which yields the allowed-token bitmask the sampler applies. xgrammar is imported only here
and only once a request asks for structured output."""
