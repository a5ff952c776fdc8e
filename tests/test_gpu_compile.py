"""The CUDA kernels compile without a GPU, report their resources, and check their inputs.

Runs on every machine: NVRTC (pip wheels) compiles each kernel for sm_80 and sm_90 and
its ptxas report gives registers and shared memory; a compile error fails the suite.
The launchers' input checks, the trace comparison and the bfloat16 helpers are plain
Python and are tested here too. The kernels' numbers are in tests/test_gpu_kernels.py.
"""
import os
import re
from pathlib import Path

import numpy as np
import pytest

import lessons
import lessons.gpu as gpu
from lessons.gpu import source
from lessons.gpu import compile as compile_mod
from lessons.gpu.compile import FROM_DEVICE, FROM_NVRTC, FROM_PTXAS, NOT_REPORTED, parse_ptxas_log

# CI must compile the kernels (CuPy + NVRTC are in the [test] extra): there a missing
# CuPy is a failure. Elsewhere it is a skip with the install command.
if not os.environ.get("CI"):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                        reason="CuPy/NVRTC not installed: pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12")

ARCHS = ("sm_80", "sm_90")
ROOT = Path(__file__).resolve().parents[1]

# Every kernel file in every storage dtype, with and without the trace build, at the
# default head dim; then the head dims the tests use, to catch a configuration that
# only breaks at some d (unrolling, register arrays, shared-memory sizes).
BUILDS = [
    source.online_softmax_build(256, "float32"),
    source.online_softmax_build(256, "float16", trace=True),
    source.online_softmax_build(128, "bfloat16"),
    source.flash_attention_build(128, "float32", trace=True),
    source.flash_attention_build(128, "float16"),
    source.flash_attention_build(128, "bfloat16", trace=True),
    source.paged_decode_build(128, 16, 32, 8, "float32"),
    source.paged_decode_build(128, 16, 32, 8, "float16", trace=True),
    source.paged_decode_build(128, 16, 32, 8, "bfloat16"),
    source.flash_attention_mma_build(128, "float16", trace=True),
    source.flash_attention_mma_build(128, "bfloat16"),
]
HEAD_DIM_BUILDS = [source.flash_attention_build(d, "float16") for d in (1, 3, 64, 80, 256)] + [
    source.paged_decode_build(d, 16, 8, 1, "float16") for d in (1, 80, 256)] + [
    source.flash_attention_mma_build(d, dtype) for d in (16, 64, 80, 256) for dtype in ("float16", "bfloat16")]
#: entry points that declare no shared memory
NO_SMEM = {"merge_splits", "mma_probe", "flash_attention_backward_preprocess"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: b.describe())
def test_kernel_compiles_with_nvrtc(build, arch):
    compiled = gpu.compile_kernel(build, arch)
    assert compiled.cubin[:4] == b"\x7fELF"                 # a real cubin for that architecture
    assert set(compiled.resources) == set(build.entries)
    for r in compiled.resources.values():
        assert r.arch == arch
        assert r.reported and r.source in (FROM_NVRTC, FROM_PTXAS), r.reason
        assert 1 <= r.registers <= 255
        assert r.smem_bytes == (0 if r.entry in NO_SMEM else build.smem_bytes)
    assert ("--no-cache" in compiled.options) == (gpu.compile.nvrtc_version() >= (12, 9))


@pytest.mark.parametrize("build", HEAD_DIM_BUILDS, ids=lambda b: b.describe())
def test_every_head_dim_compiles_with_at_most_a_few_spilled_bytes(build):
    compiled = gpu.compile_kernel(build, "sm_90")
    for r in compiled.resources.values():
        assert r.smem_bytes <= 48 * 1024
        # the state o lives in registers: at some sizes ptxas parks one or two rarely used
        # 64-bit values in local memory (a few bytes), never the per-column accumulators
        assert r.spill_store_bytes <= 32 and r.spill_load_bytes <= 32, r


def test_compile_report_covers_every_kernel_and_arch():
    rows = gpu.compile_report()
    # every kernel file but the Hopper rungs', which compile for sm_90a only (tests/test_gpu_wgmma.py)
    entries = [e for kernel, es in gpu.KERNELS.items() if kernel not in source.WGMMA_KERNELS for e in es]
    assert sorted((r.entry, r.arch) for r in rows) == sorted((e, a) for e in entries for a in ARCHS)
    builds = {b.kernel: b for b in source.default_builds()}
    for r in rows:
        expected = 0 if r.entry in NO_SMEM else builds[r.kernel].entry_smem_bytes(r.entry)
        assert r.smem_bytes == expected, r
        assert r.stack_bytes == 0 and r.spill_bytes == 0, r
        on_device = gpu.device_available() and r.arch == gpu.device_arch()
        assert r.source == (FROM_DEVICE if on_device else FROM_NVRTC), r
    table = gpu.compile_report_table(rows)
    assert table.row_count == len(rows)
    # use_device=False: ptxas's numbers only, whatever the machine (the device is a fact about the run)
    assert {r.source for r in gpu.compile_report(use_device=False)} == {FROM_NVRTC}


def test_gpu_status_is_one_plain_sentence():
    status = gpu.gpu_status()
    assert "\n" not in status
    if gpu.device_available():
        assert status.startswith("CUDA kernels compiled for sm_80/sm_90 with NVRTC") and " run on " in status
    else:
        assert re.fullmatch(r"CUDA kernels compiled for sm_80/sm_90 with NVRTC [\d.]+, but not run: no CUDA device",
                            status)


def test_a_compile_error_is_reported_with_the_log():
    bad = gpu.KernelBuild.make("flash_attention", "float32", HEAD_DIM=64, BLOCK_Q=48, BLOCK_K=16)
    with pytest.raises(gpu.KernelCompileError, match="BLOCK_Q must divide 128"):
        gpu.compile_kernel(bad, "sm_90")


def test_standalone_ptxas_agrees_on_shared_memory():
    ptxas = gpu.find_ptxas()
    if ptxas is None:
        pytest.skip("no standalone ptxas (pip install nvidia-cuda-nvcc-cu12 or a CUDA toolkit)")
    build = source.flash_attention_build(64, "float16")
    theirs = gpu.ptxas_resources(build, "sm_90", ptxas)["flash_attention_forward"]
    ours = gpu.compile_kernel(build, "sm_90").resources["flash_attention_forward"]
    assert theirs["smem_bytes"] == ours.smem_bytes == source.flash_attention_smem_bytes(64, 64, 32)
    assert 1 <= theirs["registers"] <= 255


# ---------------------------------------------------------------------------
# a missing resource report is never a failed compile
# ---------------------------------------------------------------------------

class QuietNvrtc:
    """NVRTC whose program log is empty, as NVRTC 13 returned it on a compile-cache hit
    while several processes compiled the same kernels (the ptxas -v lines missing)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def getProgramLog(self, prog):
        return ""


@pytest.fixture
def fresh_caches():
    """Compile results computed in the test are dropped afterwards (they may hold made-up faults)."""
    for cached in (compile_mod.compile_kernel, compile_mod._standalone_report):
        cached.cache_clear()
    yield
    for cached in (compile_mod.compile_kernel, compile_mod._standalone_report):
        cached.cache_clear()


@pytest.fixture
def quiet_nvrtc(monkeypatch, fresh_caches):
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", "off")      # a made-up log must neither come from nor go to disk
    real = compile_mod._nvrtc()
    monkeypatch.setattr(compile_mod, "_nvrtc", lambda: QuietNvrtc(real))


def test_an_empty_ptxas_log_falls_back_to_the_standalone_ptxas(quiet_nvrtc):
    if gpu.find_ptxas() is None:
        pytest.skip("no standalone ptxas (pip install nvidia-cuda-nvcc-cu12 or a CUDA toolkit)")
    build = source.flash_attention_build(64, "float16")
    compiled = gpu.compile_kernel(build, "sm_90")
    assert compiled.log == "" and compiled.cubin[:4] == b"\x7fELF"
    r = compiled.resources["flash_attention_forward"]
    assert r.source == FROM_PTXAS and r.reason is None
    assert r.smem_bytes == source.flash_attention_smem_bytes(64, 64, 32) and 1 <= r.registers <= 255


def test_with_no_report_at_all_the_numbers_say_not_reported_and_why(quiet_nvrtc, monkeypatch):
    monkeypatch.setattr(compile_mod, "find_ptxas", lambda: None)
    build = source.paged_decode_build(64, 16, 8, 2, "float32")
    rows = gpu.compile_report(("sm_80", "sm_90"), builds=[build], use_device=False)   # no KernelCompileError
    assert len(rows) == 2 * len(build.entries)
    for r in rows:
        assert not r.reported and r.source is None
        assert (r.registers, r.smem_bytes, r.stack_bytes, r.spill_bytes) == (None, None, None, None)
        assert "NVRTC's log held no ptxas report" in r.reason and "no standalone ptxas was found" in r.reason
    table = gpu.compile_report_table(rows)
    cells = [list(c.cells) for c in table.columns]
    assert set(cells[4]) == {NOT_REPORTED} and set(cells[-1]) == {NOT_REPORTED}
    assert "no standalone ptxas was found" in str(table.caption)


def test_a_real_compile_error_is_still_an_error_with_a_quiet_log(quiet_nvrtc):
    bad = gpu.KernelBuild.make("flash_attention", "float32", HEAD_DIM=64, BLOCK_Q=48, BLOCK_K=16)
    with pytest.raises(gpu.KernelCompileError, match="NVRTC could not compile"):
        gpu.compile_kernel(bad, "sm_90")


class FakeKernel:
    def __init__(self, attributes):
        self.attributes = attributes


class FakeModule:
    """What CuPy's RawModule gives for a loaded kernel: get_function(name).attributes."""

    def __init__(self, attributes):
        self._attributes = attributes
        self.asked = []

    def get_function(self, entry):
        self.asked.append(entry)
        if isinstance(self._attributes, Exception):
            raise self._attributes
        return FakeKernel({"num_regs": self._attributes[entry][0], "shared_size_bytes": self._attributes[entry][1],
                           "local_size_bytes": self._attributes[entry][2], "max_threads_per_block": 1024})


def pretend_device(monkeypatch, module, arch="sm_90"):
    monkeypatch.setattr(compile_mod, "device_available", lambda: True)
    monkeypatch.setattr(compile_mod, "device_arch", lambda: arch)
    monkeypatch.setattr(compile_mod, "device_module", lambda build: module)


def test_with_a_device_its_own_architecture_is_read_from_the_loaded_kernel(monkeypatch):
    build = source.paged_decode_build(64, 16, 8, 2, "float32")
    module = FakeModule({"paged_decode": (40, 4000, 0), "paged_decode_split": (48, 4100, 16),
                         "merge_splits": (20, 0, 0)})
    pretend_device(monkeypatch, module)
    rows = {(r.entry, r.arch): r for r in gpu.compile_report(ARCHS, builds=[build])}
    assert sorted(module.asked) == sorted(build.entries)                   # once per entry, for sm_90 only
    device = rows[("paged_decode", "sm_90")]
    assert (device.source, device.registers, device.smem_bytes, device.stack_bytes) == (FROM_DEVICE, 40, 4000, 0)
    assert device.spill_bytes == 0 and device.reason is None               # no local memory: no spills
    split = rows[("paged_decode_split", "sm_90")]
    assert split.stack_bytes == 16 and split.spill_bytes is None and "not how much of it is spills" in split.reason
    ptxas = gpu.compile_kernel(build, "sm_80").resources["paged_decode"]
    assert rows[("paged_decode", "sm_80")] == ptxas and ptxas.source == FROM_NVRTC   # the other arch: ptxas
    # use_device=False (a test pretending there is no device) gets ptxas's numbers, not a cached device answer
    rows_off = gpu.compile_report(ARCHS, builds=[build], use_device=False)
    assert {r.source for r in rows_off} == {FROM_NVRTC}


@pytest.mark.parametrize("module", [FakeModule(RuntimeError("driver gone")),
                                    FakeModule({"online_softmax": (-1, -1, -1)})],     # CuPy's "no such attribute"
                         ids=["raises", "minus-one"])
def test_a_device_that_cannot_report_leaves_ptxas_numbers(monkeypatch, module):
    build = source.online_softmax_build(128, "float32")
    pretend_device(monkeypatch, module)
    (row,) = gpu.compile_report(("sm_90",), builds=[build])
    assert row.source == FROM_NVRTC and row.smem_bytes == 16 and row.registers >= 1


def test_parse_ptxas_log_reads_each_entry():
    log = ("ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Compiling entry function 'a' for 'sm_80'\n"
           "ptxas info    : Function properties for a\n"
           "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 376 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function 'b' for 'sm_80'\n"
           "ptxas info    : Function properties for b\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 12 registers, 376 bytes cmem[0]\n")
    assert parse_ptxas_log(log) == {
        "a": dict(registers=40, smem_bytes=2048, stack_bytes=8, spill_store_bytes=4, spill_load_bytes=12),
        "b": dict(registers=12, smem_bytes=0, stack_bytes=0, spill_store_bytes=0, spill_load_bytes=0),
    }


# ---------------------------------------------------------------------------
# sources and configurations
# ---------------------------------------------------------------------------

def test_kernel_source_inlines_the_common_header_with_line_directives():
    text = gpu.kernel_source("flash_attention")
    assert "#include" not in text
    assert '#line 1 "common.cuh"' in text
    # after the header, line numbers point back into flash_attention.cu
    m = re.search(r'#line (\d+) "flash_attention.cu"\n(.*)\n', text)
    original = (source.KERNEL_DIR / "flash_attention.cu").read_text().splitlines()
    assert original[int(m.group(1)) - 1] == m.group(2)
    with pytest.raises(ValueError, match="kernel must be one of"):
        gpu.kernel_source("nope")


@pytest.mark.parametrize("d, expected", [(1, (64, 32)), (64, (64, 32)), (80, (32, 32)), (128, (32, 16)),
                                         (256, (16, 8))])
def test_flash_tiles_are_the_largest_that_fit_48_kib(d, expected):
    block_q, block_k = gpu.flash_attention_config(d)
    assert (block_q, block_k) == expected
    assert source.flash_attention_smem_bytes(d, block_q, block_k) <= 48 * 1024
    lanes = 128 // block_q
    assert block_k // lanes <= 16                               # scores per thread, in registers
    if block_k < 64 and 2 * block_k // lanes <= 16:            # the next larger tile would not fit
        assert source.flash_attention_smem_bytes(d, block_q, 2 * block_k) > 48 * 1024


def test_flash_smem_formula_by_hand():
    # d = 128, Br = 32, Bc = 16: Q 32x129, K and V 16x129, P 32x17 floats
    assert source.flash_attention_smem_bytes(128, 32, 16) == 4 * (32 * 129 + 2 * 16 * 129 + 32 * 17) == 35200


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(head_dim=0), ValueError, "head_dim must be in 1..256"),
    (dict(head_dim=257), ValueError, "head_dim must be in 1..256"),
    (dict(head_dim=64.0), TypeError, "head_dim must be an int"),
    (dict(head_dim=64, block_q=48), ValueError, "block_q must be one of"),
    (dict(head_dim=64, block_q=32, block_k=6), ValueError, "multiple of 128 // block_q = 4"),
    (dict(head_dim=256, block_q=16, block_k=64), ValueError, "more than the 49152 allowed"),
])
def test_flash_config_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        gpu.flash_attention_config(**kwargs)


def test_tensor_core_tiles_and_smem_by_hand():
    # d = 128, Bc = 64: K and V tiles of 64 rows x (128 + 8) float16 values
    assert gpu.flash_attention_mma_config(128) == 64 and gpu.flash_attention_mma_config(256) == 32
    assert source.flash_attention_mma_smem_bytes(128, 64) == 2 * 2 * 64 * 136 == 34816
    assert source.flash_attention_mma_build(128).smem_bytes == 34816


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(head_dim=72), ValueError, "head_dim must be a multiple of 16"),
    (dict(head_dim=8), ValueError, "head_dim must be in 16..256"),
    (dict(head_dim=64, block_k=40), ValueError, "block_k must be a multiple of 16"),
    (dict(head_dim=256, block_k=64), ValueError, "more than the 49152 allowed"),
    (dict(head_dim=64, block_k=64.0), TypeError, "block_k must be an int"),
])
def test_tensor_core_config_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        gpu.flash_attention_mma_config(**kwargs)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gpu.flash_attention_mma_build(64, "float32")


def test_the_tensor_core_kernel_uses_the_mma_instruction():
    for dtype, ptx_type in (("float16", "f16"), ("bfloat16", "bf16")):
        ptx = gpu.compile.compile_ptx(source.flash_attention_mma_build(64, dtype), "sm_80")
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32" in ptx


@pytest.mark.parametrize("num_heads, num_kv_heads, expected", [(8, 8, 1), (8, 4, 2), (8, 1, 8), (12, 1, 6),
                                                                (7, 1, 7), (32, 2, 8), (6, 2, 3)])
def test_heads_per_block_divides_the_gqa_group(num_heads, num_kv_heads, expected):
    assert gpu.paged_decode_config(64, 16, num_heads, num_kv_heads) == expected


@pytest.mark.parametrize("args, match", [
    ((64, 16, 8, 3), "num_heads must be a multiple of num_kv_heads"),
    ((64, 33, 8, 8), "block_size must be in 1..32"),
    ((256, 32, 8, 8), "use a smaller block_size"),
])
def test_paged_config_errors(args, match):
    with pytest.raises(ValueError, match=match):
        gpu.paged_decode_config(*args)


def test_paged_smem_formula_by_hand():
    # d = 128, block_size 16, 4 heads: q 4x129, k and v 16x129, s 4x17, m/l/alpha 3x4 floats
    assert source.paged_decode_smem_bytes(128, 16, 4) == 4 * (4 * 129 + 2 * 16 * 129 + 4 * 17 + 12) == 18896


def test_kernel_signature_is_read_from_the_source():
    sig = source.kernel_signature("paged_decode", "merge_splits")
    assert [n for _, n in sig][:5] == ["part_m", "part_l", "part_o", "num_heads", "num_splits"]
    assert dict((n, k) for k, n in sig)["num_heads"] == "int"
    with pytest.raises(ValueError, match="not found"):
        source.kernel_signature("paged_decode", "missing")


# ---------------------------------------------------------------------------
# launcher input checks: all before any device is touched
# ---------------------------------------------------------------------------

def f32(*shape):
    return np.zeros(shape, dtype=np.float32)


@pytest.mark.parametrize("q, k, v, kwargs, error, match", [
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(backend="gpu"), ValueError, "backend must be one of"),
    ([[0.0]], f32(1, 1), f32(1, 1), {}, TypeError, "q must be a NumPy or CuPy array, got list"),
    (f32(8), f32(5, 8), f32(5, 8), {}, ValueError, r"q must be \(Nq, d\)"),
    (f32(4, 8), f32(2, 5, 8), f32(2, 5, 8), {}, ValueError, "same rank"),
    (f32(2, 4, 8), f32(3, 5, 8), f32(3, 5, 8), {}, ValueError, "leading"),
    (f32(4, 8), f32(5, 6), f32(5, 6), {}, ValueError, "share the head dim"),
    (f32(4, 8), f32(5, 8), f32(5, 4), {}, ValueError, "dv == d"),
    (f32(4, 300), f32(5, 300), f32(5, 300), {}, ValueError, r"head dim d must be in 1..256"),
    (f32(4, 8), f32(5, 8).astype(np.float16), f32(5, 8), {}, TypeError, "must share one dtype"),
    # an int q beside float k, v: the int is what is wrong, not that the dtypes differ
    (f32(4, 8).astype(np.int32), f32(5, 8), f32(5, 8), {}, TypeError,
     r"must be float32 or float16, got \{'q': 'int32'\}"),
    (f32(4, 8).astype(np.float64), f32(5, 8).astype(np.float64), f32(5, 8).astype(np.float64), {},
     TypeError, "must be float32 or float16, got float64"),
    (f32(4, 8).view(np.uint16)[:, :8], f32(5, 8).view(np.uint16)[:, :8], f32(5, 8).view(np.uint16)[:, :8], {},
     ValueError, "C-contiguous"),
    (np.zeros((4, 8), np.uint16), np.zeros((5, 8), np.uint16), np.zeros((5, 8), np.uint16), {},
     TypeError, "pass bfloat16=True"),
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(bfloat16=True), TypeError, "bfloat16 bits as uint16"),
    (f32(16, 8)[::2], f32(5, 8), f32(5, 8), {}, ValueError, "q must be C-contiguous"),
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(causal=1), TypeError, "causal must be True or False"),
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(scale=float("nan")), ValueError, "scale must be finite"),
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(block_q=24), ValueError, "block_q must be one of"),
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(trace_rows=[4]), ValueError, r"trace_rows must be in \[0, 4\)"),
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(trace_rows=[1, 1]), ValueError, "must not repeat"),
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(trace_rows=[]), ValueError, "1..64 rows"),
    (f32(4, 8), f32(5, 8), f32(5, 8), dict(trace_rows=[0.5]), TypeError, "sequence of ints"),
])
def test_flash_attention_gpu_rejects_bad_input(q, k, v, kwargs, error, match):
    with pytest.raises(error, match=match):
        gpu.flash_attention_gpu(q, k, v, **kwargs)


def paged_inputs(num_seqs=2, num_heads=4, num_kv_heads=2, d=8, block_size=4, num_blocks=6, max_blocks=3):
    return dict(q=f32(num_seqs, num_heads, d), k_cache=f32(num_blocks, block_size, num_kv_heads, d),
                v_cache=f32(num_blocks, block_size, num_kv_heads, d),
                block_tables=(np.arange(num_seqs * max_blocks) % num_blocks).reshape(num_seqs, max_blocks).astype(np.int32),
                seq_lens=np.full(num_seqs, 5, np.int32))


@pytest.mark.parametrize("change, error, match", [
    (dict(q=f32(2, 4)), ValueError, r"q must be \(num_seqs, num_heads, d\)"),
    (dict(k_cache=f32(6, 4, 8)), ValueError, "k_cache must be"),
    (dict(v_cache=f32(6, 4, 1, 8)), ValueError, "v_cache must have the shape of k_cache"),
    (dict(q=f32(2, 3, 8)), ValueError, "num_heads must be a multiple of num_kv_heads"),
    (dict(q=f32(2, 4, 6)), ValueError, "share the head dim"),
    (dict(k_cache=f32(6, 64, 2, 8), v_cache=f32(6, 64, 2, 8)), ValueError, "block_size must be in 1..32"),
    (dict(block_tables=np.zeros((2, 3), np.int64)), TypeError, "block_tables must be an int32 array"),
    (dict(block_tables=np.zeros((3, 3), np.int32)), ValueError, "one row per sequence"),
    (dict(seq_lens=np.array([5, 13], np.int32)), ValueError, r"seq_lens\[1\] = 13 must be in \[0, 12\]"),
    (dict(seq_lens=np.array([-1, 5], np.int32)), ValueError, r"seq_lens\[0\] = -1"),
    (dict(block_tables=np.array([[0, 6, 0], [0, 0, 0]], np.int32)), ValueError, r"block_tables\[0\] points at pages \[6\]"),
    (dict(block_tables=np.array([[1, 1, 0], [2, 3, 0]], np.int32)), ValueError,
     r"block_tables\[0\] names pages \[1\] for two or more of its blocks"),
    (dict(q=f32(2, 4, 8).astype(np.float16)), TypeError, "must share one dtype"),
])
def test_paged_launchers_reject_bad_input(change, error, match):
    inputs = {**paged_inputs(), **change}
    with pytest.raises(error, match=match):
        gpu.paged_decode_gpu(**inputs)
    with pytest.raises(error, match=match):
        gpu.flash_decoding_gpu(**inputs, num_splits=2)


def test_unused_block_table_entries_are_not_checked():
    # seq_len 5 with block_size 4 uses two pages; the third entry may be anything
    inputs = paged_inputs()
    inputs["block_tables"][:, 2] = -7
    with pytest.raises(ValueError, match="trace_rows entry"):      # it got past the table check
        gpu.paged_decode_gpu(**inputs, trace_rows=[(2, 0)])


@pytest.mark.parametrize("num_splits, error", [(0, ValueError), (True, TypeError), (2.0, TypeError),
                                                (70000, ValueError)])
def test_flash_decoding_checks_num_splits(num_splits, error):
    with pytest.raises(error, match="num_splits"):
        gpu.flash_decoding_gpu(**paged_inputs(), num_splits=num_splits)


def test_online_softmax_gpu_rejects_bad_input():
    with pytest.raises(ValueError, match="x must be 1-D"):
        gpu.online_softmax_gpu(f32(2, 3, 4))
    with pytest.raises(ValueError, match="tile must be a multiple of 32"):
        gpu.online_softmax_gpu(f32(2, 3), tile=48)
    with pytest.raises(ValueError, match=r"trace_rows must be in \[0, 2\)"):
        gpu.online_softmax_gpu(f32(2, 3), trace_rows=[2])


@pytest.mark.skipif(gpu.device_available(), reason="a CUDA device is present")
def test_without_a_device_the_cupy_backend_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device.*backend='emulator'"):
        gpu.flash_attention_gpu(f32(4, 8), f32(5, 8), f32(5, 8))


# ---------------------------------------------------------------------------
# comparing a GPU trace with NumPy's (pure NumPy)
# ---------------------------------------------------------------------------

def numpy_trace(causal=False):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((6, 4)), rng.standard_normal((9, 4)) * 3, rng.standard_normal((9, 4))
    _, trace = lessons.flash_attention(q, k, v, tile=2, block_q=3, causal=causal, return_trace=True)
    return trace


def as_gpu_trace(trace, rows, perturb=None):
    """Write a NumPy trace into the GPU's buffer layout (NaN = not absorbed), optionally perturbed."""
    n_tiles = -(-trace.nk // trace.tile)
    records = np.full((len(rows), n_tiles, 3), np.nan, dtype=np.float32)
    for slot, row in enumerate(rows):
        r = trace.row(row)
        records[slot, r.tile] = np.stack([r.m, r.alpha, r.l], axis=1)
    if perturb:
        slot, tile, field, delta = perturb
        records[slot, tile, field] += delta
    return gpu.GpuTrace(tuple((r,) for r in rows), records)


def test_a_faithful_trace_has_no_divergence():
    trace = numpy_trace()
    g = as_gpu_trace(trace, [0, 4])
    assert len(g.row(4)) == len(trace.row(4)) == 5
    assert gpu.first_divergence(g.row(4), trace.row(4), rtol=1e-6) is None


def test_the_first_perturbed_tile_is_named():
    trace = numpy_trace()
    g = as_gpu_trace(trace, [1], perturb=(0, 3, 1, 1e-3))         # alpha of tile index 3
    div = gpu.first_divergence(g.row(1), trace.row(1))
    assert (div.step, div.tile, div.quantity) == (3, 3, "alpha")
    assert div.numpy == pytest.approx(trace.row(1).alpha[3])
    assert div.gpu == pytest.approx(trace.row(1).alpha[3] + 1e-3, rel=1e-6)
    # the message counts tiles from 1, as the stepper does: index 3 is "tile 4"
    assert str(div).startswith("tile 4 (step 4)") and "alpha" in str(div)
    # within a looser tolerance the same trace agrees
    assert gpu.first_divergence(g.row(1), trace.row(1), atol=2e-3) is None


def test_perturbations_later_in_the_trace_are_reported_at_their_tile():
    trace = numpy_trace()
    g = as_gpu_trace(trace, [2], perturb=(0, 4, 2, 0.5))         # l of the last tile
    div = gpu.first_divergence(g.row(2), trace.row(2))
    assert (div.tile, div.quantity) == (4, "l")


def test_causal_traces_with_empty_rows_match_on_minus_infinity():
    trace = numpy_trace(causal=True)        # Nq 6 < Nk 9: every row sees some key, but tiles are skipped
    for row in range(6):
        r = trace.row(row)
        assert gpu.first_divergence(as_gpu_trace(trace, [row]).row(row), r) is None
    # a row whose m stays -inf in the first tile: masked rows in a mask-only trace
    q, k, v = np.ones((2, 1)), np.ones((4, 1)), np.ones((4, 1))
    _, t = lessons.flash_attention(q, k, v, tile=2, block_q=2, mask=np.array([[0, 0, 1, 1], [1, 1, 1, 1]], bool),
                                   return_trace=True)
    assert np.isneginf(t.row(0).m[0])
    g = as_gpu_trace(t, [0])
    assert gpu.first_divergence(g.row(0), t.row(0)) is None
    records = g.records.copy()
    records[0, 0, 0] = 0.0                                   # a finite m where NumPy has -inf
    div = gpu.first_divergence(gpu.GpuTrace(g.labels, records).row(0), t.row(0))
    assert (div.tile, div.quantity) == (0, "m")


def test_a_missing_or_extra_tile_is_a_divergence():
    trace = numpy_trace()
    g = as_gpu_trace(trace, [0])
    records = g.records.copy()
    records[0, 4] = np.nan                                    # the GPU "skipped" the last tile
    div = gpu.first_divergence(gpu.GpuTrace(g.labels, records).row(0), trace.row(0))
    assert (div.step, div.tile, div.quantity) == (4, 4, "length")
    records = g.records.copy()
    records[0, 2] = np.nan                                    # ... or a middle one
    div = gpu.first_divergence(gpu.GpuTrace(g.labels, records).row(0), trace.row(0))
    assert (div.step, div.quantity) == (2, "tile")


def test_gpu_trace_checks_its_inputs():
    with pytest.raises(ValueError, match=r"\(rows, tiles, 3\)"):
        gpu.GpuTrace(((0,),), np.zeros((1, 2, 2)))
    with pytest.raises(ValueError, match="2 labels for 1 traced rows"):
        gpu.GpuTrace(((0,), (1,)), np.zeros((1, 2, 3)))
    with pytest.raises(KeyError, match="was not traced"):
        gpu.GpuTrace(((0,),), np.zeros((1, 2, 3))).row(3)
    trace = numpy_trace()
    with pytest.raises(ValueError, match="rtol must be a non-negative"):
        gpu.first_divergence(trace.row(0), trace.row(0), rtol=-1)


# ---------------------------------------------------------------------------
# bfloat16 bits
# ---------------------------------------------------------------------------

def test_bfloat16_rounds_to_nearest_even_by_hand():
    one = 1.0
    ulp = 2.0 ** -7                                           # bfloat16 spacing just above 1
    x = np.array([one, one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2.0 ** -20, -2.0, np.inf, 3.399e38],
                 dtype=np.float32)
    bits = gpu.to_bfloat16_bits(x)
    # 1.0 = 0x3F80; halfway to 0x3F81 ties to even 0x3F80; 1.5 ulp ties up to 0x3F82;
    # just above halfway rounds up; -2 = 0xC000; inf stays; 3.399e38 is past bfloat16's
    # max 0x7F7F = 3.3895e38 by more than half a step (2^119 = 6.6e35), so it rounds to inf
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC000, 0x7F80, 0x7F80]
    assert gpu.to_bfloat16_bits(np.array([np.nan], np.float32))[0] == 0x7FC0
    assert gpu.from_bfloat16_bits(bits[:5]).tolist() == [1.0, 1.0, 1.0 + 2 * ulp, 1.0 + ulp, -2.0]


def test_bfloat16_round_trip_error_is_within_half_an_ulp():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    back = gpu.from_bfloat16_bits(gpu.to_bfloat16_bits(x))
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0 ** -8)
    with pytest.raises(TypeError, match="uint16"):
        gpu.from_bfloat16_bits(np.zeros(2, np.int16))
    with pytest.raises(TypeError, match="float array"):
        gpu.to_bfloat16_bits(np.zeros(2, np.int32))


# ---------------------------------------------------------------------------
# several processes and threads at once
# ---------------------------------------------------------------------------

CHILD = r"""
import json, sys
import lessons.gpu.compile as c
from lessons.gpu import lesson, source

if sys.argv[1] == "quiet":                 # NVRTC's log without the ptxas lines, as on a compile-cache hit
    real = c._nvrtc()

    class Quiet:
        def __getattr__(self, name):
            return getattr(real, name)

        def getProgramLog(self, prog):
            return ""

    c._nvrtc = lambda: Quiet()
r = lesson.online_softmax_on_gpu(use_device=False, emulate=True)
rows = list(r.resources) + c.compile_report(c.ARCHS, builds=[source.paged_decode_build(64, 16, 8, 2, "float32")],
                                            use_device=False)
print(json.dumps({"compiled": r.compiled, "status": r.status, "summary": r.summary,
                  "agrees": [k.agrees for k in r.checks_on("emulator")],
                  "rows": [[x.entry, x.arch, x.source, x.registers, x.smem_bytes, x.reason] for x in rows]}))
"""


@pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler (g++) for the CPU emulation")
def test_processes_compiling_and_emulating_the_same_kernels_at_once_all_succeed(tmp_path):
    """Four processes compile the same kernels with NVRTC and build the same emulator library into one
    empty cache folder at the same moment; two of them get NVRTC logs without the ptxas report. Every
    one must say the kernel compiled, agree with NumPy on the emulator, and give full resource numbers
    or an honest "not reported" - never "failed to compile"."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "LESSONS_EMULATOR_CACHE": str(tmp_path / "emulator"), "PYTHONPATH": str(ROOT)}
    modes = ["plain", "quiet", "plain", "quiet"]
    # the plain ones share one empty NVRTC cache folder; the quiet ones' made-up logs stay off disk
    nvrtc_cache = {"plain": str(tmp_path / "nvrtc"), "quiet": "off"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, mode], cwd=tmp_path,
                              env={**env, "LESSONS_NVRTC_CACHE": nvrtc_cache[mode]}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for mode in modes]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    ptxas = gpu.find_ptxas()
    for mode, res in zip(modes, results):
        assert res["compiled"] and "failed" not in res["summary"], res["summary"]
        assert "compiled for sm_80 and sm_90 with NVRTC" in res["status"] and "but not run" in res["status"]
        assert res["agrees"] == [True]
        for entry, arch, src, registers, smem, reason in res["rows"]:
            if mode == "plain":
                assert src == FROM_NVRTC and registers >= 1 and smem is not None, (entry, arch, reason)
            elif ptxas is not None:
                assert src == FROM_PTXAS and registers >= 1 and smem is not None, (entry, arch, reason)
            else:
                assert src is None and registers is None and "no ptxas report" in reason
        if mode == "quiet" and ptxas is None:
            assert "not reported" in res["summary"]
    assert len(list((tmp_path / "emulator").glob("*.so"))) == 1         # one library, built and renamed whole
    assert not [p for p in (tmp_path / "emulator").iterdir() if p.is_dir()]   # no build folder left behind
    kept = sorted(p.name for p in _entries(tmp_path / "nvrtc"))
    assert kept and not [n for n in kept if n.endswith(".part")]        # NVRTC's results kept whole, no pieces


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
def test_nvrtc_results_kept_on_disk_are_the_bytes_nvrtc_gives(tmp_path, monkeypatch, fresh_caches):
    build = source.online_softmax_build(64, "float32")
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", "off")
    fresh = gpu.compile_kernel(build, "sm_80")
    fresh_ptx = compile_mod.compile_ptx(build, "sm_80")
    assert "registers" in fresh.log and fresh_ptx.lstrip().startswith("//")
    folder = tmp_path / "kept"
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", str(folder))
    compile_mod.compile_kernel.cache_clear()
    first = gpu.compile_kernel(build, "sm_80")
    files = sorted(_entries(folder))
    assert len(files) == 1 and "-cubin-" in files[0].name
    compile_mod.compile_kernel.cache_clear()
    again = gpu.compile_kernel(build, "sm_80")                           # read back from disk
    assert first.cubin == again.cubin == fresh.cubin and first.log == again.log    # (the log holds ptxas's own timing)
    assert again.resources == first.resources == fresh.resources
    assert compile_mod.compile_ptx(build, "sm_80") == compile_mod.compile_ptx(build, "sm_80") == fresh_ptx
    assert len(_entries(folder)) == 2                             # the cubin and the PTX
    files[0].write_bytes(files[0].read_bytes()[:20])                    # a file cut short is compiled again
    compile_mod.compile_kernel.cache_clear()
    assert gpu.compile_kernel(build, "sm_80").cubin == fresh.cubin
    assert files[0].stat().st_size > 20
    other = source.online_softmax_build(128, "float32")                  # another source, another file
    gpu.compile_kernel(other, "sm_80")
    assert len(_entries(folder)) == 3


def _entries(folder):
    """The cache's entries: every file but the ``.lock`` files of lessons.gpu.cache_lock."""
    return [p for p in folder.iterdir() if not p.name.endswith(".lock")]


def _kept_cubin(folder):
    (path,) = [p for p in _entries(folder) if "-cubin-" in p.name]
    return path


def _log_digit_changed(data):
    i = data.index(b"Used ") + len(b"Used ")       # the first digit of a register count
    return data[:i] + bytes([ord("9") if data[i] != ord("9") else ord("8")]) + data[i + 1:]


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
@pytest.mark.parametrize("damage", [
    pytest.param(lambda data: data[:-100], id="cubin-cut-short"),
    pytest.param(lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]), id="cubin-byte-flipped"),
    pytest.param(_log_digit_changed, id="register-count-changed"),
    pytest.param(lambda data: b"\0" * 8, id="eight-zero-bytes"),
    pytest.param(lambda data: b"", id="empty"),
    pytest.param(lambda data: data + b"junk", id="bytes-appended"),
])
def test_a_damaged_kept_file_is_compiled_again_never_served(tmp_path, monkeypatch, fresh_caches, damage):
    build = source.online_softmax_build(64, "float32")
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", str(tmp_path / "kept"))
    good = gpu.compile_kernel(build, "sm_80")
    path = _kept_cubin(tmp_path / "kept")
    path.write_bytes(damage(path.read_bytes()))
    compile_mod.compile_kernel.cache_clear()
    again = gpu.compile_kernel(build, "sm_80")
    assert again.cubin == good.cubin and again.cubin[:4] == b"\x7fELF"
    assert again.resources == good.resources
    compile_mod.compile_kernel.cache_clear()
    assert gpu.compile_kernel(build, "sm_80").cubin == good.cubin       # and the file is whole again


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
def test_a_whole_kept_file_under_another_keys_name_is_not_served(tmp_path, monkeypatch, fresh_caches):
    small, large = source.online_softmax_build(64, "float32"), source.online_softmax_build(128, "float32")
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", str(tmp_path / "kept"))
    want_small = gpu.compile_kernel(small, "sm_80")
    small_file = _kept_cubin(tmp_path / "kept")
    want_large = gpu.compile_kernel(large, "sm_80")
    (large_file,) = [p for p in _entries(tmp_path / "kept") if "-cubin-" in p.name and p != small_file]
    assert want_small.cubin != want_large.cubin
    large_file.write_bytes(small_file.read_bytes())        # a whole, well-formed file, but the other kernel's
    compile_mod.compile_kernel.cache_clear()
    assert gpu.compile_kernel(large, "sm_80").cubin == want_large.cubin


class PartialReportNvrtc(QuietNvrtc):
    """A log that mentions registers but reports only the first entry point of paged_decode."""

    def getProgramLog(self, prog):
        return ("ptxas info    : Compiling entry function 'paged_decode' for 'sm_90'\n"
                "ptxas info    : Used 40 registers, 1024 bytes smem\n")


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
def test_a_cubin_whose_log_misses_an_entry_is_not_kept(tmp_path, monkeypatch, fresh_caches):
    build = source.paged_decode_build(64, 16, 8, 2, "float32")
    assert len(build.entries) == 3 and build.entries[0] == "paged_decode"
    real = compile_mod._nvrtc()
    monkeypatch.setattr(compile_mod, "_nvrtc", lambda: PartialReportNvrtc(real))
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", str(tmp_path / "kept"))
    gpu.compile_kernel(build, "sm_90")
    assert not [p for p in _entries(tmp_path / "kept") if "-cubin-" in p.name]


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
def test_a_write_that_fails_leaves_no_piece_behind(tmp_path, monkeypatch, fresh_caches):
    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compile_mod.os, "replace", full_disk)
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", str(tmp_path / "kept"))
    compiled = gpu.compile_kernel(source.online_softmax_build(64, "float32"), "sm_80")
    assert compiled.cubin[:4] == b"\x7fELF"
    assert _entries(tmp_path / "kept") == []


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
def test_a_cache_path_that_is_a_file_keeps_nothing_and_compiles(tmp_path, monkeypatch, fresh_caches):
    path = tmp_path / "a-file"
    path.write_bytes(b"a learner's file")
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", str(path))
    assert compile_mod._disk_cache() is None
    assert gpu.compile_kernel(source.online_softmax_build(64, "float32"), "sm_80").cubin[:4] == b"\x7fELF"
    assert path.read_bytes() == b"a learner's file"


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
def test_the_kept_name_changes_with_the_source_and_the_nvrtc_build(tmp_path, monkeypatch, fresh_caches):
    build = source.online_softmax_build(64, "float32")
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", str(tmp_path / "kept"))
    first = gpu.compile_kernel(build, "sm_80")
    names = {p.name for p in _entries(tmp_path / "kept")}
    # an edit anywhere in the source the compiler sees (the inlined header included) is a new file
    real_source = compile_mod.kernel_source
    monkeypatch.setattr(compile_mod, "kernel_source",
                        lambda kernel: real_source(kernel).replace("#define", "// edited\n#define", 1))
    compile_mod.compile_kernel.cache_clear()
    gpu.compile_kernel(build, "sm_80")
    names_after_edit = {p.name for p in _entries(tmp_path / "kept")}
    assert len(names_after_edit) == 2 and names < names_after_edit
    monkeypatch.setattr(compile_mod, "kernel_source", real_source)
    # another build of the same NVRTC version (a newer wheel, 12.9.41 -> 12.9.86) is a new file too
    monkeypatch.setattr(compile_mod, "_nvrtc_identity", lambda: "12.9|nvidia-cuda-nvrtc-cu12==0.0.1")
    compile_mod.compile_kernel.cache_clear()
    assert gpu.compile_kernel(build, "sm_80").cubin == first.cubin
    assert len(_entries(tmp_path / "kept")) == 3


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
def test_the_nvrtc_identity_names_the_wheel_that_compiles():
    import importlib.metadata

    compile_mod._nvrtc_identity.cache_clear()
    identity = compile_mod._nvrtc_identity()
    assert identity.startswith(".".join(map(str, compile_mod.nvrtc_version())))
    wheels = [d for d in importlib.metadata.distributions()
              if (d.metadata["Name"] or "").lower().startswith("nvidia-cuda-nvrtc")]
    for d in wheels:
        assert f"{d.metadata['Name']}=={d.version}" in identity
    if not wheels:
        assert "libnvrtc" in identity


@pytest.mark.parametrize("value", ["off", "OFF", "Off", " off "])
def test_off_in_any_case_keeps_nothing_and_makes_no_folder(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", value)
    assert compile_mod._disk_cache() is None
    assert list(tmp_path.iterdir()) == []


def test_the_default_folder_is_used_only_when_this_user_alone_can_write_it(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.delenv("LESSONS_NVRTC_CACHE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = compile_mod._disk_cache()
    assert made is not None and made.parent == tmp_path and made.stat().st_mode & 0o077 == 0
    made.chmod(0o777)                                   # another user could plant a cubin there
    assert compile_mod._disk_cache() is None
    made.chmod(0o700)
    assert compile_mod._disk_cache() == made
    if hasattr(os, "geteuid") and os.geteuid() == 0:    # a folder another user made first
        os.chown(made, 65534, 65534)
        assert compile_mod._disk_cache() is None


@pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler (g++) for the CPU emulation")
def test_threads_launching_emulated_kernels_at_once_get_their_own_answers():
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(7)
    xs = [(rng.standard_normal((3, 200)) * (i + 1)).astype(np.float32) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda x: gpu.online_softmax_gpu(x, tile=64, backend="emulator"), xs))
    for x, (y, lse) in zip(xs, outs):
        x64 = x.astype(np.float64)
        np.testing.assert_allclose(y, lessons.safe_softmax(x64), atol=2e-6, rtol=2e-5)
        np.testing.assert_allclose(lse, np.logaddexp.reduce(x64, axis=-1), rtol=2e-6)


def test_elf_whole_restores_the_byte_cupy_drops_from_a_cubin():
    from lessons.gpu.compile import elf_whole

    # by hand: a header saying 2 section headers of 64 bytes at offset 100 -> the file ends at 228
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    header[0x28:0x30] = (100).to_bytes(8, "little")
    header[0x3A:0x3C], header[0x3C:0x3E] = (64).to_bytes(2, "little"), (2).to_bytes(2, "little")
    image = bytes(header) + b"\x01" * 163                       # 227 bytes: one short
    whole = elf_whole(image)
    assert len(whole) == 228 and whole[:227] == image and whole[227] == 0
    assert elf_whole(whole) == whole and elf_whole(whole + b"\x05") == whole + b"\x05"   # nothing else changes
    with pytest.raises(ValueError, match="ELF"):
        elf_whole(b"not a cubin" * 10)
    with pytest.raises(TypeError, match="bytes"):
        elf_whole(np.frombuffer(whole, np.uint8))
    with pytest.raises(TypeError, match="bytes"):
        elf_whole(None)
    damaged = bytearray(whole)
    damaged[0x28:0x30] = (1 << 40).to_bytes(8, "little")            # section headers said to lie 1 TiB in
    with pytest.raises(ValueError, match="damaged"):
        elf_whole(bytes(damaged))
    assert elf_whole(bytearray(image)) == whole


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
def test_a_cubin_from_nvrtc_is_whole_once_padded():
    from lessons.gpu.compile import elf_whole

    def field(offset, size):
        return int.from_bytes(cubin[offset:offset + size], "little")

    cubin = gpu.compile_kernel(gpu.flash_attention_wgmma_build(64), "sm_90a").cubin
    # the file ends where the later of its two header tables ends (program headers: e_phoff, e_phentsize,
    # e_phnum; section headers: e_shoff, e_shentsize, e_shnum); CuPy's bytes stop one short of it
    end = max(field(0x20, 8) + field(0x36, 2) * field(0x38, 2), field(0x28, 8) + field(0x3A, 2) * field(0x3C, 2))
    assert end == len(cubin) + 1
    assert elf_whole(cubin) == cubin + b"\0"
