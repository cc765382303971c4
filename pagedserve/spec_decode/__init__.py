"""Speculative decoding's drafters: the interface (``proposer``) and the n-gram / prompt-lookup
proposer (``ngram``). What they propose is verified by ``sample/rejection.py``."""
