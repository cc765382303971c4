"""The platform interface's contract: graph runners match the GraphRunner protocol, every
platform defines what the interface leaves open, and every member of the interface is used
(each capability flag by the engine, outside platforms/)."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

import pytest

from pagedserve import platforms
from pagedserve.platforms import resolve_platform
from pagedserve.platforms.interface import GraphRunner, Platform


def _protocol_parameters(cls: type) -> dict[str, list[str]]:
    """Each method's parameter names as written in the class body (read from its source:
    Python 3.10's typing.Protocol replaces a protocol's own ``__init__`` at run time)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {node.name: [a.arg for a in node.args.args]
            for node in tree.body[0].body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("module,name", [("cuda", "CudaGraphRunner"), ("hpu", "HpuGraphRunner")])
def test_graph_runners_match_the_protocol(module, name):
    import importlib

    runner_cls = getattr(importlib.import_module(f"pagedserve.platforms.{module}.graphs"), name)
    protocol = _protocol_parameters(GraphRunner)
    assert sorted(protocol) == ["__init__", "can_run", "capture", "run"]
    for method, parameters in protocol.items():
        assert list(inspect.signature(getattr(runner_cls, method)).parameters) == parameters, \
            method


def test_platforms_without_graphs_return_none():
    assert Platform.graph_runner() is None
    assert resolve_platform("cpu").graph_runner() is None


# ---- the interface's contract ---------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[2] / "pagedserve"
# Members every platform must define: ClassVars without a default and hooks that raise.
REQUIRED = ("name", "device_type", "check_available", "memory_info")
# Identity, not capability: device_type is read by Platform.device().
IDENTITY = ("name", "device_type")


def _platform_classes() -> list[type[Platform]]:
    return [platforms._load(name) for name in platforms.DEVICE_NAMES if name != "auto"]


def _members() -> list[str]:
    names = [n for n, v in vars(Platform).items() if isinstance(v, classmethod)]
    return names + list(Platform.__annotations__)


def _sources(outside_platforms: bool) -> str:
    files = [p for p in PACKAGE.rglob("*.py")
             if not (outside_platforms and "platforms" in p.relative_to(PACKAGE).parts)]
    return "\n".join(f.read_text() for f in files)


def test_required_members_are_exactly_the_unimplemented_ones():
    unimplemented = [n for n in _members() if n in Platform.__annotations__
                     and not hasattr(Platform, n)]
    for name, member in vars(Platform).items():
        if isinstance(member, classmethod):
            source = inspect.getsource(member.__func__)
            if "raise NotImplementedError" in source:
                unimplemented.append(name)
    assert sorted(unimplemented) == sorted(REQUIRED)


@pytest.mark.parametrize("platform", _platform_classes(), ids=lambda p: p.name)
def test_every_platform_implements_the_interface(platform):
    for member in REQUIRED:
        ours, default = getattr(platform, member, None), getattr(Platform, member, None)
        assert ours is not None and getattr(ours, "__func__", ours) is not getattr(
            default, "__func__", default), f"{platform.name} leaves {member} to Platform"
    assert platform.name in platforms.DEVICE_NAMES
    for name, kind in Platform.__annotations__.items():
        value = getattr(platform, name)
        expected = {"ClassVar[str]": str, "ClassVar[bool]": bool, "ClassVar[int]": int}.get(kind)
        assert expected is None or isinstance(value, expected), (platform.name, name)


def test_every_capability_flag_is_read_outside_platforms():
    engine_code = _sources(outside_platforms=True)
    unread = [flag for flag in Platform.__annotations__ if flag not in IDENTITY
              and not re.search(rf"\.{flag}\b", engine_code)]
    assert not unread, f"flags nothing outside platforms/ reads: {unread}"


def test_every_interface_member_is_used():
    code = re.sub(r"def \w+\(", "", _sources(outside_platforms=False))
    unused = [m for m in _members() if not re.search(rf"\.{m}\b", code)]
    assert not unused, f"interface members nothing calls or reads: {unused}"
