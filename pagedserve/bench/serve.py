"""``pagedserve bench serve``: load a running server through its streaming completions API.

N clients (``--concurrency``) each send their next request as soon as the last one finished,
until ``--num-prompts`` are done. Prompts are random token ids from ``random_workload`` with
``ignore_eos``, so output lengths are exact and the same ``--seed`` gives the same work as
``pagedserve bench throughput``. ``--compare-offline`` then runs that work through the offline
engine in this process (at most ``--concurrency`` sequences at once, like the clients) to show
what HTTP costs. Both share the machine with the client, and maybe with other jobs: with
``--repeat K`` they alternate for K rounds (fresh prompts each round) and the best round of
each is reported.

Per request: TTFT (send to first streamed token), TPOT ((end - first token) / (tokens - 1)),
inter-token latency (gaps between chunks; a chunk may carry several tokens when the server's
handler fell behind the engine) and end-to-end latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import dataclass, field

from pagedserve.arg_types import MinMax, positive
from pagedserve.bench.common import WorkItem, print_table, random_workload, write_result
from pagedserve.errors import ConfigError

PERCENTILES = (50, 90, 99)


def add_args(parser: argparse.ArgumentParser) -> None:
    from pagedserve.engine_args import add_engine_args

    add_engine_args(parser)  # --model picks the tokenizer; the rest is for --compare-offline
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=positive(int), default=8)
    parser.add_argument("--num-prompts", type=positive(int), default=64)
    parser.add_argument("--input-len", type=positive(int), action=MinMax, default=(32, 256))
    parser.add_argument("--output-len", type=positive(int), action=MinMax, default=(16, 64))
    parser.add_argument("--num-clients", type=positive(int), default=1,
                        help="client processes sharing --concurrency (one process parsing "
                             "tens of thousands of events a second is a bottleneck itself)")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="plain JSON responses instead of server-sent events (TTFT and "
                             "inter-token latencies are then not measured)")
    parser.add_argument("--compare-offline", action="store_true",
                        help="also run the same requests through the offline engine here")
    parser.add_argument("--repeat", type=positive(int), default=1,
                        help="rounds (new prompts each; HTTP and offline alternate); the best "
                             "round of each counts")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None  # streams only
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def _one(client, url: str, model: str, item: WorkItem, stream: bool) -> RequestResult:
    body = {"model": model, "prompt": item.prompt_token_ids, "max_tokens": item.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    import httpx

    start = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        if stream:
            await _read_events(client, url, body, start, result)
        else:
            response = await client.post(url, json=body)
            if response.status_code == 200:
                result.output_tokens = response.json()["usage"]["completion_tokens"]
            else:
                result.error = response.text[:200]
    except httpx.HTTPError as exc:  # counted as failed, with the reason, not fatal
        result.error = f"{type(exc).__name__} after {time.perf_counter() - start:.1f}s: {exc}"
    if result.error:
        return result
    result.e2e = time.perf_counter() - start
    result.ok = result.output_tokens == item.output_len
    result.error = "" if result.ok else f"got {result.output_tokens} of {item.output_len}"
    return result


async def _read_events(client, url: str, body: dict, start: float,
                       result: RequestResult) -> None:
    last = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")[:200]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result.error = event["error"]["message"]
                return
            now = time.perf_counter()
            if event.get("choices"):
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]


def run_load(base_url: str, api_key: str | None, work: list[WorkItem], concurrency: int,
             stream: bool = True, num_clients: int = 1,
             ) -> tuple[list[RequestResult], float, str, dict[str, float]]:
    """All requests through ``concurrency`` closed-loop clients, spread over ``num_clients``
    client processes (one Python process parsing every event can be the bottleneck, not the
    server); returns results, seconds, the served model's name, and the CPU seconds the
    server's processes and the clients used."""
    import multiprocessing

    model, server_cpu = asyncio.run(_prepare(base_url, api_key, work, stream))
    ctx = multiprocessing.get_context("spawn")
    start_line, results_queue = ctx.Barrier(num_clients + 1), ctx.Queue()
    clients = [ctx.Process(target=_client_process, args=(
        base_url, api_key, model, work[i::num_clients],
        concurrency // num_clients + (i < concurrency % num_clients), stream, start_line,
        results_queue)) for i in range(num_clients)]
    for process in clients:
        process.start()
    start_line.wait()  # every client is connected-ready: the clock starts for all at once
    runs = [results_queue.get() for _ in clients]
    for process in clients:
        process.join()
    seconds = max(r[2] for r in runs) - min(r[1] for r in runs)
    after = asyncio.run(_read_server_cpu(base_url, api_key))
    cpu = {f"{name}_cpu_s": a - b for name, b, a in zip(("api_server", "engine_core"),
                                                         server_cpu, after)}
    cpu["client_cpu_s"] = sum(r[3] for r in runs)
    return [result for r in runs for result in r[0]], seconds, model, cpu


async def _prepare(base_url: str, api_key: str | None, work: list[WorkItem],
                   stream: bool) -> tuple[str, tuple[float, float]]:
    """The served model's name, after one short request (so nothing one-off lands in the
    timings), and the server's CPU seconds so far."""
    import httpx

    async with _http_client(api_key, 4) as client:
        try:
            models = (await client.get(f"{base_url}/v1/models")).raise_for_status().json()
        except httpx.HTTPError as exc:  # no server there, or not one that lets us in
            raise ConfigError(f"--base-url {base_url}: cannot list the served models "
                              f"({type(exc).__name__}: {exc})") from None
        model = models["data"][0]["id"]
        await _one(client, f"{base_url}/v1/completions", model, _warm_up_item(work), stream)
        return model, await _server_cpu(client, base_url)


async def _read_server_cpu(base_url: str, api_key: str | None) -> tuple[float, float]:
    async with _http_client(api_key, 1) as client:
        return await _server_cpu(client, base_url)


def _http_client(api_key: str | None, concurrency: int):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(timeout=None, headers=headers, limits=limits)


def _client_process(base_url: str, api_key: str | None, model: str, work: list[WorkItem],
                    concurrency: int, stream: bool, start_line, results_queue) -> None:
    results_queue.put(asyncio.run(
        _client_run(base_url, api_key, model, work, concurrency, stream, start_line)))


async def _client_run(base_url: str, api_key: str | None, model: str, work: list[WorkItem],
                      concurrency: int, stream: bool, start_line,
                      ) -> tuple[list[RequestResult], float, float, float]:
    """One client process: (results, start and end wall-clock times, CPU seconds)."""
    queue = list(reversed(work))
    results: list[RequestResult] = []
    url = f"{base_url}/v1/completions"
    async with _http_client(api_key, concurrency) as client:

        async def client_loop() -> None:
            while queue:
                results.append(await _one(client, url, model, queue.pop(), stream))

        await asyncio.to_thread(start_line.wait)
        cpu, start = time.process_time(), time.time()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        return results, start, time.time(), time.process_time() - cpu


async def _server_cpu(client, base_url: str) -> tuple[float, float]:
    """CPU seconds the API server process and the engine-core processes (all models') have
    used: on a shared machine, CPU time per token says more about HTTP's cost than wall time
    does."""
    text = (await client.get(f"{base_url}/metrics")).text
    values = []
    for name in ("process_cpu_seconds_total", "pagedserve:engine_core_cpu_seconds_total"):
        # Unlabelled (the server process's), or one sample per model (the engine cores').
        samples = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        values.append(sum(map(float, samples)) if samples else float("nan"))
    return values[0], values[1]


def summarize(results: list[RequestResult], seconds: float, work: list[WorkItem],
              cpu: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(len(w.prompt_token_ids) for w in work)
    cpu_s = sum(cpu.values())
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "seconds": seconds,
        "request_throughput": len(ok) / seconds, "output_tok_s": out_tokens / seconds,
        "total_tok_s": (in_tokens + out_tokens) / seconds, "output_tokens": out_tokens,
        **cpu, "cpu_ms_per_token": cpu_s * 1000 / max(out_tokens, 1),
    }
    series = {
        "ttft_ms": [r.ttft for r in ok if r.ttft is not None],
        "tpot_ms": [r.tpot for r in ok if r.tpot is not None],
        "itl_ms": [gap for r in ok for gap in r.itl],
        "e2e_ms": [r.e2e for r in ok],
    }
    for name, values in series.items():
        summary[name] = _stats([v * 1000 for v in values])
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _stats(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    stats = {"mean": sum(ordered) / len(ordered)}
    for p in PERCENTILES:  # nearest-rank percentile
        stats[f"p{p}"] = ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))]
    return stats


def offline_llm(args: argparse.Namespace):
    import dataclasses

    from pagedserve.engine_args import config_from_args
    from pagedserve.entrypoints.llm import LLM

    config = config_from_args(args)
    # As many sequences in flight as the HTTP clients keep, so only the HTTP path differs.
    return LLM.from_config(dataclasses.replace(
        config, max_num_seqs=min(config.max_num_seqs, args.concurrency)))


def run_offline(llm, work: list[WorkItem]) -> dict:
    from pagedserve.bench.throughput import run_engine

    run_engine(llm, [_warm_up_item(work)])  # as for the server
    cpu = time.process_time()
    result = run_engine(llm, work)
    result["cpu_s"] = time.process_time() - cpu
    result["cpu_ms_per_token"] = result["cpu_s"] * 1000 / result["output_tokens"]
    return result


def _warm_up_item(work: list[WorkItem]) -> WorkItem:
    # Shorter than a KV block, so the timed requests get no prefix-cache hit from it.
    return WorkItem(work[0].prompt_token_ids[:8], 2)


def _workload(args: argparse.Namespace, seed: int) -> list[WorkItem]:
    from pagedserve.models import loader

    source = loader.resolve_model(args.model, args.load_format != "dummy",
                                  revision=args.revision, gguf_file=args.gguf_file)
    vocab_size = loader.load_arch_config(source).vocab_size
    folder = loader.tokenizer_folder(source, args.tokenizer, args.tokenizer_revision)
    avoid = set(loader.load_tokenizer(folder).all_special_ids)
    return random_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len),
                           vocab_size, avoid, seed=seed)


def main(args: argparse.Namespace) -> None:
    if args.num_clients > args.concurrency:  # a client of no connections would drop its work
        raise ConfigError(f"--num-clients ({args.num_clients}) must not exceed --concurrency "
                          f"({args.concurrency})")
    http_runs, offline_runs, llm, model = [], [], None, ""
    for i in range(args.repeat):
        # A new seed each round, so no round gets prefix-cache hits from the one before.
        work = _workload(args, args.seed + i)
        results, seconds, model, cpu = run_load(
            args.base_url.rstrip("/"), args.api_key, work, args.concurrency, args.stream,
            args.num_clients)
        http_runs.append(summarize(results, seconds, work, cpu))
        if args.compare_offline:
            llm = llm or offline_llm(args)
            offline_runs.append(run_offline(llm, work))
    payload = {"model": model, "base_url": args.base_url, "concurrency": args.concurrency,
               "stream": args.stream, "num_clients": args.num_clients,
               "num_prompts": args.num_prompts, "input_len": list(args.input_len),
               "output_len": list(args.output_len), "seed": args.seed,
               **_report(args, model, http_runs, offline_runs)}
    write_result(f"serve_c{args.concurrency}{'' if args.stream else '_nostream'}", payload,
                 args.out)


def _report(args: argparse.Namespace, model: str, http_runs: list[dict],
            offline_runs: list[dict]) -> dict:
    """Print the tables; return the results part of the JSON."""
    # On a shared machine, the best round is the one least disturbed by other processes.
    http = max(http_runs, key=lambda r: r["output_tok_s"])
    print_table(f"serve: {model} at {args.base_url}, concurrency {args.concurrency}, "
                f"{args.num_prompts} prompts, inputs {args.input_len}, outputs "
                f"{args.output_len}", [{"round": i, **r} for i, r in enumerate(http_runs)],
                ["round", "completed", "failed", "seconds", "request_throughput",
                 "output_tok_s", "total_tok_s", "api_server_cpu_s", "engine_core_cpu_s",
                 "client_cpu_s",
                 "cpu_ms_per_token"])
    print_table("latencies of the best round (ms)",
                [{"metric": k, **http[k]} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")],
                ["metric", "mean", *(f"p{p}" for p in PERCENTILES)])
    result = {"http": http, "http_rounds": http_runs}
    if offline_runs:
        offline = max(offline_runs, key=lambda r: r["output_tok_s"])
        ratio = http["output_tok_s"] / offline["output_tok_s"]
        print_table("offline engine, same requests",
                    [{"round": i, **r} for i, r in enumerate(offline_runs)],
                    ["round", "seconds", "output_tokens", "output_tok_s", "cpu_s",
                     "cpu_ms_per_token"])
        cpu_ratio = http["cpu_ms_per_token"] / offline["cpu_ms_per_token"]
        print(f"\nHTTP / offline output token throughput (best rounds) = {ratio:.3f}: "
              f"{(1 - ratio) * 100:.1f}% lower through HTTP")
        print(f"HTTP / offline CPU time per token (server + client) = {cpu_ratio:.3f}")
        result.update(offline=offline, offline_rounds=offline_runs, http_over_offline=ratio,
                      cpu_per_token_http_over_offline=cpu_ratio)
    return result
