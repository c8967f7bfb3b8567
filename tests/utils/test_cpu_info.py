"""/proc/cpuinfo parsed in one place (verl_arpo/utils/cpu_info.py): the vendor of the first processor, the
flags of all of them, nothing where there is no such file; the SIMD flags in their fixed order."""
from verl_arpo.utils import cpu_info
from verl_arpo.utils.cpu_info import SIMD_FLAGS, cpu_vendor_and_flags, read_cpu_vendor_and_flags, simd_flags
from verl_arpo.utils.device import cpu_has_fast_bf16

# two processors, as the kernel writes them; the second lists a flag the first does not
ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "flags\t\t: fpu sse2 avx fma avx2 avx512f\n\n"
        "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16\n")
INTEL_VMX = ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 fma amx_tile amx_bf16\n"
             "vmx flags\t: vnmi ept\n")
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes\nCPU implementer\t: 0x41\n"


def test_the_first_vendor_and_every_processors_flags():
    assert cpu_vendor_and_flags(ZEN4) == ("AuthenticAMD", {"fpu", "sse2", "avx", "fma", "avx2", "avx512f", "avx512_bf16"})
    # "vmx flags" is another line: its words are not CPU flags
    assert cpu_vendor_and_flags(INTEL_VMX) == ("GenuineIntel", {"fpu", "avx2", "fma", "amx_tile", "amx_bf16"})
    assert cpu_vendor_and_flags(ARM) == (None, set())
    assert cpu_vendor_and_flags("") == (None, set())


def test_simd_flags_in_their_order_and_nothing_without_the_file(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text(INTEL_VMX)
    assert SIMD_FLAGS.index("avx2") < SIMD_FLAGS.index("fma") < SIMD_FLAGS.index("amx_bf16") < SIMD_FLAGS.index("amx_tile")
    assert simd_flags(info) == ["avx2", "fma", "amx_bf16", "amx_tile"]
    assert read_cpu_vendor_and_flags(tmp_path / "missing") == (None, set()) and simd_flags(tmp_path / "missing") == []
    # this machine's file is the default, and the precision pick reads the same flags
    monkeypatch.setattr(cpu_info, "CPUINFO", info)
    assert simd_flags() == ["avx2", "fma", "amx_bf16", "amx_tile"] and cpu_has_fast_bf16()
    monkeypatch.setattr(cpu_info, "CPUINFO", tmp_path / "missing")
    assert simd_flags() == [] and not cpu_has_fast_bf16()
