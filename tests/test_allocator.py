"""The allocator setting: a freed large tensor's memory is reused without new page faults, and
`DSPARK_SYSTEM_MALLOC=1` (the negative control) leaves glibc mapping it afresh every time."""

import json
import os
import subprocess
import sys

import pytest

from dspark.allocator import _glibc

PROBE = r"""
import json, resource, torch
from dspark.allocator import keep_freed_memory
applied = keep_freed_memory()
size = 64 * 2**20 // 4  # 64 MiB of float32: above glibc's largest mmap threshold (32 MiB)
for _ in range(8):      # allocated, touched, freed: the heap settles within a few
    torch.ones(size)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    torch.ones(size)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults}))
"""

PAGES_PER_TENSOR = 64 * 2**20 // 4096


def probe(**env: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(_glibc() is None, reason="mallopt is glibc's")
def test_freed_memory_is_reused_without_page_faults():
    kept = probe(DSPARK_SYSTEM_MALLOC="0")
    system = probe(DSPARK_SYSTEM_MALLOC="1")
    assert kept["applied"] and not system["applied"]
    # the system allocator maps and faults in every page of every one of the 8 tensors again; kept, the
    # heap serves them from memory it already has (at most one more tensor's worth while it settles)
    assert system["faults"] > 7 * PAGES_PER_TENSOR
    assert kept["faults"] < 2 * PAGES_PER_TENSOR


def test_the_command_line_applies_it_before_the_command_runs(monkeypatch, tmp_path):
    import dspark.cli

    calls = []
    monkeypatch.setattr(dspark.cli, "keep_freed_memory", lambda: calls.append(True) or True)
    assert dspark.cli.main(["generate", "hi", "--target", str(tmp_path / "missing")]) == 2
    assert calls == [True]
