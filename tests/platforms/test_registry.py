from __future__ import annotations

import logging

import pytest
import torch

from pagedserve import logger as package_logger
from pagedserve import platforms
from pagedserve.platforms import resolve_platform
from pagedserve.platforms.interface import Platform, PlatformUnavailable


def test_cpu_always_resolves():
    assert resolve_platform("cpu").name == "cpu"


def test_unknown_device_lists_choices():
    with pytest.raises(PlatformUnavailable, match="auto, cuda, rocm, hpu, cpu"):
        resolve_platform("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("name", ["cuda", "rocm", "hpu"])
def test_missing_device_is_one_line(name):
    with pytest.raises(PlatformUnavailable) as err:
        resolve_platform(name)
    message = str(err.value)
    assert message and "\n" not in message


def test_auto_falls_back_to_cpu_without_accelerators():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_platform("auto").name == "cpu"


def test_cli_reports_missing_device_in_one_line(capsys):
    from pagedserve.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagedserve: error:") and "\n" not in err


def test_capture_sizes_cover_every_batch():
    from pagedserve.platforms.cuda.graphs import capture_sizes

    sizes = capture_sizes(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100
    assert all(any(s >= n for s in sizes) for n in range(1, 101))


def _fake_platform(name: str, reason: str | None) -> type[Platform]:
    """A platform named ``name`` that is usable when ``reason`` is None."""

    def check_available(cls) -> None:
        if reason is not None:
            raise PlatformUnavailable(reason)

    return type(f"Fake{name}", (Platform,), {"name": name, "device_type": "cpu",
                                             "check_available": classmethod(check_available)})


def _auto_log(monkeypatch, caplog, reasons: dict[str, str | None]) -> tuple[str, list[str]]:
    """Resolve ``auto`` over fake platforms (twice: the choice is said once a process); the
    chosen name and the log lines it wrote."""
    fakes = {name: _fake_platform(name, reason) for name, reason in reasons.items()}
    monkeypatch.setattr(platforms, "_load", lambda name: fakes[name])
    monkeypatch.setattr(package_logger, "_SAID", set())  # as in a fresh process
    logger = logging.getLogger("pagedserve")
    logger.addHandler(caplog.handler)  # the package logger does not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger="pagedserve"):
            chosen = resolve_platform("auto").name
            assert resolve_platform("auto").name == chosen
    finally:
        logger.removeHandler(caplog.handler)
    return chosen, [r.getMessage() for r in caplog.records]


def test_auto_logs_choice_and_each_skip_reason(monkeypatch, caplog):
    reasons = {"cuda": "no CUDA device here", "rocm": "no HIP build", "hpu": "no habana",
               "cpu": None}
    chosen, lines = _auto_log(monkeypatch, caplog, reasons)
    assert chosen == "cpu" and len(lines) == 1
    assert lines[0] == ("--device auto chose cpu; skipped cuda: no CUDA device here; "
                        "rocm: no HIP build; hpu: no habana")


def test_auto_stops_at_first_usable_platform(monkeypatch, caplog):
    reasons = {"cuda": "no CUDA device here", "rocm": None, "hpu": "never asked", "cpu": None}
    chosen, lines = _auto_log(monkeypatch, caplog, reasons)
    assert chosen == "rocm"
    assert lines == ["--device auto chose rocm; skipped cuda: no CUDA device here"]


def test_auto_on_cuda_skips_nothing(monkeypatch, caplog):
    reasons = dict.fromkeys(("cuda", "rocm", "hpu", "cpu"))
    assert _auto_log(monkeypatch, caplog, reasons) == ("cuda", ["--device auto chose cuda"])


def test_auto_without_any_platform_lists_every_reason(monkeypatch):
    fakes = {name: _fake_platform(name, f"no {name}") for name in ("cuda", "rocm", "hpu", "cpu")}
    monkeypatch.setattr(platforms, "_load", lambda name: fakes[name])
    with pytest.raises(PlatformUnavailable, match="cuda: no cuda; rocm: no rocm; hpu: no hpu; "
                                                  "cpu: no cpu"):
        resolve_platform("auto")
