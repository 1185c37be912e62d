"""The server (``pagedattn.serve``) driven with the official ``openai`` client, as a vLLM user drives vLLM: completions
and chat, streaming, ``n``, several prompts, ``stop``, ``logprobs``, beam search, the vLLM extras, ``/tokenize``,
``/detokenize``, ``/version``, ``/metrics``, and every error path (each a 4xx in OpenAI's format naming the field or
the limit). One live server per module on a free loopback port, serving a tiny random OPT with a small byte-level BPE
tokenizer that has a chat template; the server of ``test_serve`` (no tokenizer) answers the chat refusal."""
import asyncio
import json
import threading

import httpx
import openai
import pytest
from test_engine import assert_all_blocks_free
from test_serve import complete, streamed_tokens, wait_idle
from tiny_models import tiny_opt

from pagedattn.async_engine import AsyncEngine
from pagedattn.llm import LLM
from pagedattn.repro.experiments.zoo import train_tokenizer
from pagedattn.sequence import SamplingParams
from pagedattn.serve import build_app, load_engine, serve_in_thread

MODEL = "tiny-chat"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TEXTS = ["the cat sat on the mat. the dog ate the cat food.\n", "<user>hello there\n<assistant>hi, how are you?\n"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tok():
    t = train_tokenizer(TEXTS * 30, vocab_size=300)
    t.chat_template = TEMPLATE
    return t


@pytest.fixture(scope="module")
def live(one_thread, tok):
    """(openai client, base URL, AsyncEngine, model)."""
    model = tiny_opt(vocab_size=len(tok))
    engine = load_engine(model, "paged", num_slots=2048, max_model_len=MAX_MODEL_LEN, tokenizer=tok,
                         swap_space=0.01)
    async_engine = AsyncEngine(engine)
    with serve_in_thread(build_app(async_engine, MODEL, max_body_bytes=1 << 20, max_prompt_chars=2000)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        yield client, url, async_engine, model
    assert_all_blocks_free(engine)


def reference(model, tok, prompt: str, **kw):
    return LLM(model, tokenizer=tok).generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs


def test_completion_streamed_and_not_equals_llm_generate(live, tok):
    client, _, async_engine, model = live
    (want,) = reference(model, tok, "the cat", temperature=0, max_tokens=12, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(tok("the cat")["input_ids"])
    chunks = list(client.completions.create(model=MODEL, prompt="the cat", max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    wait_idle(async_engine)


def test_chat_streamed_and_not(live, tok):
    client, _, async_engine, model = live
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    prompt_ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
    (want,) = LLM(model, tokenizer=tok).generate([prompt_ids], SamplingParams(temperature=0, max_tokens=10,
                                                                               ignore_eos=True), use_tqdm=False)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    text = want.outputs[0].text
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(prompt_ids) and r.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    # no max_tokens: the context left after the prompt
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_MODEL_LEN - len(prompt_ids) and r.choices[0].finish_reason == "length"
    wait_idle(async_engine)


def test_n_several_prompts_and_beam_search(live, tok):
    client, _, async_engine, model = live
    r = client.completions.create(model=MODEL, prompt=["the cat", "the dog"], n=2, max_tokens=5, seed=1,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 20
    r2 = client.completions.create(model=MODEL, prompt=["the dog"], n=2, max_tokens=5, seed=1,
                                   extra_body={"ignore_eos": True})
    assert [c.text for c in r2.choices] == [c.text for c in r.choices[2:]]  # each prompt is its own seeded request
    chunks = list(client.completions.create(model=MODEL, prompt=["the cat", "the dog"], n=2, max_tokens=5, seed=1,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = {}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {c.index: c.text for c in r.choices}
    want = reference(model, tok, "the cat", use_beam_search=True, n=2, temperature=0, max_tokens=6, ignore_eos=True)
    beams = client.completions.create(model=MODEL, prompt="the cat", n=2, max_tokens=6,
                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in beams.choices] == [o.text for o in want]
    assert beams.choices[0].text != beams.choices[1].text
    wait_idle(async_engine)


def test_stop_strings_streamed_and_not(live):
    client, _, async_engine, _ = live
    kw = dict(model=MODEL, prompt="the cat", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[4:7]
    cut = full[:full.find(stop)]
    for include in (False, True):
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        want = cut + (stop if include else "")
        r = client.completions.create(**{**kw, "extra_body": extra}, stop=[stop])
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(**{**kw, "extra_body": extra}, stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the cat"}],
                                          max_tokens=30, temperature=0, stop=["\n"], extra_body={"ignore_eos": True})
    assert "\n" not in chat.choices[0].message.content
    wait_idle(async_engine)


def test_logprobs_completions_and_chat(live):
    client, _, async_engine, _ = live
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and value <= 0 and max(top.values()) == pytest.approx(value)  # greedy: the top one
    assert "".join(lp.tokens) == r.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    streamed = list(client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, temperature=0, logprobs=1,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert [v for c in streamed for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    wait_idle(async_engine)


def test_sampling_extras_are_applied(live, tok):
    """min_tokens, the penalties and min_p reach the sampler: the served tokens equal LLM.generate's."""
    client, _, async_engine, model = live
    extras = {"repetition_penalty": 1.4, "min_tokens": 3, "min_p": 0.1, "top_k": 0}
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=10, temperature=0, presence_penalty=0.5,
                                  frequency_penalty=0.3, extra_body=extras)
    (want,) = reference(model, tok, "the cat", temperature=0, max_tokens=10, presence_penalty=0.5,
                        frequency_penalty=0.3, repetition_penalty=1.4, min_tokens=3, min_p=0.1, top_k=0)
    (plain,) = reference(model, tok, "the cat", temperature=0, max_tokens=10)
    assert r.choices[0].text == want.text and want.token_ids != plain.token_ids
    wait_idle(async_engine)


def test_tokenize_detokenize_version_and_metrics(live, tok):
    client, url, async_engine, _ = live
    t = httpx.post(f"{url}/tokenize", json={"prompt": "the cat"}).json()
    assert t["tokens"] == tok("the cat")["input_ids"] and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == MAX_MODEL_LEN
    m = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tok.decode(m["tokens"]) == "<user>hi\n<assistant>"
    assert httpx.post(f"{url}/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == tok.decode(t["tokens"])
    assert httpx.get(f"{url}/version").json()["version"]
    client.completions.create(model=MODEL, prompt="the cat", max_tokens=3, extra_body={"ignore_eos": True})
    wait_idle(async_engine)
    text = httpx.get(f"{url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "pagedattn:num_requests_swapped",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_success_total"):
        assert f"{name}{{" in text, name
    line = next(x for x in text.splitlines() if x.startswith("vllm:request_success_total{") and "length" in x)
    assert float(line.split()[-1]) >= 1


@pytest.mark.parametrize("kw, param", [
    ({"prompt": "the cat", "temperature": -1}, "temperature"),
    ({"prompt": "the cat", "max_tokens": 500}, "max_tokens"),  # beyond the 128-token context
    ({"prompt": "the cat", "echo": True}, "echo"),
    ({"prompt": "the cat", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt": "the cat", "suffix": "x"}, "suffix"),
    ({"prompt": "the cat", "logprobs": 21}, "logprobs"),
    ({"prompt": "the cat", "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"prompt": "the cat", "extra_body": {"min_p": 2}}, "min_p"),
    ({"prompt": "the cat", "presence_penalty": 5}, "presence_penalty"),
    ({"prompt": "the cat", "extra_body": {"min_tokens": 50}, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "the cat", "stop": [""]}, "stop"),
    ({"prompt": "the cat", "n": 2, "stream": True, "extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"prompt": "x" * 2001}, "prompt"),  # over --max-prompt-chars
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2], "extra_body": {"stop_token_ids": [10 ** 30]}}, "stop_token_ids"),
    ({"prompt": [1, 2], "extra_body": {"stop_token_ids": 0}}, "stop_token_ids"),
    ({"prompt": "the cat", "seed": 2 ** 70}, "seed"),
    ({"prompt": "the cat", "extra_body": {"top_k": 10 ** 30}}, None),  # clamped to the vocabulary: served
])
def test_completion_errors_name_the_field(live, kw, param):
    client, _, async_engine, _ = live
    kw = {"model": MODEL, "max_tokens": 4, **kw}
    if param is None:
        assert client.completions.create(**kw).choices[0].finish_reason is not None
        return
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"]
    wait_idle(async_engine)


@pytest.mark.parametrize("kw, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_chat_errors_name_the_field(live, kw, param):
    client = live[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_unknown_model_body_limit_and_raw_errors(live):
    client, url, async_engine, _ = live
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert e.value.body["param"] == "model"
    big = json.dumps({"model": MODEL, "prompt": "x", "junk": "y" * (2 << 20)})
    r = httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(40):
            yield b"y" * 65536

    r = httpx.post(f"{url}/v1/completions", content=chunks())
    assert r.status_code == 413
    r = httpx.post(f"{url}/v1/completions", content=b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    # a lone surrogate (the openai client cannot even encode one: it is sent raw)
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "\\ud800", "max_tokens": 2}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{url}/tokenize", content=b'{"prompt": "\\udfff"}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{url}/detokenize", json={"tokens": [10 ** 20]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    wait_idle(async_engine)


def test_a_model_without_a_chat_template_gets_a_clear_400(one_thread):
    engine = load_engine("tiny:opt", num_slots=512, max_model_len=64)
    with serve_in_thread(build_app(AsyncEngine(engine), "tiny:opt")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="tiny:opt", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="stop strings need a tokenizer"):
            client.completions.create(model="tiny:opt", prompt=[1, 2], stop="x")
        r = client.completions.create(model="tiny:opt", prompt=[1, 2], max_tokens=2, logprobs=1)
        assert r.choices[0].logprobs.tokens[0].startswith("token_id:")


def test_fifty_concurrent_n2_requests_on_2048_slots_are_all_served(one_thread):
    """The issue's acceptance check: 50 concurrent n=2 requests on a 2,048-slot server. Their sequences need about
    four times the 128 blocks, so running groups of two sequences are preempted; with CPU swap space
    (``--swap-space``) they are swapped out and back, and every request gets its two full choices."""
    engine = load_engine("tiny:opt", "paged", num_slots=2048, max_model_len=256, swap_space=0.05)
    async_engine = AsyncEngine(engine)

    async def run(url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*(client.completions.create(
            model="tiny:opt", prompt=list(range(3 + i, 35 + i)), n=2, max_tokens=120, seed=i,
            extra_body={"ignore_eos": True}) for i in range(50)), return_exceptions=True)

    with serve_in_thread(build_app(async_engine, "tiny:opt")) as url:
        results = asyncio.run(run(url))
        failed = [r for r in results if isinstance(r, Exception)]
        assert not failed, f"{len(failed)} of 50 failed, e.g. {failed[0]!r}"
        assert all([len(c.token_ids) for c in r.choices] == [120, 120] for r in results)
        assert engine.scheduler.num_preemptions["swap"] > 0  # the memory pressure was real
        wait_idle(async_engine)
        metrics = {line.split("{")[0]: float(line.split()[-1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                   if line.startswith("vllm:")}
        assert metrics["vllm:num_preemptions_total"] == sum(engine.scheduler.num_preemptions.values())
        assert metrics["vllm:generation_tokens_total"] == 50 * 2 * 120
    assert_all_blocks_free(engine)


def test_without_swap_space_fifty_concurrent_n2_requests_are_all_served(one_thread):
    """The same load with no swap space (``--swap-space 0``): the groups of two samples that must be preempted cannot
    be swapped, so each is split and its samples recomputed one by one (``Scheduler._split_samples``), as vLLM 0.32
    serves them; every request gets its two full choices, streamed or not."""
    engine = load_engine("tiny:opt", "paged", num_slots=2048, max_model_len=256)
    async_engine = AsyncEngine(engine)

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(complete(client, {
                "prompt": list(range(3 + i, 35 + i)), "n": 2, "max_tokens": 120, "seed": i, "ignore_eos": True,
                "stream": i % 2 == 1}) for i in range(50)))

    with serve_in_thread(build_app(async_engine, "tiny:opt")) as url:
        results = asyncio.run(run(url))
        wait_idle(async_engine)
    for i, (status, body) in enumerate(results):
        assert status == 200, body
        if i % 2 == 1:
            assert body[-1] == "[DONE]" and not [c for c in body[:-1] if "error" in c]
            assert [len(t) for t in streamed_tokens(body).values()] == [120, 120]
        else:
            assert [(c["finish_reason"], len(c["token_ids"])) for c in body["choices"]] == [("length", 120)] * 2
    assert engine.scheduler.num_preemptions["recompute"] > 0 and engine.scheduler.num_preemptions["swap"] == 0
    assert_all_blocks_free(engine)


def test_n64_with_500_tokens_never_resident_at_once_is_served(one_thread):
    """64 samples of 500 tokens need about 2,100 blocks, a pool of 128 holds a few of them: the group is split into
    independent samples (no swap space), each recomputed from its own tokens when preempted; all 64 come back."""
    engine = load_engine("tiny:opt", "paged", num_slots=2048, max_model_len=1024)
    with serve_in_thread(build_app(AsyncEngine(engine), "tiny:opt")) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7, 8], "n": 64, "max_tokens": 500, "seed": 1,
                                                      "ignore_eos": True}, timeout=600)
    assert r.status_code == 200, r.text
    assert [(c["finish_reason"], len(c["token_ids"])) for c in r.json()["choices"]] == [("length", 500)] * 64
    assert engine.scheduler.num_preemptions["recompute"] > 0
    assert_all_blocks_free(engine)


def test_a_prompt_being_tokenized_does_not_hold_up_a_stream_in_flight(live, monkeypatch):
    """The tokenizer is held (as by a huge prompt) until a token-id stream has finished: that stream finishes all
    the same, because text is tokenized on its own thread, not the engine's. No timing decides it: the held request
    cannot finish before the gate opens, and the gate opens only once the other stream is done (or 60 s passed)."""
    client, url, async_engine, _ = live
    engine = async_engine.engine
    gate, entered = threading.Event(), threading.Event()
    real = type(engine.tokenizer).__call__

    def held(self, *args, **kw):
        entered.set()
        gate.wait(timeout=60)
        return real(self, *args, **kw)

    monkeypatch.setattr(type(engine.tokenizer), "__call__", held)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            slow = asyncio.create_task(http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 3}))
            while not entered.is_set() and not slow.done():
                await asyncio.sleep(0.01)
            assert entered.is_set(), "the text request never reached the tokenizer"
            chunks = []
            async with http.stream("POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 20,
                                                                     "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
            held_still = not slow.done()
            gate.set()
            return held_still, chunks, await slow

    try:
        held_still, chunks, slow = asyncio.run(run())
    finally:
        gate.set()
    assert held_still and sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 20
    assert slow.status_code == 200
    wait_idle(async_engine)


# the fields the fuzzer fills: every field the parser reads, and a few it must refuse
FIELDS = ["prompt", "model", "max_tokens", "temperature", "top_p", "n", "best_of", "seed", "stream", "stop",
          "stream_options", "logprobs", "top_k", "min_p", "min_tokens", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "use_beam_search",
          "echo", "logit_bias", "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt"]


BASES = [{"prompt": "the cat"}, {"prompt": [1, 2]}, {"prompt": ["a", [3]], "model": MODEL}]
CHAT_BASES = [{"messages": [{"role": "user", "content": "hi"}]}, {"messages": [{"role": "system", "content": ""}]},
              {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "model": MODEL}]


def _json_values():
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(min_value=-(2 ** 80), max_value=2 ** 80)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
               | st.sampled_from(["\ud800", "a\udfffb", "the cat", "\x00", "\n"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.sampled_from(FIELDS + ["role", "content", "type", "text"]), inner,
                                          max_size=4), max_leaves=12)


def _bodies():
    """Bodies of fuzzed fields, each value either plausible for its field (so that many requests are served) or any
    JSON value."""
    from hypothesis import strategies as st

    plausible = {
        "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
        "n": st.integers(1, 3), "best_of": st.integers(1, 3), "seed": st.integers(0, 2 ** 63), "stream": st.booleans(),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "logprobs": st.integers(0, 5),
        "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "min_tokens": st.integers(0, 2),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2), "stop_token_ids": st.lists(st.integers(0, 299), max_size=2),
        "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(), "use_beam_search": st.booleans(),
        "stream_options": st.just({"include_usage": True}), "top_logprobs": st.integers(0, 3)}
    junk = _json_values()
    names = [f for f in FIELDS if f not in ("prompt", "messages", "model")]  # the bases give those
    return st.lists(st.sampled_from(names), max_size=6, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({k: (plausible[k] | junk) if k in plausible else junk for k in names}))


def _encode(body) -> bytes:
    """JSON with lone surrogates kept as escapes (json.dumps writes them as \\udxxx; NaN as NaN, which Python's
    parser reads and a strict one would not), sometimes wrapped deep."""
    return json.dumps(body).encode()


def test_fuzzed_json_never_gets_a_500(live):
    """Hypothesis fills the request fields with any JSON: nested values, huge and non-finite numbers, lone
    surrogates, wrong types. Every answer is a 2xx or a 4xx with OpenAI's error object (never a 500), and the
    server still serves afterwards. Generation is kept short (max_tokens is at most 4 when it is valid)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    client, url, async_engine, _ = live
    http = httpx.Client(base_url=url, timeout=60)
    body_st = _bodies()
    junk_st = st.dictionaries(st.sampled_from(FIELDS), _json_values(), max_size=6)  # prompt, model too
    raw_st = st.sampled_from([b"", b"{", b"[" * 5000, b'{"prompt": ' * 3000, b"1e999999", b"9" * 5000,
                              b'{"prompt": "' + b"\\ud800" * 100 + b'"}', b"\xff\xfe", b"null", b'"str"'])

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(body=body_st | body_st | junk_st, base=st.sampled_from(range(3)),
           raw=st.none() | st.none() | st.none() | raw_st, chat=st.booleans(), depth=st.sampled_from([0, 0, 0, 1, 3]))
    def check(body, base, raw, chat, depth):
        body = {**(CHAT_BASES if chat else BASES)[base], **body}  # mostly valid requests, fuzzed fields
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
            body["max_tokens"] = max(-1, min(body["max_tokens"], 4))
        else:
            body.setdefault("max_tokens", 2)
        body["max_completion_tokens"] = None
        content = raw if raw is not None else _encode(body if depth == 0 else {"messages": [[body]] * depth})
        r = http.post("/v1/chat/completions" if chat else "/v1/completions", content=content,
                      headers={"content-type": "application/json"})
        assert r.status_code < 500, (content[:300], r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and err["type"], err
        elif not (isinstance(body, dict) and body.get("stream")):
            assert "choices" in r.json()

    try:
        check()
    finally:
        http.close()
    wait_idle(async_engine)
    assert client.completions.create(model=MODEL, prompt="the cat", max_tokens=2).choices


def test_fuzzed_bodies_parse_or_get_a_request_error():
    """The parsers alone, many more bodies: each becomes a checked request or a ``RequestError`` (a 4xx), never
    another exception (which the server would answer with a 500)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from pagedattn.openai_protocol import RequestError, fit_max_tokens, parse_chat, parse_completion

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(body=_bodies() | _json_values() | st.dictionaries(st.sampled_from(FIELDS), _json_values(), max_size=8),
           base=st.sampled_from(range(3)), chat=st.booleans(), prompt_len=st.integers(0, 300))
    def check(body, base, chat, prompt_len):
        if isinstance(body, dict):
            body = {**(CHAT_BASES if chat else BASES)[base], **body}
        try:
            req = (parse_chat if chat else parse_completion)(body, MODEL, 2000)
            params = fit_max_tokens(req, prompt_len, MAX_MODEL_LEN)
        except RequestError as e:
            assert 400 <= e.status < 500 and str(e)
            return
        assert params.max_tokens <= MAX_MODEL_LEN - prompt_len and req.prompts

    check()
