"""Environment variables with bad values: one line naming the variable, never a traceback
from deep in the engine's start-up."""

from __future__ import annotations

import pytest

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.errors import ConfigError


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "0", "-1", "1.5"])
def test_a_bad_cpu_kv_fraction_names_the_variable(monkeypatch, value):
    """'abc' and 'nan' failed in the CPU platform's cache sizing (ValueError tracebacks); a
    share above 1 would size a pool past the free memory."""
    monkeypatch.setenv("PAGEDSERVE_CPU_KV_FRACTION", value)
    with pytest.raises(ConfigError, match=f"^PAGEDSERVE_CPU_KV_FRACTION must be a share in "
                                          f"\\(0, 1\\], got '{value}'$"):
        envs.cpu_kv_cache_fraction()


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan"])
def test_a_bad_dist_timeout_fails_before_any_rank_starts(monkeypatch, value):
    """'abc' failed in each rank; -5 made every rank's connection time out at once."""
    from pagedserve.executor.executor import Executor

    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", value)
    with pytest.raises(ConfigError, match="^PAGEDSERVE_DIST_TIMEOUT_S must be a number of "
                                          "seconds above 0"):
        Executor(EngineConfig(device="cpu", tensor_parallel_size=2), (2,))


def test_good_values_and_defaults(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_CPU_KV_FRACTION", raising=False)
    monkeypatch.setenv("PAGEDSERVE_DIST_TIMEOUT_S", "2.5")
    assert (envs.cpu_kv_cache_fraction(), envs.dist_timeout_s()) == (0.25, 2.5)
    monkeypatch.setenv("PAGEDSERVE_LOG_LEVEL", "debug")
    assert envs.log_level() == "DEBUG"


def test_an_unknown_log_level_is_named_and_info_is_used(monkeypatch, capsys):
    """The logger reads it when the first module is imported: logging's ValueError was a
    traceback before the command line could report anything."""
    monkeypatch.setenv("PAGEDSERVE_LOG_LEVEL", "loud")
    assert envs.log_level() == "INFO"
    assert "PAGEDSERVE_LOG_LEVEL='LOUD' is none of DEBUG, INFO" in capsys.readouterr().err


def test_pdl_modes_and_bad_gpu_switches_at_the_cuda_platforms_start(monkeypatch):
    """A bad PAGEDSERVE_PDL or PAGEDSERVE_W4A16_WGMMA is named when the CUDA platform is
    chosen, not at the first kernel launch inside the engine's warm-up."""
    from pagedserve.platforms.cuda.platform import CudaPlatform

    monkeypatch.delenv("PAGEDSERVE_PDL", raising=False)
    assert envs.pdl() == "auto"
    monkeypatch.delenv("PAGEDSERVE_W4A16_WGMMA", raising=False)
    assert envs.w4a16_wgmma()  # on since its H200 tests passed (2026-12-05)
    monkeypatch.setenv("PAGEDSERVE_W4A16_WGMMA", "0")
    assert not envs.w4a16_wgmma()
    monkeypatch.delenv("PAGEDSERVE_W4A16_WGMMA")
    for value, mode in (("1", "1"), (" 0 ", "0"), ("AUTO", "auto"), ("", "auto")):
        monkeypatch.setenv("PAGEDSERVE_PDL", value)
        assert envs.pdl() == mode
    pytest.importorskip("triton")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.version.hip", None)
    CudaPlatform.check_available()
    monkeypatch.setenv("PAGEDSERVE_PDL", "yes")
    with pytest.raises(ConfigError, match="^PAGEDSERVE_PDL must be auto, 0 or 1, got 'yes'$"):
        CudaPlatform.check_available()
    monkeypatch.setenv("PAGEDSERVE_PDL", "auto")
    monkeypatch.setenv("PAGEDSERVE_W4A16_WGMMA", "on")
    with pytest.raises(ConfigError, match="^PAGEDSERVE_W4A16_WGMMA must be 0 or 1, got 'on'$"):
        CudaPlatform.check_available()


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), (" TRUE ", True),
                                           ("0", False), ("", False)])
def test_vllms_responses_store_variable_turns_the_store_on(monkeypatch, value, on):
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", value)
    assert envs.responses_store() is on
