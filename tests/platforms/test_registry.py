import pytest
import torch

from pagedserve.platforms import resolve_platform
from pagedserve.platforms.interface import PlatformUnavailable


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
