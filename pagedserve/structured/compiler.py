"""Grammar compilation on a worker thread, cached by spec, so the step loop never waits for
it: a request's ``Future`` is polled each step and the request is scheduled once it is done.
xgrammar releases the GIL while it compiles, so the thread costs the loop little."""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.structured.spec import GrammarSpec, to_grammar


class GrammarCompilerPool:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int],
                 max_workers: int = 1) -> None:
        """``vocab_size`` is the logits' width: ids past the tokenizer's own vocabulary (a
        padded embedding) are never allowed."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: dict[GrammarSpec, Future] = {}

    def get(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of ``spec`` (an xgrammar ``CompiledGrammar``), as a future
        shared by every request that asks for the same spec."""
        future = self._cache.get(spec)
        if future is None:
            future = self._cache[spec] = self._pool.submit(self._compile, spec)
        return future

    def _compile(self, spec: GrammarSpec):
        return self._compiler.compile_grammar(to_grammar(spec))
