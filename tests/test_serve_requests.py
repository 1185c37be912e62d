"""The server's requests end to end (issue 62): every choice comes back whole when a request's prompts must queue
(streamed or not, completions and chat); a client that goes away cancels all its request queued, prompts not yet
added included; ``--max-queued`` counts a request's prompts up front. A live server per module, serving the tiny
random OPT with a small tokenizer that has a chat template, with few sequences at once so that prompts queue."""
import asyncio
import gc
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_engine import assert_all_blocks_free
from test_serve import complete, streamed_tokens, wait_idle
from test_serve_openai import TEMPLATE, TEXTS, tok  # noqa: F401 (tok: the tokenizer fixture, with a template)
from tiny_models import tiny_opt

from pagedattn.async_engine import AsyncEngine
from pagedattn.openai_protocol import (NO_EFFECT, SUPPORTED, UNSUPPORTED, VLLM_CHAT_FIELDS, VLLM_COMPLETION_FIELDS,
                                       field_table)
from pagedattn.repro.experiments.zoo import train_tokenizer
from pagedattn.sequence import MIN_TEMPERATURE, SamplingParams
from pagedattn.serve import build_app, chat_template_arg, load_engine, serve_in_thread

MODEL = "tiny-chat"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def live(one_thread, tok):
    """(base URL, AsyncEngine): 4 sequences at most run at once, so a request's later prompts wait for its first."""
    engine = load_engine(tiny_opt(vocab_size=len(tok)), "paged", num_slots=1024, max_model_len=128, tokenizer=tok,
                         max_num_seqs=4)
    async_engine = AsyncEngine(engine, max_queued=200_000)
    with serve_in_thread(build_app(async_engine, MODEL)) as url:
        yield url, async_engine
    assert_all_blocks_free(engine)


def whole(choice: dict) -> bool:
    return choice["finish_reason"] == "length" and len(choice["token_ids"]) == MAX_TOKENS


def body(n_prompts: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": [[5 + i % 50, 7, 9] for i in range(n_prompts)], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": stream}


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_of_a_many_prompt_completion_comes_back_whole(live, stream):
    """40 prompts on a server that runs 4 at once: the first finish long before the last start, and each still has
    its final output (all its tokens and its finish reason)."""
    url, async_engine = live

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await complete(client, body(40, stream))

    status, got = asyncio.run(run())
    assert status == 200
    if not stream:
        assert [c["index"] for c in got["choices"]] == list(range(40))
        assert all(whole(c) for c in got["choices"]), [c["finish_reason"] for c in got["choices"]]
        assert got["usage"]["completion_tokens"] == 40 * MAX_TOKENS
    else:
        tokens = streamed_tokens(got)
        assert sorted(tokens) == list(range(40)) and all(len(t) == MAX_TOKENS for t in tokens.values())
        reasons = {ch["index"]: ch["finish_reason"] for c in got[:-1] for ch in c["choices"] if ch["finish_reason"]}
        assert reasons == {i: "length" for i in range(40)}
    wait_idle(async_engine)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_requests_that_must_queue_come_back_whole(live, stream):
    """12 chat requests (n=2) sent while a 40-prompt completion runs: each waits for room, and each choice ends."""
    url, async_engine = live

    async def chat(client):
        b = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": MAX_TOKENS, "n": 2,
             "ignore_eos": True, "stream": stream}
        if not stream:
            r = await client.post("/v1/chat/completions", json=b)
            return r.status_code, {c["index"]: c["finish_reason"] for c in r.json()["choices"]}
        reasons = {}
        async with client.stream("POST", "/v1/chat/completions", json=b) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for ch in httpx.Response(200, content=line[6:]).json()["choices"]:
                        if ch["finish_reason"]:
                            reasons[ch["index"]] = ch["finish_reason"]
        return r.status_code, reasons

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            load = asyncio.create_task(complete(client, body(40, False)))
            chats = await asyncio.gather(*(chat(client) for _ in range(12)))
            return await load, chats

    (status, load), chats = asyncio.run(run())
    assert status == 200 and all(whole(c) for c in load["choices"])
    assert chats == [(200, {0: "length", 1: "length"})] * 12
    wait_idle(async_engine)


def test_an_abandoned_100000_prompt_request_is_cancelled_and_a_small_one_is_served(live):
    """A 1 MB body of 100,000 prompts whose client goes away once its first prompts are in the engine: the prompts
    not yet added are never added, the ones added are aborted, and a 4-token request sent next is served; nothing
    is left in the engine."""
    url, async_engine = live
    before = async_engine.num_added

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            big = asyncio.create_task(client.post("/v1/completions", json=body(100_000, False)))
            while async_engine.num_added == before:  # the body is read, checked and its first prompts added
                await asyncio.sleep(0.05)
                assert not big.done(), big.result().text
            big.cancel()  # the client goes away: httpx closes the connection
            await asyncio.gather(big, return_exceptions=True)
            return await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 4,
                                                               "ignore_eos": True})

    small = asyncio.run(run())
    assert small.status_code == 200 and small.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(async_engine, timeout=120)
    assert async_engine.num_added - before < 100_000  # the abandoned request's later prompts were never added
    assert not async_engine.engine.requests and async_engine.num_queued == 0


def test_max_queued_counts_a_requests_prompts_before_any_work(live):
    """A request of more prompts than ``--max-queued`` admits gets a 503 at once: none of its prompts is added."""
    url, async_engine = live
    before = async_engine.num_added
    async_engine.max_queued = 50
    try:
        r = httpx.post(f"{url}/v1/completions", json=body(100_000, False), timeout=120)
        assert r.status_code == 503 and "max_queued" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == 503
        assert async_engine.num_added == before and async_engine.num_queued == 0
        r = httpx.post(f"{url}/v1/completions", json=body(50, False), timeout=120)  # exactly the limit: served
        assert r.status_code == 200 and all(whole(c) for c in r.json()["choices"])
    finally:
        async_engine.max_queued = 200_000
    wait_idle(async_engine)


def test_a_tiny_temperature_is_raised_to_001_with_a_warning(live, caplog):
    """vLLM's rule: 0 < temperature < 0.01 is sampled at 0.01 (logits / 1e-40 overflow: token 0 every time)."""
    url, async_engine = live
    with caplog.at_level("WARNING", logger="pagedattn.sequence"):
        assert SamplingParams(temperature=1e-40).temperature == MIN_TEMPERATURE == 0.01
    assert "raised to 0.01" in caplog.text
    assert SamplingParams(temperature=0).temperature == 0 and SamplingParams(temperature=0.5).temperature == 0.5

    def ids(temperature: float) -> list[int]:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8,
                                                      "temperature": temperature, "seed": 1, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    tiny = ids(1e-40)
    assert tiny == ids(0.01) and set(tiny) != {0}
    wait_idle(async_engine)


#: the metric families of vLLM 0.32's PrometheusStatLogger (vllm/v1/metrics/loggers.py) that our engine can measure
VLLM_032_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter", "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram"}
#: vLLM v0's names that 0.32 no longer has
V0_ONLY = ("vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:num_requests_swapped",
           "vllm:time_per_output_token_seconds")


def test_metrics_have_vllm_032_names_and_labels(live):
    url, async_engine = live
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [[5, 6, 7], [8, 9]], "n": 2,
                                                  "max_tokens": 5, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    wait_idle(async_engine)
    text = httpx.get(f"{url}/metrics").text
    families = {f.name: f.type for f in text_string_to_metric_families(text)
                if not f.name.endswith("_created")}  # prometheus_client's creation times, vLLM's /metrics has them too
    assert {k: v for k, v in families.items() if k.startswith("vllm:")} == VLLM_032_METRICS
    assert set(families) - set(VLLM_032_METRICS) == {"pagedattn:num_requests_swapped", "pagedattn:cpu_cache_usage_perc"}
    assert not any(name in families for name in V0_ONLY)
    samples = {}
    for f in text_string_to_metric_families(text):
        for sample in f.samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0", sample
            samples.setdefault(sample.name, sample.value)
    value = samples.__getitem__
    assert value("vllm:kv_cache_usage_perc") == 0.0  # idle: every block free
    assert value("vllm:inter_token_latency_seconds_count") > 0
    assert value("vllm:request_prompt_tokens_sum") >= 5 and value("vllm:request_params_n_sum") >= 4
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(f"vllm:request_{phase}_time_seconds_count") >= 2


def test_every_vllm_032_request_field_is_supported_or_refused(live):
    """No request field of vLLM 0.32 is silently ignored: each is implemented, documented as without effect (with
    the reason), or refused with a 400 naming it when set to anything but its off value; and docs/SERVING.md's
    table is the one generated from the two field lists."""
    url, async_engine = live
    fields = dict.fromkeys(VLLM_COMPLETION_FIELDS + VLLM_CHAT_FIELDS)
    for name in fields:
        assert (name in SUPPORTED) + (name in NO_EFFECT) + (name in UNSUPPORTED) == 1, name
    base = {"completions": {"model": MODEL, "prompt": [5, 6], "max_tokens": 2},
            "chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    refused = 0
    for endpoint, names in (("completions", VLLM_COMPLETION_FIELDS), ("chat/completions", VLLM_CHAT_FIELDS)):
        for name in names:
            if name not in UNSUPPORTED:
                continue
            r = httpx.post(f"{url}/v1/{endpoint}", json={**base[endpoint], name: {"on": 1}}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (endpoint, name, r.text)
            refused += 1
            off = UNSUPPORTED[name][-1]
            r = httpx.post(f"{url}/v1/{endpoint}", json={**base[endpoint], name: off}, timeout=60)
            assert r.status_code == 200, (endpoint, name, off, r.text)
    assert refused > 40
    docs = (Path(__file__).parents[1] / "docs" / "SERVING.md").read_text()
    assert field_table() in docs, "regenerate the table: python -m pagedattn.openai_protocol"
    wait_idle(async_engine)


def test_vllm_extras_change_the_request(live, tok):
    """add_special_tokens, truncate_prompt_tokens, request_id, return_tokens_as_token_ids, return_token_ids,
    stream_interval, chat_template, continue_final_message and a message's name each do what vLLM does."""
    url, async_engine = live

    def post(endpoint: str, **kw) -> dict:
        b = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}
        r = httpx.post(f"{url}/v1/{endpoint}", json=b, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    with_bos = post("completions", prompt="the cat")["usage"]["prompt_tokens"]
    assert with_bos == len(tok("the cat")["input_ids"])
    assert post("completions", prompt="the cat", add_special_tokens=False)["usage"]["prompt_tokens"] == with_bos - 1
    r = post("completions", prompt=list(range(5, 25)), truncate_prompt_tokens=6, request_id="mine-1",
             logprobs=1, return_tokens_as_token_ids=True, return_token_ids=True)
    assert r["id"] == "cmpl-mine-1" and r["usage"]["prompt_tokens"] == 6
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == list(range(19, 25))
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert post("completions", prompt=list(range(5, 25)), truncate_prompt_tokens=6,
                truncation_side="right")["usage"]["prompt_tokens"] == 6

    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 10,
                                                            "ignore_eos": True, "stream": True,
                                                            "stream_interval": 4}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(len(httpx.Response(200, content=line[6:]).json()["choices"][0]["token_ids"]))
    assert sum(chunks) == 10 and chunks[0] == 1 and all(n >= 4 for n in chunks[1:-1]), chunks

    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "the"}]
    template = "{% for m in messages %}[{{ m['name'] or m['role'] }}]{{ m['content'] }}{% endfor %}"
    r = httpx.post(f"{url}/tokenize", json={"messages": messages, "chat_template": template,
                                            "add_generation_prompt": False, "continue_final_message": True})
    assert tok.decode(r.json()["tokens"]) == "[ann]hi[assistant]the"
    r = post("chat/completions", messages=messages, chat_template=template, add_generation_prompt=False,
             continue_final_message=True, return_token_ids=True)
    assert r["usage"]["prompt_tokens"] == len(tok("[ann]hi[assistant]the", add_special_tokens=False)["input_ids"])
    assert len(r["choices"][0]["token_ids"]) == 4 and r["choices"][0]["prompt_token_ids"]
    wait_idle(async_engine)


@pytest.mark.parametrize("kw, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true (vLLM's 400)
    ({"priority": 1}, "priority"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"add_special_tokens": "no"}, "add_special_tokens"),
])
def test_vllm_extras_bad_values_get_a_400_naming_them(live, kw, param):
    url, _ = live
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2, **kw}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and r.json()["error"]["code"] == 400, r.text


def test_chat_template_flag_serves_a_tokenizer_without_one(one_thread, tmp_path):
    """``--chat-template FILE`` gives chat to a tokenizer that has no template (without it: a 400 naming messages)."""
    plain = train_tokenizer(TEXTS * 30, vocab_size=300)
    assert not plain.chat_template
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    engine = load_engine(tiny_opt(vocab_size=len(plain)), "paged", num_slots=256, max_model_len=64, tokenizer=plain)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serve_in_thread(build_app(AsyncEngine(engine), MODEL,
                                   chat_template=chat_template_arg(str(tmp_path / "t.jinja")))) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        t = httpx.post(f"{url}/tokenize", json={"messages": body["messages"]}).json()
        assert plain.decode(t["tokens"]) == "<user>hi\n<assistant>"
    with serve_in_thread(build_app(AsyncEngine(engine), MODEL)) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        body["chat_template"] = TEMPLATE
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_dropped_streams_log_no_traceback(live, caplog):
    """Clients that drop their streams mid-way (and one before its first event) leave no error in the log (the old
    server logged "Task exception was never retrieved ... aclose(): asynchronous generator is already running") and
    no request behind."""
    url, async_engine = live

    async def drop(client, after: int) -> None:
        b = {**body(3, True), "max_tokens": 60}
        async with client.stream("POST", "/v1/completions", json=b) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= after:
                    break

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await asyncio.gather(*(drop(client, after) for after in (0, 1, 2, 5, 1, 3)))

    with caplog.at_level("WARNING"):
        asyncio.run(run())
        wait_idle(async_engine)
        gc.collect()
        r = httpx.post(f"{url}/v1/completions", json=body(2, False), timeout=60)  # the loop runs on
        assert r.status_code == 200
    assert not [rec for rec in caplog.records if rec.levelno >= 30 and "temperature" not in rec.getMessage()], \
        caplog.text
    assert not async_engine.engine.requests and async_engine.num_queued == 0


def test_a_300_prompt_request_and_an_8_prompt_one_under_load_come_back_whole(live):
    """The issue's acceptance check: 300 prompts (the old server returned 256 of them with one token and no finish
    reason) and an 8-prompt request sent while 20 others run, on a server that runs 4 sequences at once."""
    url, async_engine = live

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            big = asyncio.create_task(complete(client, body(300, False)))
            load = [asyncio.create_task(complete(client, body(2, i % 2 == 0))) for i in range(20)]
            eight = await complete(client, body(8, False))
            return await big, eight, await asyncio.gather(*load)

    (s300, r300), (s8, r8), load = asyncio.run(run())
    assert s300 == s8 == 200 and all(status == 200 for status, _ in load)
    assert len(r300["choices"]) == 300 and all(whole(c) for c in r300["choices"])
    assert len(r8["choices"]) == 8 and all(whole(c) for c in r8["choices"])
    wait_idle(async_engine)
