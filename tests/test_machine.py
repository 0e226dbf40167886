"""`adaflash_hf.machine` on fake /proc/cpuinfo texts (an AMX Xeon, an AVX-512 EPYC, an AVX2-only desktop, an ARM
server, no file at all) and fake `torch.__config__.show()` texts, and its one-line summary."""

import json

from adaflash_hf.machine import machine_info, machine_summary, parse_cpuinfo, parse_torch_config

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx avx2 avx512f avx512bw avx_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: a second processor, never read
flags\t\t: fpu
"""

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
flags\t\t: fpu avx avx2 avx512f avx512dq avx_vnni avx512_bf16 avx512_vnni
"""

DESKTOP = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 158
model name\t: Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz
flags\t\t: fpu avx avx2 fma
"""

ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes sve
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""

TORCH_CONFIG = """PyTorch built with:
  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)
  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=mkl, USE_MKL=ON, USE_MKLDNN=ON,
"""


def test_cpuinfo_gives_the_first_processors_model_and_the_instruction_sets_that_matter():
    xeon = parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert xeon["model_name"] == "Intel(R) Xeon(R) Platinum 8480+" and xeon["vendor"] == "GenuineIntel"
    assert (xeon["family"], xeon["model"]) == ("6", "143")
    assert all(xeon["isa"].values())  # every flag that matters, AMX included
    epyc = parse_cpuinfo(EPYC)["isa"]
    assert epyc == {
        "avx2": True,
        "avx512f": True,
        "avx512_bf16": True,
        "avx_vnni": True,
        "amx_tile": False,
        "amx_bf16": False,
    }
    assert not any(flag for name, flag in parse_cpuinfo(DESKTOP)["isa"].items() if name != "avx2")
    arm = parse_cpuinfo(ARM)
    assert arm["model_name"] is None and arm["vendor"] == "0x41" and not any(arm["isa"].values())
    # no /proc/cpuinfo (not Linux) or an empty one: nothing is known, nothing is claimed absent
    for text in (None, ""):
        assert parse_cpuinfo(text) == {"model_name": None, "vendor": None, "family": None, "model": None, "isa": None}


def test_torch_config_names_its_blas_and_onednn_and_tolerates_text_it_does_not_know():
    assert parse_torch_config(TORCH_CONFIG) == {"blas": "MKL", "onednn_version": "3.12.0"}
    assert parse_torch_config("  - oneDNN v3.5\n  BLAS_INFO=open,") == {"blas": "OpenBLAS", "onednn_version": "3.5"}
    assert parse_torch_config("something else entirely") == {"blas": None, "onednn_version": None}


def test_machine_info_is_json_ready_and_its_summary_names_what_decides_the_speed():
    info = machine_info(EPYC)
    assert json.loads(json.dumps(info)) == info
    assert info["model_name"] == "AMD EPYC" and info["isa"]["avx512_bf16"] and not info["isa"]["amx_tile"]
    assert info["cpus"] >= 1 and info["torch_threads"] >= 1 and info["torch_version"]
    assert isinstance(info["mkl"], bool) and isinstance(info["onednn"], bool) and isinstance(info["gpus"], list)
    fixed = {
        **info,
        "cpus": 2,
        "cpus_total": 2,
        "torch_threads": 2,
        "torch_version": "2.13.0",
        "blas": "MKL",
        "onednn": True,
        "onednn_version": "3.12.0",
        "cpu_capability": "AVX512",
        "gpus": [],
    }
    assert machine_summary(fixed) == (
        "AMD EPYC (family 26 model 2), AVX2 AVX-512 AVX-512-BF16 AVX-VNNI, no AMX; 2 CPUs, 2 torch threads; "
        "torch 2.13.0 (MKL, oneDNN 3.12.0, kernels AVX512)"
    )
    pinned = {**fixed, "cpus": 1, "torch_threads": 1, "gpus": ["NVIDIA H200"]}
    assert "; 1 of 2 CPUs, 1 torch thread; " in machine_summary(pinned)
    assert machine_summary(pinned).endswith("; GPU NVIDIA H200")
    desktop = machine_summary({**fixed, **parse_cpuinfo(DESKTOP)})
    assert ", AVX2, no AVX-512 AVX-512-BF16 AVX-VNNI AMX; " in desktop
    assert machine_summary({**fixed, **parse_cpuinfo(SAPPHIRE_RAPIDS)}).startswith(
        "Intel(R) Xeon(R) Platinum 8480+ (family 6 model 143), AVX2 AVX-512 AVX-512-BF16 AVX-VNNI AMX AMX-BF16; "
    )
    unknown = machine_summary({**fixed, **parse_cpuinfo(None), "blas": None, "onednn": False, "cpu_capability": None})
    assert unknown == "unknown CPU, instruction sets unknown; 2 CPUs, 2 torch threads; torch 2.13.0"
