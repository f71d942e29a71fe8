"""What the CPU at hand is: its model name and feature flags, read once from Linux's ``/proc/cpuinfo``.

The one reader of ``/proc/cpuinfo`` (the kernels' build picks ISA variants from the flags, the tuner keys its
cache by them, benchmark reports name the CPU).  Below everything: imports nothing of speculant.  Elsewhere than
Linux the fields are empty and the model name is :func:`platform.processor` (or the machine type).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "fma", "f16c")
"""Flags a tune key lists by name (what our kernels and torch's pick code paths by)."""


@functools.lru_cache(maxsize=1)
def cpuinfo_fields() -> dict[str, str]:
    """The first value of every field of ``/proc/cpuinfo`` (``{"model name": ..., "flags": ...}``); ``{}`` where the
    file cannot be read."""
    fields: dict[str, str] = {}
    try:
        text = CPUINFO.read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    return fields


def flags_text() -> str:
    """The CPU's feature flags as the kernel lists them (``flags`` on x86, ``Features`` on ARM; ``""`` if unknown)."""
    fields = cpuinfo_fields()
    return fields.get("flags") or fields.get("Features") or ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``{"avx2", "fma", ...}``; empty if unknown)."""
    return set(flags_text().split())


def cpu_model() -> str:
    """The CPU's model name (``model name`` of ``/proc/cpuinfo``, else :func:`platform.processor`, else the
    machine type)."""
    return cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def describe() -> dict:
    """``{"model", "flags_sha1", "isa", "cores"}``: the model name, a digest of the flags, the :data:`ISA_FLAGS` the
    CPU has (sorted) and the core count."""
    text = flags_text()
    have = sorted(f for f in text.split() if f in ISA_FLAGS)
    return {"model": cpu_model(), "flags_sha1": hashlib.sha1(text.encode()).hexdigest()[:12], "isa": have,
            "cores": os.cpu_count()}
