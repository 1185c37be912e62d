"""``make lab``: JupyterLab on ``notebooks/`` with the project's kernel, ``pagedattn (.venv)``, as the default.

The notebooks are the project's first interface (the guided tour's live block-pool view, paper §4.2-§4.4, runs only
with a kernel behind it). ``make venv`` registers the kernel spec in the virtual environment
(``ipykernel install --sys-prefix --name pagedattn``); every notebook's metadata names it, so each opens with it, and
the server's default kernel (a new notebook, the API's default) is the same one. Extra arguments go to JupyterLab,
e.g. ``python -m pagedattn.repro.report.lab --no-browser --ServerApp.port=8899``; the tests start it so, on a root and port of their
own.
"""
from __future__ import annotations

import os
import sys

from pagedattn.repro.report.results import REPO_ROOT

KERNEL_NAME = "pagedattn"
KERNEL_DISPLAY_NAME = "pagedattn (.venv)"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"


def kernel_spec_problem() -> str | None:
    """None when the project's kernel spec is registered under its display name, else what is wrong."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        return f"no Jupyter kernel spec named {KERNEL_NAME!r}: run `make venv` to register it"
    if spec.display_name != KERNEL_DISPLAY_NAME:
        return f"kernel spec {KERNEL_NAME!r} is named {spec.display_name!r}, not {KERNEL_DISPLAY_NAME!r}"
    return None


def lab_argv(*extra: str) -> list[str]:
    """The command line of the ``make lab`` server: JupyterLab on ``notebooks/``, bound to 127.0.0.1, the project's
    kernel as default (``--allow-root`` when run as root, as in a container). ``extra`` arguments are appended; one
    that sets a default's option (``--ServerApp.root_dir=...``, ``--ip=...``) replaces that default."""
    defaults = {("--ServerApp.root_dir=", "--root-dir=", "--notebook-dir="): str(NOTEBOOKS_DIR),
                ("--ServerApp.ip=", "--ip="): "127.0.0.1",
                ("--MappingKernelManager.default_kernel_name=",): KERNEL_NAME}
    argv = [sys.executable, "-m", "jupyterlab"]
    argv += [names[0] + value for names, value in defaults.items() if not any(a.startswith(names) for a in extra)]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in extra:
        argv.append("--allow-root")
    return argv + list(extra)


def main(argv: list[str] | None = None) -> int:
    problem = kernel_spec_problem()
    if problem:
        print(f"make lab: {problem}", file=sys.stderr)
        return 2
    args = lab_argv(*(sys.argv[1:] if argv is None else argv))
    os.execv(args[0], args)
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
