"""The OpenAI-compatible server (``pagedattn.serve``) and the trace replayer (``pagedattn.replay``) end to end on
loopback, with the random-weight tiny OPT: streaming and non-streaming requests, a replayed trace, a client that
disconnects mid-stream (its blocks come back), malformed requests (a 400 naming the field while others finish),
overload (503), and served tokens equal to ``LLM.generate``. Every server runs on an ephemeral port in a background
thread and is always shut down. The 20,000-request soak test is ``benchmarks/serve_soak.py`` (not in CI)."""
import asyncio
import json
import threading
import time

import httpx
import pytest
from factories import llm_engine
from test_engine import assert_all_blocks_free

from pagedattn import replay
from pagedattn.async_engine import AsyncEngine
from pagedattn.repro.experiments.common import tiny_opt
from pagedattn.llm import LLM
from pagedattn.sequence import SamplingParams
from pagedattn.serve import build_app, field_of, load_engine, serve_in_thread
from pagedattn.repro.workloads.traces import synthetic_prompt
from pagedattn.repro.experiments.zoo import train_tokenizer

MODEL = "tiny:opt"


@pytest.fixture(scope="module")
def server(one_thread):
    """(base URL, AsyncEngine) of a paged server of the tiny OPT, 4096 token slots, max_model_len 256."""
    engine = load_engine(MODEL, "paged", num_slots=4096, block_size=16, max_model_len=256)
    async_engine = AsyncEngine(engine, max_queued=1000)
    with serve_in_thread(build_app(async_engine, MODEL)) as url:
        yield url, async_engine


def wait_idle(async_engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Wait until no request is in flight and the engine holds none (the worker has applied every abort)."""
    deadline = time.monotonic() + timeout
    while async_engine.num_in_flight or async_engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.02)


async def complete(client: httpx.AsyncClient, body: dict) -> tuple[int, dict | list]:
    """POST a completion: (status, JSON body) or, when streaming, (status, the parsed SSE chunks, [DONE] last)."""
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r.json()
    chunks = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread())
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return r.status_code, chunks


def streamed_tokens(chunks: list) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in chunks[:-1]:
        for ch in c["choices"]:
            out.setdefault(ch["index"], []).extend(ch["token_ids"])
    return out


def test_served_tokens_equal_llm_generate_and_a_bad_request_gets_400_while_others_finish(server):
    url, async_engine = server
    prompts = [synthetic_prompt(4 + 3 * i, 512, seed=i) for i in range(8)]
    max_tokens = [5 + 2 * i for i in range(8)]
    want = LLM(tiny_opt(0)).generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                               for m in max_tokens], use_tqdm=False)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True,
                       "stream": i % 2 == 0} for i, (p, m) in enumerate(zip(prompts, max_tokens))]
            bad = {"prompt": prompts[0], "temperature": "hot"}
            return await asyncio.gather(*(complete(client, b) for b in bodies[:4] + [bad] + bodies[4:]))

    results = asyncio.run(run())
    status, err = results.pop(4)
    assert status == 400 and err["error"]["param"] == "temperature" and err["error"]["type"] == "invalid_request_error"
    for i, ((status, got), ref) in enumerate(zip(results, want)):
        assert status == 200
        if i % 2 == 0:  # streamed: SSE chunks ending with [DONE], the finish reason on the last piece
            assert got[-1] == "[DONE]" and got[-2]["choices"][-1]["finish_reason"] == "length"
            assert streamed_tokens(got)[0] == ref.outputs[0].token_ids
        else:
            assert got["choices"][0]["token_ids"] == ref.outputs[0].token_ids
            assert got["usage"]["completion_tokens"] == max_tokens[i]
    wait_idle(async_engine)
    assert_all_blocks_free(async_engine.engine)


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": [1, 2], "n": 0}, "n"),
    ({"prompt": [1, 2], "max_tokens": -3}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": [1, 2], "top_p": 2}, "top_p"),
    ({"prompt": [1, 2], "seed": "x"}, "seed"),
    ({"prompt": [1, 2], "stream": "yes"}, "stream"),
    ({"prompt": [1, 2], "stop": ["\n"]}, "stop"),
    ({"prompt": [1, 2], "stop_token_ids": [9999]}, "stop_token_ids"),
    ({"prompt": "text, but the tiny model has no tokenizer"}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": [[1, 2], "x", 3]}, "prompt"),
    ({"prompt": [1] * 300}, "prompt"),  # over max_model_len
    ({"prompt": [1, 2], "n": 2, "best_of": 3, "stream": True}, "best_of"),
    ([1, 2], None),
])
def test_a_malformed_request_gets_an_openai_400_naming_the_field(server, body, param):
    url, async_engine = server
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_invalid_json_unknown_model_and_overload(server):
    url, async_engine = server
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    r = httpx.post(f"{url}/v1/completions", json={"model": "gpt-9", "prompt": [1]}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    async_engine.max_queued = 0  # every request now finds the queue full
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2]}, timeout=30)
        assert r.status_code == 503 and "max_queued" in r.json()["error"]["message"]
    finally:
        async_engine.max_queued = 1000
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "n": 2, "seed": 3}, timeout=30)
    assert r.status_code == 200 and [len(c["token_ids"]) for c in r.json()["choices"]] == [2, 2]
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["max_model_len"] == 256


def test_a_client_that_disconnects_mid_stream_leaves_no_blocks_held(server):
    url, async_engine = server
    kv = async_engine.engine.kv
    body = {"prompt": synthetic_prompt(40, 512, 0), "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(2):
            steps = async_engine.engine.num_steps
            with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert kv.num_free_gpu_blocks < kv.num_gpu_blocks  # it holds blocks while it runs
            # leaving the block closes the connection after the first chunk: the request is aborted, not finished
            wait_idle(async_engine)
            assert async_engine.engine.num_steps - steps < 150, "the request ran on after its client left"
    assert_all_blocks_free(async_engine.engine)
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "in_flight": 0, "queued": 0}


def test_replayer_end_to_end_writes_the_latency_csv(server, tmp_path):
    url, async_engine = server
    out = tmp_path / "replay.csv"
    from pagedattn.repro.experiments import replay as replay_cli

    summary = replay_cli.main(["--url", f"{url}/v1", "--trace", "alpaca", "--rate", "40", "--num-requests", "30",
                           "--scale", "2", "--out", str(out), "--time-limit", "50"])
    assert summary["completed"] == 30 and summary["failed"] == summary["cancelled"] == 0
    import pandas as pd

    df = pd.read_csv(out)
    assert len(df) == 30 and (df["status"] == "ok").all() and (df["tokens"] == df["max_tokens"]).all()
    assert (df["sent"] <= df["first_token"]).all() and (df["first_token"] <= df["last_token"]).all()
    assert (df["normalized_latency"] - df["latency"] / df["tokens"]).abs().max() < 1e-9
    assert summary["mean_nl_ms"] > 0 and summary["p99_ttft_ms"] >= summary["median_ttft_ms"]
    wait_idle(async_engine)
    assert_all_blocks_free(async_engine.engine)


def test_replayer_time_limit_cancels_what_is_in_flight(server, monkeypatch):
    """The engine holds every step until the replay has returned, so the request is in flight at the time limit
    however fast the machine is: the verdict does not depend on its speed."""
    url, async_engine = server
    engine, gate = async_engine.engine, threading.Event()
    step = engine.step

    def held_step(*args, **kw):
        gate.wait(timeout=60)
        return step(*args, **kw)

    monkeypatch.setattr(engine, "step", held_step)
    trace = [replay.Request("long", 0.0, 8, 100)]
    try:
        records = asyncio.run(replay.replay(url, trace, MODEL, 512, time_limit=0.2))
    finally:
        gate.set()
    assert records[0].status == "cancelled" and records[0].sent is not None and records[0].first_token is None
    wait_idle(async_engine)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("system", ["orca_oracle", "orca_max"])
def test_orca_servers_serve_the_same_tokens(one_thread, system):
    engine = load_engine(MODEL, system, num_slots=1024, max_model_len=256)
    async_engine = AsyncEngine(engine)
    prompts = [synthetic_prompt(6, 512, seed=i) for i in range(3)]
    want = LLM(tiny_opt(0)).generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                     use_tqdm=False)
    with serve_in_thread(build_app(async_engine, MODEL)) as url:
        for p, ref in zip(prompts, want):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 6, "temperature": 0,
                                                          "ignore_eos": True}, timeout=30)
            assert r.json()["choices"][0]["token_ids"] == ref.outputs[0].token_ids
        # Orca (Max) reserves max_model_len = 256 slots per request: 5 of them never fit in 1024 slots at once
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "n": 5}, timeout=30)
        assert r.status_code == (400 if system == "orca_max" else 200)
    assert_all_blocks_free(engine)


def test_a_checkpoint_folder_is_served(tmp_path, one_thread):
    tiny_opt(0).save_pretrained(tmp_path)
    engine = load_engine(str(tmp_path), num_slots=512)
    assert engine.max_model_len == 512 and engine.vocab_size == 512
    # no tokenizer files: token ids only. transformers 5 builds an empty tokenizer for such a folder, which decodes
    # every id to "" and whose end-of-text token, id 0, stopped sequences that HF generate continues (OPT's EOS is 2)
    assert engine.tokenizer is None and engine.sampler.eos_token_ids == {2}
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request("t", "def f():", SamplingParams(max_tokens=2))
    # a tokenizer saved beside the weights is loaded and decodes the streamed text
    tok = train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)
    tok.save_pretrained(tmp_path)
    engine = load_engine(str(tmp_path), num_slots=512)
    assert engine.tokenizer is not None and len(engine.tokenizer) == len(tok)
    engine.add_request("t", "def f(x):", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_engine(str(tmp_path / "missing"))
    # tokenizer files that cannot be read: token ids only, and a warning that names the folder and the error
    broken = tmp_path / "broken"
    tiny_opt(0).save_pretrained(broken)
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.warns(UserWarning, match=r"broken: its tokenizer files could not be read \(\w+"):
        engine = load_engine(str(broken), num_slots=512)
    assert engine.tokenizer is None


def test_field_of_names_the_parameter_of_engine_errors():
    assert field_of("n=5 sequences of one request exceed max_num_seqs=4") == "n"
    assert field_of("best_of=5 sequences of one request exceed max_num_seqs=4") == "best_of"
    assert field_of("stop token id 9999 is outside the vocabulary (vocab_size=512)") == "stop_token_ids"
    assert field_of("request of 600 tokens exceeds the model maximum max_model_len=512") == "max_tokens"
    assert field_of("empty prompt: a request needs at least 1 prompt token") == "prompt"


def test_step_metrics_is_a_bounded_ring():
    engine = llm_engine(tiny_opt(0), num_gpu_blocks=64, max_step_metrics=3)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_steps == 8 and len(engine.step_metrics) == 3
    assert [m.step for m in engine.step_metrics] == [5, 6, 7] and [m.step for m in engine.step_metrics[-2:]] == [6, 7]
    assert len(engine.step_metrics_frame()) == 3
    assert llm_engine(tiny_opt(0), num_gpu_blocks=8).step_metrics.maxlen == 10_000
    with pytest.raises(ValueError, match="max_step_metrics"):
        llm_engine(tiny_opt(0), num_gpu_blocks=8, max_step_metrics=-1)
