"""The graph-runner hook returns classes that match the GraphRunner protocol."""

from __future__ import annotations

import inspect

from pagedserve.platforms import resolve_platform
from pagedserve.platforms.interface import GraphRunner, Platform


def _methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(getattr(cls, name))
            for name in ("__init__", "capture", "can_run", "run")}


def test_cuda_graph_runner_matches_the_protocol():
    from pagedserve.platforms.cuda.graphs import CudaGraphRunner

    protocol, runner = _methods(GraphRunner), _methods(CudaGraphRunner)
    for name, signature in protocol.items():
        assert list(runner[name].parameters) == list(signature.parameters), name


def test_platforms_without_graphs_return_none():
    assert Platform.graph_runner() is None
    assert resolve_platform("cpu").graph_runner() is None

