"""Names the machine a measurement ran on: its CPU and the instruction sets that decide torch's kernels there, the
CPUs and threads the process may use, its GPUs, and torch's build.

A speed is a fact about one machine: a bfloat16 matmul runs on AMX, on AVX-512 BF16 or on a float32 fallback, and
MKL, oneDNN and OpenBLAS take different paths at the same shape. `machine_info()` is what the demo and the benchmark
print beside their numbers and write into their results, so that no comparison mixes machines unawares;
`machine_summary()` is its one line.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# The instruction sets that change which kernels torch runs on a CPU, by their /proc/cpuinfo flag, with the name the
# summary gives them.
ISA_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX-512-BF16",
    "avx_vnni": "AVX-VNNI",
    "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16",
}

# torch's `BLAS_INFO` build setting, by the name its library goes by.
BLAS_NAMES = {"mkl": "MKL", "open": "OpenBLAS", "openblas": "OpenBLAS", "accelerate": "Accelerate", "blis": "BLIS"}


def parse_cpuinfo(text: str | None) -> dict:
    """The first processor of a /proc/cpuinfo text: ``model_name``, ``vendor``, ``family``, ``model`` (strings, or
    None when the text lacks them) and ``isa`` (`ISA_FLAGS` flag -> present), or ``isa=None`` when the text has no
    flag list (``text=None``: no /proc/cpuinfo, a machine that is not Linux)."""
    fields: dict[str, str] = {}
    for line in (text or "").splitlines():
        if not line.strip():
            if fields:  # the first processor's block is enough: every core of a machine reports the same
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    # x86 lists "flags"; ARM lists "Features" and names no model
    flags = fields.get("flags", fields.get("features"))
    present = set(flags.split()) if flags is not None else None
    return {
        "model_name": fields.get("model name") or fields.get("hardware"),
        "vendor": fields.get("vendor_id") or fields.get("cpu implementer"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "isa": None if present is None else {flag: flag in present for flag in ISA_FLAGS},
    }


def parse_torch_config(text: str) -> dict:
    """What ``torch.__config__.show()`` says of the CPU math libraries: ``blas`` (its BLAS, e.g. ``"MKL"``, or None
    when the text does not say) and ``onednn_version`` (None when it names none). A build lists these as free text,
    so a missing or reworded line gives None, never an error."""
    blas = re.search(r"BLAS_INFO=([A-Za-z0-9_]+)", text)
    onednn = re.search(r"(?:MKL-DNN|oneDNN)\s+v?(\d+(?:\.\d+)*)", text)
    return {
        "blas": BLAS_NAMES.get(blas.group(1).lower(), blas.group(1)) if blas else None,
        "onednn_version": onednn.group(1) if onednn else None,
    }


def _read_cpuinfo() -> str | None:
    try:
        return CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _torch_info() -> dict:
    import torch

    try:
        build = parse_torch_config(torch.__config__.show())
    except Exception:  # a build without the config text still names its version
        build = {"blas": None, "onednn_version": None}
    cpu_capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
    return {
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "blas": build["blas"],
        "mkl": torch.backends.mkl.is_available(),
        "onednn": torch.backends.mkldnn.is_available(),
        "onednn_version": build["onednn_version"],
        "cpu_capability": cpu_capability() if cpu_capability is not None else None,
        "gpus": gpus,
    }


def machine_info(cpuinfo: str | None = None) -> dict:
    """The machine this process runs on, as a JSON-ready dict: the CPU (`parse_cpuinfo` of ``cpuinfo``, by default
    this machine's /proc/cpuinfo), the logical CPUs the process may run on (``cpus``, its affinity) and has
    (``cpus_total``), torch's threads, version and math libraries (``cpu_capability``: the instruction set torch's
    own kernels dispatch to), the GPUs torch sees, and Python and the platform."""
    cpu = parse_cpuinfo(cpuinfo if cpuinfo is not None else _read_cpuinfo())
    if cpu["model_name"] is None:
        cpu["model_name"] = platform.processor() or None
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        **cpu,
        "cpus": len(affinity(0)) if affinity is not None else os.cpu_count(),
        "cpus_total": os.cpu_count(),
        **_torch_info(),
        "python": platform.python_version(),
        "platform": f"{sys.platform} {platform.machine()}",
    }


def machine_summary(info: dict) -> str:
    """One line for a report: ``AMD EPYC (family 26 model 2), AVX2 AVX-512 AVX-512-BF16 AVX-VNNI, no AMX; 2 CPUs,
    2 torch threads; torch 2.13.0+cpu (MKL, oneDNN 3.12.0, kernels AVX512)``, with the GPUs when there are any."""
    cpu = info.get("model_name") or "unknown CPU"
    if info.get("family") is not None and info.get("model") is not None:
        cpu += f" (family {info['family']} model {info['model']})"
    isa = info.get("isa")
    if isa is None:
        features = "instruction sets unknown"
    else:
        present = [name for flag, name in ISA_FLAGS.items() if isa.get(flag)]
        # AMX-BF16 only ever comes with AMX: its absence says nothing more
        absent = [name for flag, name in ISA_FLAGS.items() if not isa.get(flag) and flag != "amx_bf16"]
        features = " ".join(present) or "none of " + " ".join(ISA_FLAGS.values())
        if present and absent:
            features += ", no " + " ".join(absent)
    cpus, total, threads = info.get("cpus"), info.get("cpus_total"), info.get("torch_threads")
    cpus = f"{cpus} of {total} CPUs" if total not in (None, cpus) else _count(cpus, "CPU")
    libraries = [info["blas"]] if info.get("blas") else []
    if info.get("onednn"):
        libraries.append("oneDNN" + (f" {info['onednn_version']}" if info.get("onednn_version") else ""))
    if info.get("cpu_capability"):
        libraries.append(f"kernels {info['cpu_capability']}")
    torch_part = f"torch {info.get('torch_version')}" + (f" ({', '.join(libraries)})" if libraries else "")
    line = f"{cpu}, {features}; {cpus}, {_count(threads, 'torch thread')}; {torch_part}"
    if info.get("gpus"):
        line += "; GPU " + ", ".join(info["gpus"])
    return line


def _count(number, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")
