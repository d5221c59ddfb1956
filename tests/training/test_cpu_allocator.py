"""runtime/cpu_allocator.py: after keep_freed_memory(), a freed step-sized buffer is reused, not unmapped
and page-faulted in again on the next step."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import resource, torch
from runtime.cpu_allocator import keep_freed_memory

def faults_per_cycle(cycles=8, mib=96):
    n = mib * 2**20 // 4
    torch.empty(n).fill_(1.0)  # first touch, not counted
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(cycles):
        torch.empty(n).fill_(1.0)  # allocated, every page written, freed
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / cycles

default = faults_per_cycle()
applied = keep_freed_memory()
faults_per_cycle()  # the heap grows to the working set first (a few steps of a training run)
kept = faults_per_cycle()
print(default, applied, kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tunables")
def test_freed_buffers_are_reused_instead_of_faulted_in_again():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    default, applied, kept = float(out[0]), out[1], float(out[2])
    pages = 96 * 2**20 / 4096
    assert applied == "True"
    assert default > 0.5 * pages  # glibc's default: a 96 MiB block is mmap-ed and faulted in every time
    assert kept < 0.05 * pages  # kept in the heap: reused without new page faults
