"""Grammar compilation on a worker thread, cached by spec, so the step loop never waits for
it: a request's ``Future`` is polled each step and the request is scheduled once it is done.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.structured.spec import GrammarSpec, to_grammar

MAX_CACHED_GRAMMARS = 512


class GrammarCompilerPool:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int]) -> None:
        """``vocab_size`` is the logits' width: ids past the tokenizer's own vocabulary (a
        padded embedding) are never allowed."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        # One thread: the step loop keeps the other core. The cache is ours (bounded).
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        # Least recently asked first; a server fed ever new schemas keeps only the latest.
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()

    def get(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of ``spec`` (an xgrammar ``CompiledGrammar``), as a future
        shared by every request that asks for the same spec."""
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            return future
        future = self._cache[spec] = self._pool.submit(self._compile, spec)
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)  # requests holding its future keep it
        return future

    def _compile(self, spec: GrammarSpec):
        return self._compiler.compile_grammar(to_grammar(spec))
