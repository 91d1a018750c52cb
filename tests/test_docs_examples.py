"""Every ```python block of README.md and docs/**/*.md runs, on the CPU.

The blocks of one page run in order in one namespace, in a child process of their own (a page may set up a
process group or patch a model class). A block right after ``<!-- skip: REASON -->`` does not run (it needs a
GPU, several GPUs or a file the page does not make); a page's blocks after ``<!-- also: world_size=N -->``
run a second time as N processes over gloo (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set).
A page with ``<!-- requires: MODULE -->`` is skipped where MODULE does not import (e.g. megatron.core).
"""
import importlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import packcuda

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
MARK = re.compile(r"<!--\s*(skip|also):\s*(.*?)\s*-->\s*$")
REQUIRES = re.compile(r"<!--\s*requires:\s*(\S+)\s*-->")

RUNNER = r"""
import json, sys
blocks = json.loads(open(sys.argv[1]).read())
ns = {"__name__": "__main__"}
for where, code in blocks:
    exec(compile(code, where, "exec"), ns)
import torch.distributed as dist
if dist.is_available() and dist.is_initialized():  # a page that made a process group: leave it cleanly
    dist.barrier()
    dist.destroy_process_group()
# every block ran and checked what it shows: leave without the interpreter's teardown, where a background thread
# of torch's process groups can abort an exiting process ("terminate called without an active exception")
import os
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def blocks(page: Path):
    """(where, code, marker, marker value) of every python block of a page."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        line = text.count("\n", 0, m.start()) + 2
        out.append((f"{page.relative_to(ROOT)}:{line}", m.group(1), *(mark.groups() if mark else (None, None))))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code_blocks, tmp_path, world_size=1):
    """Runs the blocks in ``world_size`` child processes (CPU only: no CUDA device is visible)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world_size), PYTHONPATH=os.pathsep.join(
                   [str(Path(packcuda.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    payload = tmp_path / "blocks.json"
    payload.write_text(json.dumps([(where, code) for where, code, *_ in code_blocks]))
    procs = [subprocess.Popen([sys.executable, "-c", RUNNER, str(payload)], cwd=tmp_path,
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world_size)]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of {world_size}:\n{out[-6000:]}"


def test_skip_markers_are_few_and_say_why():
    marked = [(w, v) for page in PAGES for w, _, kind, v in blocks(page) if kind == "skip"]
    assert all(v for _, v in marked), marked
    total = sum(len(blocks(page)) for page in PAGES)
    assert len(marked) * 5 <= total, f"{len(marked)} of {total} blocks do not run: {marked}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run(page, tmp_path):
    runnable = [b for b in blocks(page) if b[2] != "skip"]
    if not runnable:
        pytest.skip("no runnable python block")
    for module in REQUIRES.findall(page.read_text()):
        try:
            importlib.import_module(module)
        except ImportError:
            pytest.skip(f"needs {module}")
    _run(runnable, tmp_path)
    for value in sorted({value for _, _, kind, value in runnable if kind == "also"}):
        _run(runnable, tmp_path, world_size=int(re.fullmatch(r"world_size=(\d+)", value).group(1)))
