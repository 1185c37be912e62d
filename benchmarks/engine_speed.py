"""The real engine's speed, this tree against another commit's, side by side (issue 49: a refactor of the engine core
must not slow it down).

Each round runs, in a fresh subprocess per tree (``PYTHONPATH`` at that tree's ``src``; the trees in alternating
order, so that load on a shared machine hits both alike), ``LLM.generate`` of ``--batch`` random-token prompts of
``--prompt-len`` tokens, each generating exactly ``--output-len`` tokens (greedy, EOS ignored), on the tiny GQA Llama
of ``benchmarks/engine_vs_hf.py`` with one torch thread, after a warm-up; ``--repeat`` calls per child, the fastest
counts. Times are the child's CPU seconds (``time.process_time``), which other processes disturb less than the wall
clock. The fastest time over the rounds is reported for each tree, the ratio of the two the speed-up; both trees must
generate the same tokens.

    python benchmarks/engine_speed.py --baseline 52a1c24 --rounds 5 [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from pagedattn.repro.report.calibration import tree_env  # noqa: E402  (a commit's tree in a subprocess)

CHILD = """
import hashlib, json, time
import torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM
from pagedattn import LLM, SamplingParams
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**{model!r})).eval()
gen = torch.Generator().manual_seed(1)
prompts = [torch.randint(1, {vocab}, ({prompt_len},), generator=gen).tolist() for _ in range({batch})]
params = SamplingParams(temperature=0, max_tokens={output_len}, ignore_eos=True)
llm = LLM(model, max_num_seqs={batch})
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
best = float("inf")
for _ in range({repeat}):
    t = time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    best = min(best, time.process_time() - t)
tokens = [o.outputs[0].token_ids for o in outs]
print(json.dumps({{"cpu_s": best, "tokens": sum(map(len, tokens)),
                  "digest": hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]}}))
"""


def run(src: Path, a: argparse.Namespace) -> dict:
    from engine_vs_hf import MODEL

    env = tree_env(src)
    child = CHILD.format(model=MODEL, vocab=MODEL["vocab_size"], prompt_len=a.prompt_len, batch=a.batch,
                         output_len=a.output_len, repeat=a.repeat)
    out = subprocess.run([sys.executable, "-c", child], env=env, check=True, capture_output=True, text=True,
                         cwd=str(REPO)).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from pagedattn.repro.report.results import hardware_label, today, write_benchmark
    from sim_speed import export

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2, help="generate calls per child (its fastest counts)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--out", default=None, help="JSON to write (default: results/benchmarks/engine_speed.json)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = export(a.baseline, Path(tmp))
        times: dict[str, list[float]] = {"baseline": [], "this": []}
        digests = set()
        for r in range(a.rounds):
            order = [("baseline", base), ("this", REPO)] if r % 2 == 0 else [("this", REPO), ("baseline", base)]
            for name, src in order:
                res = run(src, a)
                times[name].append(res["cpu_s"])
                digests.add(res["digest"])
            print(f"round {r + 1}: baseline {times['baseline'][-1]:.3f} s, this tree {times['this'][-1]:.3f} s",
                  flush=True)
    if len(digests) != 1:
        raise SystemExit(f"the trees generated different tokens: {sorted(digests)}")
    speedup = min(times["baseline"]) / min(times["this"])
    print(f"generate: baseline {min(times['baseline']):.3f} s, this tree {min(times['this']):.3f} s: {speedup:.2f}x")
    write_benchmark({"benchmark": "engine_speed", "hardware": hardware_label(), "date": today(),
                     "baseline": a.baseline, "rounds": a.rounds, "repeat": a.repeat, "batch": a.batch,
                     "prompt_len": a.prompt_len, "output_len": a.output_len, "baseline_cpu_s": times["baseline"],
                     "cpu_s": times["this"], "speedup": speedup, "load_average": list(os.getloadavg())},
                    "engine_speed", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
