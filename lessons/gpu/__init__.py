"""The series' algorithms as CUDA kernels (CuPy RawKernels), compiled with NVRTC.

Kernels (CUDA C in ``lessons/gpu/kernels/``, one launcher each):

* :func:`online_softmax_gpu` - softmax streaming over tiles, one block per row;
* :func:`flash_attention_gpu` - FlashAttention-2 forward, causal bottom-right, fp32/fp16/bf16;
* :func:`flash_attention_mma_gpu` - the same on tensor cores (``mma.sync``), fp16/bf16, sm_80+;
* :func:`flash_attention_regtile_gpu` - the CUDA-core forward register-tiled (16-byte shared loads), fp32;
* :func:`flash_attention_regtile_wide_gpu` - the same with 16 lanes per row group (8 rows x 4 keys per thread), P read 4 keys at a time;
* :func:`flash_attention_mma_async_gpu` - the tensor-core forward with ``cp.async`` double buffering and ``ldmatrix``;
* :func:`flash_attention_mma_fa2_gpu` - the tensor-core forward along FlashAttention-2's recipe (big blocks, ldmatrix.x4, swizzle, exp2);
* :func:`flash_attention_mma_fa2_lazy_gpu` - the same with lazy rescaling (o rescaled only when a max moves) and 64-key tiles at d = 128;
* :func:`flash_attention_mma_fa2_wide_gpu` - the same with FlashAttention-2's warp shape: 32 query rows per warp, each K/V fragment feeding two mmas;
* :func:`flash_attention_mma_fa2_lean_gpu` - the same whose interior key tiles skip the masks, the per-chunk bounds tests and V's inf/NaN test (a pre-pass flags V's tiles);
* :func:`flash_attention_wgmma_gpu` - the Hopper rung: TMA, mbarriers and ``wgmma``, a producer and two consumers (sm_90a);
* :func:`paged_decode_gpu` - decoding over a paged KV cache (vLLM layout) with GQA;
* :func:`flash_decoding_gpu` - the same split over the keys, partial states merged;
* :func:`paged_decode_split_gpu` - decode at memory speed: one block per GQA group and split, 16-byte loads;
* :func:`flash_attention_backward_gpu` - FlashAttention-2 backward (D, dK/dV, dQ), P recomputed from lse;
* :func:`flash_attention_backward_mma_gpu` - the same on tensor cores, fp16/bf16, d = 64 or 128 (no trace build).

Each has a trace build (``-DFA_TRACE``) that records ``(m, alpha, l)`` per tile for chosen
rows; :func:`first_divergence` compares such a trace with NumPy's, and :func:`kernel_row_trace`
hands one row of it to the notebooks' stepper. Without a GPU the
kernels still compile (:func:`compile_report` gives registers and shared memory per
kernel for sm_80 and sm_90, :func:`gpu_status` says what happened), and
``backend="emulator"`` runs the same CUDA C on the CPU. With a device, resources are
read from the loaded kernel itself (:func:`kernel_resources`). Each notebook's "On the
GPU" section is a short spec in :mod:`lessons.gpu.lesson` run by one flow,
:mod:`lessons.gpu.harness`. Importing this package needs neither CuPy nor a GPU.
"""
from lessons.gpu.bfloat16 import from_bfloat16_bits, to_bfloat16_bits
from lessons.gpu.compile import (ARCHS, CompiledKernel, KernelCompileError, KernelResources, compile_kernel,
                      compile_report, compile_report_table, device_arch, device_available, device_name, find_ptxas,
                      gpu_status, kernel_resources, nvrtc_available, ptxas_resources)
from lessons.gpu.emulator import EmulatorError, EmulatorMemoryError, emulator_available
from lessons.gpu.launch import (BACKENDS, Runner, SplitTraces, flash_attention_gpu, flash_attention_mma_gpu, flash_decoding_gpu,
                     mma_probe_gpu, online_softmax_gpu, paged_decode_gpu)
from lessons.gpu.source import (KERNELS, KernelBuild, default_builds, flash_attention_build, flash_attention_config,
                     flash_attention_mma_build, flash_attention_mma_config, kernel_source, online_softmax_build,
                     paged_decode_build, paged_decode_config)
from lessons.gpu.backward import GpuBackwardTrace, flash_attention_backward_gpu
from lessons.gpu.source import flash_attention_backward_build, flash_attention_backward_config
from lessons.gpu.launch import flash_attention_mma_async_gpu, flash_attention_regtile_gpu, flash_attention_regtile_wide_gpu
from lessons.gpu.source import flash_attention_mma_async_build, flash_attention_mma_async_config
from lessons.gpu.source import flash_attention_regtile_build, flash_attention_regtile_config
from lessons.gpu.source import flash_attention_regtile_wide_build, flash_attention_regtile_wide_config
from lessons.gpu.launch import flash_attention_mma_fa2_gpu, flash_attention_mma_fa2_lazy_gpu, flash_attention_mma_fa2_wide_gpu
from lessons.gpu.launch import flash_attention_mma_fa2_lean_gpu
from lessons.gpu.source import flash_attention_mma_fa2_build, flash_attention_mma_fa2_config
from lessons.gpu.source import (flash_attention_mma_fa2_lazy_build, flash_attention_mma_fa2_lazy_config,
                                flash_attention_mma_fa2_lazy_configs)
from lessons.gpu.source import (flash_attention_mma_fa2_wide_build, flash_attention_mma_fa2_wide_config,
                                flash_attention_mma_fa2_wide_configs)
from lessons.gpu.source import (flash_attention_mma_fa2_lean_build, flash_attention_mma_fa2_lean_config,
                                flash_attention_mma_fa2_lean_configs)
from lessons.gpu.launch import (flash_attention_wgmma_gpu, flash_attention_wgmma_overlap_gpu,
                               flash_attention_wgmma_pingpong_gpu, wgmma_probe_gpu)
from lessons.gpu.source import (flash_attention_wgmma_build, flash_attention_wgmma_config,
                                flash_attention_wgmma_overlap_build)
from lessons.gpu.launch import kernel_row_trace, paged_decode_split_gpu
from lessons.gpu.source import decode_splits, paged_decode_split_build
from lessons.gpu.backward import flash_attention_backward_mma_gpu
from lessons.gpu.source import flash_attention_backward_mma_build, flash_attention_backward_mma_config
from lessons.gpu.trace_compare import GpuRowTrace, GpuTrace, TraceDivergence, first_divergence

__all__ = [
    "online_softmax_gpu", "flash_attention_gpu", "flash_attention_mma_gpu", "mma_probe_gpu", "paged_decode_gpu",
    "flash_decoding_gpu", "SplitTraces",
    "BACKENDS", "Runner", "compile_kernel", "compile_report", "compile_report_table", "kernel_resources",
    "gpu_status", "device_available", "device_name", "device_arch", "nvrtc_available", "find_ptxas", "ptxas_resources", "ARCHS", "KernelResources",
    "CompiledKernel", "KernelCompileError", "KERNELS", "KernelBuild", "default_builds", "kernel_source",
    "flash_attention_config", "flash_attention_build", "flash_attention_mma_config", "flash_attention_mma_build",
    "paged_decode_config", "paged_decode_build",
    "online_softmax_build", "GpuTrace", "GpuRowTrace", "TraceDivergence", "first_divergence", "kernel_row_trace",
    "to_bfloat16_bits", "from_bfloat16_bits", "emulator_available", "EmulatorError", "EmulatorMemoryError",
    "flash_attention_backward_gpu", "GpuBackwardTrace", "flash_attention_backward_config", "flash_attention_backward_build",
    "flash_attention_regtile_gpu", "flash_attention_regtile_config", "flash_attention_regtile_build",
    "flash_attention_regtile_wide_gpu", "flash_attention_regtile_wide_config", "flash_attention_regtile_wide_build",
    "flash_attention_mma_async_gpu", "flash_attention_mma_async_config", "flash_attention_mma_async_build",
    "flash_attention_mma_fa2_gpu", "flash_attention_mma_fa2_config", "flash_attention_mma_fa2_build",
    "flash_attention_mma_fa2_lazy_gpu", "flash_attention_mma_fa2_lazy_config", "flash_attention_mma_fa2_lazy_configs",
    "flash_attention_mma_fa2_lazy_build",
    "flash_attention_mma_fa2_wide_gpu", "flash_attention_mma_fa2_wide_config", "flash_attention_mma_fa2_wide_configs",
    "flash_attention_mma_fa2_wide_build",
    "flash_attention_mma_fa2_lean_gpu", "flash_attention_mma_fa2_lean_config", "flash_attention_mma_fa2_lean_configs",
    "flash_attention_mma_fa2_lean_build",
    "flash_attention_wgmma_gpu", "flash_attention_wgmma_config", "flash_attention_wgmma_build", "wgmma_probe_gpu",
    "flash_attention_wgmma_overlap_gpu", "flash_attention_wgmma_overlap_build", "flash_attention_wgmma_pingpong_gpu",
    "paged_decode_split_gpu", "decode_splits", "paged_decode_split_build",
    "flash_attention_backward_mma_gpu", "flash_attention_backward_mma_config", "flash_attention_backward_mma_build",
]
