"""`dsv41 bench`: the workload, the metrics, and both drivers against known behaviour.

The HTTP driver runs against a small aiohttp app in a thread that streams OpenAI-format
SSE with fixed timings; how it answers is chosen by the request's ``model`` name, so
each test states the server behaviour it measures.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41.deploy.bench import HttpTarget, run_http, run_in_process
from dsv41.deploy.bench_workload import BenchError, LatencyStats, RequestRecord, Workload, summarize
from dsv41.deploy.cli import main

FIRST_TOKEN_S = 0.05
TOKEN_GAP_S = 0.02


class FakeOpenAIServer:
    """Streams ``max_tokens`` tokens: the first after FIRST_TOKEN_S, then one chunk
    every TOKEN_GAP_S, a finish chunk, a usage chunk and ``[DONE]``. Models:
    ``ok``; ``no-usage`` (no usage chunk); ``pairs`` / ``pairs-no-usage`` (two tokens
    per chunk); ``fail-every-3`` (every third request is answered 500); ``cut`` (the
    stream ends without ``[DONE]``). Records every body and the peak of streams open."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.open_streams = 0
        self.peak_streams = 0
        self.arrivals = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self._started.set()
        self._loop.run_forever()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrivals += 1
        mode = body["model"]
        if mode == "fail-every-3" and self.arrivals % 3 == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        chat = request.path.endswith("/chat/completions")
        self.open_streams += 1
        self.peak_streams = max(self.peak_streams, self.open_streams)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)

            async def send(event: dict[str, Any]) -> None:
                await response.write(f"data: {json.dumps(event)}\n\n".encode())

            def choice(text: str, finish: str | None) -> dict[str, Any]:
                if chat:
                    return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                return {"index": 0, "text": text, "finish_reason": finish}

            if chat:
                # The role-only opening chunk arrives at once: it is no token.
                await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await response.write(b": keep-alive\n\n")
            await asyncio.sleep(FIRST_TOKEN_S)
            per_chunk = 2 if mode.startswith("pairs") else 1
            total = body["max_tokens"]
            for emitted in range(0, total, per_chunk):
                if emitted:
                    await asyncio.sleep(TOKEN_GAP_S)
                await send({"choices": [choice("x" * min(per_chunk, total - emitted), None)]})
            await send({"choices": [choice("", "length")]})
            if not mode.endswith("no-usage"):
                prompt = body["messages"][0]["content"].split() if chat else body["prompt"]
                usage = {"prompt_tokens": len(prompt), "completion_tokens": total, "total_tokens": len(prompt) + total}
                await send({"choices": [], "usage": usage})
            if mode != "cut":
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.open_streams -= 1


@pytest.fixture()
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def _workload(**overrides: Any) -> Workload:
    fields: dict[str, Any] = dict(endpoint="completions", num_prompts=4, output_len=4, input_len=5, vocab_size=100)
    return Workload(**(fields | overrides))


def _record(index: int, ttft: float, latency: float, out: int, itl: tuple[float, ...] = (), **kw: Any) -> RequestRecord:
    return RequestRecord(index=index, sent_s=0.0, success=True, latency_s=latency, ttft_s=ttft, itl_s=itl,
                         output_tokens=out, **kw)


# -- metrics on known data --------------------------------------------------------------


def test_summary_of_known_records() -> None:
    """Throughputs divide the successful requests' tokens by the duration; TTFT / TPOT /
    ITL / E2EL are the mean, median and linearly interpolated p99 of the successful
    requests only; unknown input sizes and chunk-counted outputs are counted, failures
    are counted with their errors and enter no other figure."""
    records = [
        _record(0, 0.1, 1.1, 11, itl=(0.1,) * 10, input_tokens=10, output_tokens_source="usage"),
        _record(1, 0.2, 0.6, 5, itl=(0.1, 0.1, 0.1, 0.1), input_tokens=20, output_tokens_source="usage"),
        _record(2, 0.3, 0.3, 1, input_tokens=None),
        _record(3, 0.4, 2.4, 3, itl=(1.0, 1.0), input_tokens=30),
        RequestRecord(index=4, sent_s=0.0, success=False, latency_s=9.0, error="HTTP 500: boom"),
        RequestRecord(
            index=5, sent_s=0.0, success=False, latency_s=9.0, ttft_s=0.01, output_tokens=2, error="HTTP 500: boom"
        ),
        RequestRecord(index=6, sent_s=0.0, success=False, latency_s=9.0, error="stream ended before data: [DONE]"),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s.completed, s.failed) == (4, 3)
    assert s.errors == {"HTTP 500: boom": 2, "stream ended before data: [DONE]": 1}
    assert (s.total_input_tokens, s.total_output_tokens, s.input_tokens_unknown) == (60, 20, 1)
    assert (s.output_tokens_from_usage, s.output_tokens_from_chunks) == (2, 2)
    assert (s.request_throughput, s.output_throughput, s.total_token_throughput) == (2.0, 10.0, 40.0)
    # TTFT 100, 200, 300, 400 ms: p99 sits at rank 0.99 * 3 = 2.97 between 300 and 400.
    assert s.ttft == LatencyStats(4, pytest.approx(250.0), pytest.approx(250.0), pytest.approx(397.0))
    # TPOT (E2EL - TTFT) / (out - 1): 100, 100, 1000 ms (the one-token request has none).
    assert s.tpot == LatencyStats(3, pytest.approx(400.0), pytest.approx(100.0), pytest.approx(982.0))
    assert s.itl.count == 16 and s.itl.median_ms == pytest.approx(100.0) and s.itl.mean_ms == pytest.approx(3400 / 16)
    assert s.e2el == LatencyStats(4, pytest.approx(1100.0), pytest.approx(850.0), pytest.approx(2361.0))


def test_summary_of_a_run_without_successes_has_no_latencies() -> None:
    """With every request failed, latency figures are absent (None), not zero."""
    s = summarize([RequestRecord(index=0, sent_s=0.0, success=False, latency_s=1.0, error="x")], duration_s=1.0)
    assert s.completed == 0 and s.failed == 1 and s.output_throughput == 0.0
    assert s.ttft == s.tpot == s.itl == s.e2el == LatencyStats(0, None, None, None)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=40), st.floats(0.1, 10.0), st.randoms())
def test_latency_stats_are_order_free_scale_with_time_and_bounded(samples: list[float], scale: float, rnd: Any) -> None:
    """Latency stats do not depend on the order of the samples, scale with the time
    unit, and lie between the smallest and largest sample with median <= p99."""
    stats = LatencyStats.of_seconds(samples)
    shuffled = list(samples)
    rnd.shuffle(shuffled)
    again = LatencyStats.of_seconds(shuffled)
    scaled = LatencyStats.of_seconds([x * scale for x in samples])
    for name in ("mean_ms", "median_ms", "p99_ms"):
        assert getattr(again, name) == pytest.approx(getattr(stats, name))
        assert getattr(scaled, name) == pytest.approx(getattr(stats, name) * scale)
        assert min(samples) * 1000 - 1e-9 <= getattr(stats, name) <= max(samples) * 1000 + 1e-9
    assert stats.median_ms <= stats.p99_ms + 1e-9


# -- the workload -----------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32), st.floats(0.01, 1000.0), st.integers(1, 50))
def test_arrivals_are_one_poisson_draw_scaled_by_the_rate(seed: int, rate: float, n: int) -> None:
    """Arrival offsets start at 0, never decrease, and equal the rate-1 offsets divided
    by the rate; the prompts depend on the seed only, never on the rate."""
    unit = _workload(num_prompts=n, seed=seed, request_rate=1.0)
    fast = _workload(num_prompts=n, seed=seed, request_rate=rate)
    offsets = fast.arrival_offsets()
    assert offsets[0] == 0.0 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets == pytest.approx([t / rate for t in unit.arrival_offsets()])
    assert fast.prompts() == unit.prompts() == _workload(num_prompts=n, seed=seed).prompts()
    assert _workload(num_prompts=n, seed=seed).arrival_offsets() == [0.0] * n


def test_random_prompts_are_seeded_token_ids_of_the_input_length() -> None:
    """Random prompts hold input_len ids in [0, vocab_size), reproducible by seed; the
    gaps between arrivals average 1 / rate."""
    w = _workload(num_prompts=2000, input_len=7, vocab_size=50, seed=3, request_rate=8.0)
    prompts = w.prompts()
    ids = np.array([p.prompt for p in prompts])
    assert ids.shape == (2000, 7) and ids.min() == 0 and ids.max() == 49
    assert all(p.num_tokens == 7 for p in prompts)
    assert _workload(num_prompts=2000, input_len=7, vocab_size=50, seed=3).prompts() == prompts
    assert _workload(num_prompts=2000, input_len=7, vocab_size=50, seed=4).prompts() != prompts
    assert np.mean(np.diff(w.arrival_offsets())) == pytest.approx(1 / 8.0, rel=0.1)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"endpoint": "embeddings"}, "endpoint"),
        ({"num_prompts": 0}, "num_prompts"),
        ({"output_len": 0}, "output_len"),
        ({"prompt_text": "hi"}, "input_len / prompt_text"),
        ({"input_len": None}, "input_len / prompt_text"),
        ({"vocab_size": None}, "vocab_size"),
        ({"endpoint": "chat"}, "endpoint"),
        ({"request_rate": 0.0}, "request_rate"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_a_bad_workload_is_refused_naming_the_field(overrides: dict[str, Any], field: str) -> None:
    """Every option outside its allowed values is refused with its name."""
    with pytest.raises(BenchError, match=f"^{field}: .*allowed"):
        _workload(**overrides)


# -- the HTTP driver ----------------------------------------------------------------------


def test_http_completions_measure_the_servers_timings(server: FakeOpenAIServer) -> None:
    """Against known timings: TTFT >= the server's first-token delay, E2EL >= first
    delay + (n - 1) gaps; ITL are the gaps between token chunks, summing to E2EL - TTFT
    up to the closing chunks; token counts come from usage; every request sends its
    token-id prompt with max_tokens, ignore_eos and include_usage."""
    workload = _workload(num_prompts=4, output_len=4)
    report = run_http(HttpTarget(server.base_url, "ok"), workload)
    s = report.summary
    assert (s.completed, s.failed, s.total_input_tokens, s.total_output_tokens) == (4, 0, 20, 16)
    assert s.output_tokens_from_usage == 4 and s.itl.count == 12 and s.tpot.count == 4
    for r in report.records:
        assert r.ttft_s >= FIRST_TOKEN_S and r.latency_s >= FIRST_TOKEN_S + 3 * TOKEN_GAP_S
        assert r.ttft_s + sum(r.itl_s) <= r.latency_s and r.finish_reason == "length"
    assert s.ttft.median_ms < (FIRST_TOKEN_S + 1.0) * 1000
    assert sorted(tuple(b["prompt"]) for b in server.bodies) == sorted(p.prompt for p in workload.prompts())
    assert all(b["max_tokens"] == 4 and b["ignore_eos"] and b["stream"] for b in server.bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in server.bodies)


def test_http_chat_ignores_the_role_chunk(server: FakeOpenAIServer) -> None:
    """A chat stream's role-only opening chunk (sent at once) is not the first token:
    TTFT still waits for the first content."""
    report = run_http(HttpTarget(server.base_url, "ok"), Workload("chat", 2, 3, prompt_text="hello there world"))
    assert report.summary.completed == 2 and report.summary.total_input_tokens == 6
    assert all(r.ttft_s >= FIRST_TOKEN_S and r.output_tokens == 3 for r in report.records)
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hello there world"}]


def test_output_tokens_prefer_usage_and_fall_back_to_chunks(server: FakeOpenAIServer) -> None:
    """With two tokens per chunk, usage gives the true count; without usage, the count
    is the chunks seen and the summary says so. ITL is one gap per chunk either way."""
    target = HttpTarget(server.base_url, "pairs")
    with_usage = run_http(target, _workload(num_prompts=2, output_len=4)).summary
    target = HttpTarget(server.base_url, "pairs-no-usage")
    without = run_http(target, _workload(num_prompts=2, output_len=4)).summary
    assert (with_usage.total_output_tokens, with_usage.output_tokens_from_usage) == (8, 2)
    assert (without.total_output_tokens, without.output_tokens_from_chunks) == (4, 2)
    assert with_usage.itl.count == without.itl.count == 2
    assert without.total_input_tokens == 10  # token-id prompts: their length is known


def test_failed_requests_are_counted_with_their_errors(server: FakeOpenAIServer) -> None:
    """HTTP errors, streams cut before [DONE] and unreachable servers are failures:
    counted, reported with their error, and left out of every throughput."""
    report = run_http(HttpTarget(server.base_url, "fail-every-3"), _workload(num_prompts=6, output_len=2))
    s = report.summary
    assert (s.completed, s.failed, s.total_output_tokens) == (4, 2, 8)
    assert list(s.errors.values()) == [2] and next(iter(s.errors)).startswith("HTTP 500: ")
    assert "injected failure" in report.table() and "Failed requests:" in report.table()

    cut = run_http(HttpTarget(server.base_url, "cut"), _workload(num_prompts=2, output_len=2)).summary
    assert (cut.completed, cut.failed, cut.errors) == (0, 2, {"stream ended before data: [DONE]": 2})

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    down = run_http(HttpTarget(f"http://127.0.0.1:{closed_port}/v1", "ok"), _workload(num_prompts=2)).summary
    assert down.failed == 2 and down.completed == 0 and down.request_throughput == 0.0
    assert all(e.startswith("ClientConnectorError") for e in down.errors)


def test_concurrency_cap_and_arrival_times_hold(server: FakeOpenAIServer) -> None:
    """With max_concurrency 2 the server never sees more than 2 streams at once (and
    does see 2); with a request rate every request is sent no earlier than its arrival."""
    capped = run_http(HttpTarget(server.base_url, "ok"), _workload(num_prompts=6, output_len=2, max_concurrency=2))
    assert capped.summary.completed == 6 and server.peak_streams == 2
    workload = _workload(num_prompts=5, output_len=1, request_rate=40.0, seed=1)
    paced = run_http(HttpTarget(server.base_url, "ok"), workload)
    for record, offset in zip(paced.records, workload.arrival_offsets()):
        assert record.sent_s >= offset - 2e-3


def test_cli_bench_prints_the_table_and_writes_json(server: FakeOpenAIServer, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`dsv41 bench --base-url ... --out` prints vLLM's result table and writes a JSON
    report holding the workload, the summary and one record per request."""
    out = tmp_path / "bench.json"
    main(["bench", "--base-url", server.base_url, "--model", "ok", "--input-len", "3", "--vocab-size", "50",
          "--num-prompts", "3", "--output-len", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    for label in ("Successful requests:", "Request throughput (req/s):", "Median TTFT (ms):", "P99 ITL (ms):"):
        assert label in printed
    report = json.loads(out.read_text())
    assert report["mode"] == "http" and report["workload"]["request_rate"] == "inf"
    assert report["summary"]["completed"] == 3 and report["summary"]["total_output_tokens"] == 6
    assert [r["index"] for r in report["requests"]] == [0, 1, 2]
    with pytest.raises(SystemExit, match="needs --vocab-size, --model-dir or --config"):
        main(["bench", "--base-url", server.base_url, "--model", "ok", "--input-len", "3"])


# -- the in-process driver ---------------------------------------------------------------


def test_in_process_reports_the_same_metrics(tiny_dir: Path) -> None:
    """Driving the engine directly: every request gets output_len tokens (ignore_eos),
    one token event per step, so ITL has output_len - 1 gaps per request; input tokens
    are the prompts' lengths; TTFT counts from the request's arrival."""
    from dsv41.cluster.engine import Engine

    engine = Engine.from_pretrained(tiny_dir)
    workload = _workload(num_prompts=3, input_len=8, output_len=4, vocab_size=engine.config.vocab_size)
    progress: list[str] = []
    report = run_in_process(engine, workload, progress.append)
    s = report.summary
    assert (s.completed, s.failed, s.total_input_tokens, s.total_output_tokens) == (3, 0, 24, 12)
    assert s.itl.count == 9 and s.tpot.count == 3
    assert s.output_tokens_from_chunks == s.output_tokens_from_usage == 0
    assert all(0 < r.ttft_s <= r.latency_s and r.finish_reason == "length" for r in report.records)
    assert progress[-1] == "bench: 3/3 requests finished, 0 failed"
    assert not engine.has_unfinished_requests()


def test_cli_in_process_with_one_request_at_a_time(tiny_dir: Path, tmp_path: Path) -> None:
    """`dsv41 bench --in-process --max-concurrency 1`: each request is sent when the one
    before it finished, and the vocabulary for random prompts comes from --model-dir."""
    out = tmp_path / "in_process.json"
    main(["bench", "--in-process", "--model-dir", str(tiny_dir), "--input-len", "6", "--num-prompts", "3",
          "--output-len", "3", "--max-concurrency", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    records = report["requests"]
    assert report["mode"] == "in-process" and report["summary"]["completed"] == 3
    for before, after in zip(records, records[1:]):
        assert after["sent_s"] >= before["sent_s"] + before["latency_s"] - 1e-9
    assert math.isclose(report["summary"]["total_input_tokens"], 18)


def _serve_yaml(path: Path, applications: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"applications": applications}))
    return path


def test_cli_in_process_runs_the_engine_a_serve_config_declares(tiny_dir: Path, tmp_path: Path) -> None:
    """`dsv41 bench --in-process --config YAML` builds the engine the YAML's application
    serves (its model and engine options), and its vocabulary gives the random prompts;
    a config with --model-dir, a config outside --in-process and a config of two
    applications are refused before anything loads."""
    import torch

    from dsv41.deploy.bench import InProcessEngine, _in_process_spec
    from dsv41.deploy.cli import build_parser

    app = {"name": "a", "import_path": "dsv41.deploy.app:build_app", "route_prefix": "/",
           "args": {"model": str(tiny_dir), "engine": {"dtype": "float32", "block_size": 64, "max_num_seqs": 4}}}
    config = _serve_yaml(tmp_path / "serve.yaml", [app])
    argv = ["bench", "--in-process", "--config", str(config), "--input-len", "5", "--num-prompts", "2",
            "--output-len", "2"]
    spec = _in_process_spec(build_parser().parse_args(argv))
    assert spec == InProcessEngine(str(tiny_dir), {"dtype": torch.float32, "block_size": 64, "max_num_seqs": 4})
    assert spec.build().options.block_size == 64
    out = tmp_path / "report.json"
    main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["summary"]["completed"] == 2
    with pytest.raises(SystemExit, match="give one of them"):
        main([*argv, "--model-dir", str(tiny_dir)])
    with pytest.raises(SystemExit, match="with --in-process only"):
        main(["bench", "--base-url", "http://127.0.0.1:1/v1", "--model", "m", "--config", str(config),
              "--input-len", "3", "--vocab-size", "10"])
    two = _serve_yaml(tmp_path / "two.yaml", [app, {**app, "name": "b", "route_prefix": "/b"}])
    with pytest.raises(SystemExit, match="declares 2 applications"):
        main(["bench", "--in-process", "--config", str(two), "--input-len", "3", "--num-prompts", "1"])
