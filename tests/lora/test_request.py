"""``LoRARequest`` refuses fields of the wrong type by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.lora.request import LoRARequest


@pytest.mark.parametrize(("args", "message"), [
    (("sql", "1", "/a"), "lora_int_id must be an integer, got '1'"),
    (("sql", 1.0, "/a"), "lora_int_id must be an integer, got 1.0"),
    (("sql", True, "/a"), "lora_int_id must be an integer, got True"),
    ((None, 1, "/a"), "lora_name must be a string, got None"),
    (("sql", 1, None), "lora_path must be a string, got None"),
])
def test_a_field_of_the_wrong_type_is_a_type_error_naming_it(args, message):
    """'1' as the id failed its range check with a TypeError naming nothing; 1.0 and True
    were taken as ids, None as a path read as the folder 'None'."""
    with pytest.raises(TypeError, match=f"^LoRARequest: {message}"):
        LoRARequest(*args)


def test_a_path_object_is_a_path():
    assert LoRARequest("sql", 1, Path("/a")).lora_int_id == 1
    with pytest.raises(ValueError, match="lora_int_id must be at least 1"):
        LoRARequest("sql", 0, "/a")


def test_an_id_past_int64_is_refused():
    """The core's messages carry ids as 64-bit integers: 2**64 was taken, then every request
    on the adapter (and its unload) failed to reach the core with an OverflowError."""
    assert LoRARequest("sql", 2**63 - 1, "/a").lora_int_id == 2**63 - 1
    with pytest.raises(ValueError, match=r"lora_int_id must be at most 2\*\*63 - 1"):
        LoRARequest("sql", 2**64, "/a")
