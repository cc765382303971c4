"""The KV offloading tiers on a random-weight Llama-3-shaped model: multi-turn conversations
whose prefixes have left a small device pool give the outputs of runs without the tier
(greedy and seeded), restored from the host tier and, by a second engine on the same folder,
from disk; damaged or foreign files are misses; swap preemption shares the host pool; the
pools stay exact after every step (``run_checked``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedserve import SamplingParams
from pagedserve.server.metrics import ServerMetrics
from tests.kv_checks import run_checked
from tests.tiny_models import make_llm, random_tokens

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
POOL = 16  # device blocks of 16 tokens: four conversations of 100-odd tokens do not fit


def _gib(llm_or_folder, num_blocks: int) -> float:
    """GiB holding ``num_blocks`` KV blocks of the tiny model (4 KiB each), plus a margin."""
    return (num_blocks * 4096 + 512) / 2**30


def _conversations(llm, params: SamplingParams, turns: int = 3, num: int = 4,
                   seed: int = 0) -> list[list[int]]:
    """Each turn of each conversation in turn, one request at a time: a turn's prompt is the
    previous prompt, its answer and a new user message."""
    rng = random.Random(seed)
    history = [random_tokens(rng, 90) for _ in range(num)]
    answers = []
    for _ in range(turns):
        for c in range(num):
            [out] = run_checked(llm.engine, [history[c]], [params])
            answers.append(out.outputs[0].token_ids)
            history[c] = history[c] + answers[-1] + random_tokens(rng, 10)
    return answers


@pytest.fixture(scope="module")
def references(llama3_folder):
    llm = make_llm(llama3_folder, num_blocks=POOL)
    return {name: _conversations(llm, p) for name, p in (("greedy", GREEDY), ("seeded", SEEDED))}


def test_a_tier_larger_than_the_host_is_refused_at_start(llama3_folder):
    """A PiB of host tier: one line naming the flag, not an allocation failure (pinned) or the
    out-of-memory killer once the tier fills (pageable)."""
    from pagedserve.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--kv-offloading-size 1048576(\.0)? GiB per rank.* is "
                                          r"available: lower them"):
        make_llm(llama3_folder, kv_offloading_size=2**20)


@pytest.mark.parametrize("name, params", [("greedy", GREEDY), ("seeded", SEEDED)])
def test_prefixes_that_left_the_device_come_back_from_the_host(llama3_folder, references,
                                                               name, params):
    llm = make_llm(llama3_folder, num_blocks=POOL, kv_offloading_size=_gib(llama3_folder, 200))
    assert _conversations(llm, params) == references[name]
    stats = llm.engine.stats()
    # Turns 2 and 3 find their whole history in the host tier (the device kept none of it).
    assert stats.offload_host_hits > 0 and stats.prefix_host_hit_tokens > 0
    assert stats.offload_bytes_to_device == 4096 * stats.offload_host_hits
    assert stats.prefix_hit_rate_of("host") > stats.prefix_hit_rate_of("device")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [dict(tensor_parallel_size=2),
                                   dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_two_ranks_restore_the_same_prefixes(llama3_folder, references, ranks):
    """Two ranks over gloo: each offloads and loads back its own part of the same blocks
    (TP: its heads' half, one KV head each; PP: its stage's layer; 2 KiB a block either way),
    in the same steps; the greedy tokens are one rank's without the tier."""
    llm = make_llm(llama3_folder, kv_cache_memory_bytes=POOL * 2048,
                   kv_offloading_size=_gib(llama3_folder, 200), **ranks)
    try:
        assert llm.engine.kv.num_blocks == POOL
        assert _conversations(llm, GREEDY) == references["greedy"]
        stats = llm.engine.stats()
        assert stats.offload_host_hits > 0
        assert stats.prefix_hit_rate_of("host") > stats.prefix_hit_rate_of("device")
    finally:
        llm.engine.shutdown()


def _disk_llm(folder, disk_dir, host_blocks: int = 4, **options):
    return make_llm(folder, num_blocks=POOL, kv_offloading_size=_gib(folder, host_blocks),
                    kv_offloading_disk=str(disk_dir),
                    kv_offloading_disk_size=_gib(folder, 400), **options)


def _flush(llm) -> None:
    llm.engine.executor.runner.kv_cache.disk.flush()


def test_a_second_engine_on_the_same_folder_starts_warm_from_disk(llama3_folder, references,
                                                                  tmp_path):
    first = _disk_llm(llama3_folder, tmp_path)
    assert _conversations(first, GREEDY) == references["greedy"]
    _flush(first)
    assert first.engine.stats().offload_bytes_to_disk > 0
    second = _disk_llm(llama3_folder, tmp_path)
    assert len(second.engine.kv.offload.disk) > 0
    assert _conversations(second, GREEDY) == references["greedy"]
    stats = second.engine.stats()
    # Its first turns had nothing on the device or the host: they came from disk.
    assert stats.offload_disk_hits > 0 and stats.offload_bytes_from_disk > 0
    assert stats.prefix_hit_rate_of("disk") > 0


def test_damaged_files_are_misses_and_never_data(llama3_folder, references, tmp_path, caplog):
    first = _disk_llm(llama3_folder, tmp_path)
    _conversations(first, GREEDY)
    _flush(first)
    damaged = set()
    for i, path in enumerate(sorted(tmp_path.glob("*/*.kvb"))):
        data = bytearray(path.read_bytes())
        if i % 2:
            data[-1] ^= 0x55  # corrupt
        else:
            del data[len(data) // 2:]  # truncated
        path.write_bytes(bytes(data))
        damaged.add(path)
    second = _disk_llm(llama3_folder, tmp_path)
    assert _conversations(second, GREEDY) == references["greedy"]
    assert second.engine.stats().offload_disk_misses > 0
    assert "corrupt" in caplog.text and "truncated" in caplog.text
    # The files it read and found damaged: all of them damaged ones.
    missed = {Path(r.getMessage().split(", ")[1].split(" is ")[0]) for r in caplog.records
              if "KV disk tier: miss" in r.getMessage()}
    assert missed and missed <= damaged


def test_a_disk_folder_the_engine_cannot_make_is_a_one_line_error(llama3_folder, tmp_path,
                                                                  monkeypatch):
    """A folder the check before loading passes but the engine cannot make (a read-only
    mount; root passes every permission check): one line naming the flag, no traceback."""
    from pagedserve.errors import ConfigError

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError, match=r"^--kv-offloading-disk .*: Permission denied"):
        _disk_llm(llama3_folder, tmp_path / "kv")


def test_a_disk_folder_under_the_home_folder_is_made_there(llama3_folder, tmp_path,
                                                           monkeypatch):
    """``~`` is expanded as for --model: it was a folder named ``~`` in the working directory
    (``--kv-offloading-disk=~/kv`` reaches the engine unexpanded by the shell)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    _disk_llm(llama3_folder, "~/kv")
    assert (tmp_path / "home" / "kv").is_dir() and not (tmp_path / "~").exists()


def test_another_model_never_reads_the_files(llama3_folder, tiny_model_folder, tmp_path):
    first = _disk_llm(llama3_folder, tmp_path)
    _conversations(first, GREEDY, turns=2)
    _flush(first)
    other = _disk_llm(tiny_model_folder("qwen2"), tmp_path)
    assert len(other.engine.kv.offload.disk) == 0


def test_the_same_checkpoint_quantized_at_load_never_reads_the_files(llama3_folder, tmp_path):
    """--quantization fp8 computes other keys and values from the same files: the float
    engine's blocks read back would have been served as its own."""
    first = _disk_llm(llama3_folder, tmp_path)
    _conversations(first, GREEDY, turns=2)
    _flush(first)
    assert len(_disk_llm(llama3_folder, tmp_path).engine.kv.offload.disk) > 0
    fp8 = _disk_llm(llama3_folder, tmp_path, quantization="fp8")
    assert len(fp8.engine.kv.offload.disk) == 0


def test_swap_preemption_shares_the_host_pool_with_the_tier(llama3_folder):
    rng = random.Random(7)
    prefix = random_tokens(rng, 70)
    prompts = [prefix + random_tokens(rng, 9) for _ in range(3)] + \
        [random_tokens(rng, 60) for _ in range(2)]
    params = SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    expected = make_llm(llama3_folder, block_size=4).generate(prompts, [params] * 5,
                                                              use_tqdm=False)
    llm = make_llm(llama3_folder, num_blocks=36, block_size=4, preemption_mode="swap",
                   swap_space=0.001, kv_offloading_size=_gib(llama3_folder, 4 * 40))
    got = run_checked(llm.engine, prompts, [params] * 5)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in expected]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and len(llm.engine.kv.offload.host) > 0


def test_metrics_split_the_prefix_cache_by_tier(llama3_folder):
    llm = make_llm(llama3_folder, num_blocks=POOL, kv_offloading_size=_gib(llama3_folder, 200))
    _conversations(llm, GREEDY, turns=2, num=3)
    body = ServerMetrics({"m": lambda: [llm.engine.stats()]}).render()[0].decode()
    stats = llm.engine.stats()
    assert (f'pagedserve:kv_offload_hits_total{{engine="0",model_name="m",tier="host"}} '
            f'{stats.offload_host_hits}.0') in body
    assert ('pagedserve:kv_offload_bytes_total{direction="to_device",engine="0",'
            'model_name="m"}') in body
    host_rate = stats.prefix_hit_rate_of("host")
    assert (f'pagedserve:prefix_cache_hit_rate_by_tier{{engine="0",model_name="m",tier="host"}} '
            f'{host_rate}') in body
    assert host_rate > 0
