"""Utils/report/breakdown: the kernel classifier, the arithmetic of the split, a real CPU trace, the files."""
import csv
import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT
from Utils.ladder.registry import ADDITIONS, LADDER
from Utils.report import breakdown
from Utils.report.breakdown import (KERNEL_CLASSES, TraceError, append_breakdown_csv, classify, load_breakdown,
                                    load_trace, plot_breakdown, split, write_report)
from Utils.report.breakdown import kernels, render
from Utils.report.breakdown.trace import STEP_END, STEP_START
from Utils.results.schema import BREAKDOWN_COLUMNS, KERNEL_COLUMNS
from Utils.results.store import ResultsError, append_run

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

# Kernel names as CUPTI reports them in PyTorch 2.x training traces on Hopper (and, for the older cuBLAS
# and CUTLASS names, Ampere), with the (class, label) each must get.
REAL_KERNELS = [
    # cuBLAS / cuBLASLt / CUTLASS GEMMs
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "compute", "GEMM (cuBLAS)"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_TNN", "compute", "GEMM (cuBLAS)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_"
     "kernel__5x_cublas", "compute", "GEMM (cuBLAS)"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x256x8_stage3_warpsize1x4x1_ffma_aligna4_alignc4_execute_"
     "kernel__51_cublas", "compute", "GEMM (cuBLAS)"),
    ("ampere_sgemm_128x64_tn", "compute", "GEMM (cuBLAS)"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_16x4_tn_align4>"
     "(cutlass_80_tensorop_s1688gemm_128x128_16x4_tn_align4::Params)", "compute", "GEMM (CUTLASS)"),
    ("void cutlass::device_kernel<cutlass3x_sm90_tensorop_s64x128x16gemm_bf16_bf16_f32_void_bf16_128x128x64_1x1x1_"
     "0_tnn_align8_warpspecialized_cooperative_epi_tma>(cutlass3x_sm90_tensorop_s64x128x16gemm_bf16_bf16_f32_void_"
     "bf16_128x128x64_1x1x1_0_tnn_align8_warpspecialized_cooperative_epi_tma::Params)", "compute", "GEMM (CUTLASS)"),
    ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 8, 9, false, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float> >(cublasGemmSmallNParams<"
     "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float>, float>)", "compute", "GEMM (cuBLAS)"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx<"
     "int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float>, float> >(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float "
     "const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float>, float, "
     "float)", "compute", "GEMM (cuBLAS)"),
    ("void gemmk1_kernel<int, float, 256, 5, false, false, false, false, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float, 0>(cublasGemmk1Params<"
     "float, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, "
     "cublasGemvTensorStridedBatched<float>, float, biasType<cublasGemvTensorStridedBatched<float>::value_type, "
     "float>::type>)", "compute", "GEMM (cuBLAS)"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, true, false>(cublasLt::"
     "cublasSplitKParams<float>, float const*, float*, float const*, float const*, float const*)",
     "compute", "GEMM (split-K reduce)"),
    ("triton_tem_fused_mm_0", "compute", "GEMM (Triton template)"),
    # attention
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::"
     "bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, "
     "true, false, false>(pytorch_flash::Flash_fwd_params)", "compute", "flash attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 2, "
     "4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> >, false, "
     "true, false, false, true, true, false>(pytorch_flash::Flash_bwd_params)", "compute", "flash attention"),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<64, 128, 128, 8, 2, 4, 2, false, "
     "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> > >(pytorch_flash::"
     "Flash_bwd_params)", "compute", "flash attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
     "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)", "compute", "attention (memory-efficient)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
     "compute", "attention (cuDNN)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x1x1_kernel0_0",
     "compute", "attention (cuDNN)"),
    # Inductor
    ("triton_poi_fused_add_mul_tanh_pow_0", "memory", "Triton fused (Inductor)"),
    ("triton_red_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_3", "memory",
     "Triton fused (Inductor)"),
    ("triton_per_fused__log_softmax__to_copy_nll_loss_forward_1", "memory", "Triton fused (Inductor)"),
    # eager ATen kernels
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
     "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
     "at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::"
     "GeluType)::{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
     "at::detail::Array<char*, 2>)", "memory", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> "
     ">(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)", "memory", "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
     "{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, "
     "2>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::"
     "LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, at::native::direct_copy_kernel_cuda(at::"
     "TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, "
     "at::detail::Array<char*, 2>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned "
     "int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1>)", "memory", "elementwise"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
     "float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::"
     "BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>"
     "(int, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::"
     "binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1})", "memory", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
     "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
     "unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::"
     "sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, "
     "float, 4>)", "memory", "reduction"),
    ("void at::native::(anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*, "
     "float const*, int, int, int, bool const*, int, bool)", "memory", "softmax"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)", "memory", "softmax"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, at::native::(anonymous "
     "namespace)::SoftMaxBackwardEpilogue>(float*, float const*, float const*, long)", "memory", "softmax"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", "memory", "log-softmax (loss)"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, at::native::(anonymous "
     "namespace)::LogSoftMaxBackwardEpilogue>(float*, float const*, float const*, long)", "memory",
     "log-softmax (loss)"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, float const*, "
     "float const*, float const*, float*, float*, float*)", "memory", "layer norm"),
    ("void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized<float, float>(float const*, "
     "float const*, float const*, float const*, float const*, float*, int)", "memory", "layer norm"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel_32x32<float, float>(long, long, float "
     "const*, float const*, float const*, float const*, float*, float*)", "memory", "layer norm"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, "
     "float*, float const*, long const*, float const*, bool, long, long, long, long)", "memory", "cross-entropy loss"),
    ("void at::native::(anonymous namespace)::nll_loss_backward_reduce_cuda_kernel_2d<float, long>(float*, float "
     "const*, long const*, float const*, float const*, bool, int, int, long, long)", "memory", "cross-entropy loss"),
    # optimizers and gradient clipping
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float const*, float "
     "const*>(at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous "
     "namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, "
     "double, double, bool, float const*, float const*)", "memory", "fused AdamW"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, "
     "std::plus<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<2>, at::native::(anonymous "
     "namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, std::plus<float>, float)", "memory",
     "foreach (multi-tensor)"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::(anonymous "
     "namespace)::NormType)1, float, float>, float*, int>(at::native::(anonymous namespace)::TensorListMetadata<1>, "
     "at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::(anonymous namespace)::NormType)1, "
     "float, float>, float*, int)", "memory", "gradient norm (clip)"),
    ("void at::native::(anonymous namespace)::lpnorm_cleanup<float, (at::native::(anonymous namespace)::NormType)1, "
     "float, float>(float const*, at::native::(anonymous namespace)::TensorListAddresses, int)", "memory",
     "gradient norm (clip)"),
    ("void kOptimizerStatic8bit2StateBlockwise<float, 0, 256, 1>(float*, float*, unsigned char*, unsigned char*, "
     "float, float, float, float, float, int, float, float*, float*, float*, float*, float, float, bool, int)",
     "memory", "8-bit AdamW (bitsandbytes)"),
    ("void kOptimizer32bit2State<float, 0>(float*, float*, float*, float*, float*, float, float, float, float, float, "
     "float, int, float, float, float, bool, int)", "memory", "8-bit AdamW (bitsandbytes)"),
    ("void kPreconditionOptimizerStatic8bit2State<float, 0>(float*, float*, unsigned char*, unsigned char*, float*, "
     "float*, float, float, float, int, float*, float*, float, int)", "memory", "8-bit AdamW (bitsandbytes)"),
    # Utils.kernels.loss_kernel's Triton and CUDA kernels, named as CUPTI reports them
    ("_cross_entropy_grad_kernel", "memory", "cross-entropy loss"),
    ("cross_entropy_grad_rows", "memory", "cross-entropy loss"),   # its CUDA kernel
    ("_row_lse_kernel", "memory", "cross-entropy loss"),           # Utils.kernels.fp8_loss's two Triton kernels
    ("_grad_fp8_kernel", "memory", "cross-entropy loss"),
    ("cross_entropy_grad_rows_e5m2", "memory", "cross-entropy loss"),   # and the CUDA pass with the transpose after it
    ("_transpose_kernel", "memory", "transpose"),
    ("_update_kernel", "memory", "AdamW (master_adamw)"),
    ("memcpy128", "memory", "copy"),                               # as the H200's traces of the max rung name it
    # embedding, indexing, sort, cat, the causal mask
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float, long, unsigned int, 2, 2, -2, true>(at::"
     "cuda::detail::TensorInfo<float, unsigned int>, at::cuda::detail::TensorInfo<float const, unsigned int>, at::"
     "cuda::detail::TensorInfo<long const, unsigned int>, int, int, unsigned int, unsigned int, long)", "memory",
     "embedding (index select)"),
    ("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float, float, long>(long const*, "
     "float const*, float*, int, long, int)", "memory", "embedding backward"),
    ("void at::native::(anonymous namespace)::compute_grad_weight<float, long>(long const*, long const*, float "
     "const*, long const*, long, long, long, long const*, long const*, float*, long)", "memory", "embedding backward"),
    ("void at::native::(anonymous namespace)::sum_and_scatter<float, long>(long const*, float*, long, long const*, "
     "long const*, float const*, long const*, long, long)", "memory", "embedding backward"),
    ("void at::native::(anonymous namespace)::krn_partials_per_segment<long>(long*, long const*, long const*, long)",
     "memory", "embedding backward"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<long, long, "
     "unsigned long long>::Policy900, false, long, long, unsigned long long, int, int>(int*, int*, unsigned long "
     "long*, unsigned long long const*, long*, long const*, long*, long const*, int, int, int)", "memory",
     "sort / scan"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_kernel_impl<"
     "at::native::OpaqueType<4> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, "
     "char const*, long)#1}>(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>, at::native::"
     "index_kernel_impl<at::native::OpaqueType<4> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)"
     "::{lambda(char*, char const*, long)#1} const&)::{lambda(int)#1}>(long, at::native::gpu_index_kernel<at::native::"
     "index_kernel_impl<at::native::OpaqueType<4> >(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)"
     "::{lambda(char*, char const*, long)#1}>(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>, "
     "at::native::index_kernel_impl<at::native::OpaqueType<4> >(at::TensorIteratorBase&, c10::ArrayRef<long>, "
     "c10::ArrayRef<long>)::{lambda(char*, char const*, long)#1} const&)::{lambda(int)#1})", "memory",
     "index / scatter / gather"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy_aligned16_contig<at::native::(anonymous namespace)"
     "::OpaqueType<4u>, unsigned int, 3, 128, 1>(at::native::(anonymous namespace)::OpaqueType<4u>*, at::native::"
     "(anonymous namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<4u>, unsigned "
     "int, 128, 1>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)",
     "memory", "cat"),
    ("void at::native::triu_tril_kernel<bool, int, false, 4, true>(at::cuda::detail::TensorInfo<bool, int>, "
     "at::cuda::detail::TensorInfo<bool const, int>, long, long, long, long)", "memory", "tril / triu"),
]

UNKNOWN_KERNELS = [
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "void my_extension::custom_kernel<float>(float*, int)",
    # A word in the template arguments does not decide the class: only the kernel's own name does.
    "void my_extension::launch<at::native::softmax_functor<float>, gemm_config>(float*)",
    "void cutlass::Kernel2<my_conv_fprop_kernel>(my_conv_fprop_kernel::Params)",
    "",
]


@pytest.mark.parametrize("name,cls,label", REAL_KERNELS, ids=[n[:60] for n, _, _ in REAL_KERNELS])
def test_real_kernel_names_are_classified(name, cls, label):
    assert classify(name) == (cls, label)


@pytest.mark.parametrize("name", UNKNOWN_KERNELS)
def test_unknown_kernels_are_not_guessed(name):
    assert classify(name) == (None, None)


def test_every_table_entry_is_exercised_by_a_real_name():
    """Each row of KERNEL_CLASSES is the first match of some real name: no row is dead or shadowed."""
    hit = set()
    for name, _, _ in REAL_KERNELS:
        ident = breakdown.kernel_id(name)
        hit.add(next(i for i, (pattern, _, _) in enumerate(kernels._COMPILED) if pattern.search(ident)))
    assert hit == set(range(len(KERNEL_CLASSES)))
    assert {c for _, c, _ in KERNEL_CLASSES} == {"compute", "memory"}


def test_inductor_kernels_are_classified_by_their_prefix_not_the_ops_they_fuse():
    assert classify("triton_poi_fused__scaled_dot_product_flash_attention_backward_sdpa_3")[0] == "memory"
    assert classify("triton_red_fused_addmm_gemm_sum_2")[0] == "memory"
    assert classify("triton_tem_fused_addmm_gelu_1")[0] == "compute"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(DATA, "trace_*.json*"))))
def test_committed_gpu_traces_have_no_unknown_kernels(path):
    """Every kernel of a committed real GPU trace has a class (none is listed as unknown)."""
    bd = split(load_trace(path))
    assert bd.gpu
    assert bd.unknown == []


# ---------------------------------------------------------------------------------------------
# The split's arithmetic on a trace written by hand (times in microseconds, as in Chrome traces)

GEMM = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"
FLASH = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4> >"
         "(pytorch_flash::Flash_fwd_params)")
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
       "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)")
SOFTMAX = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
           "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)")
MYSTERY, MYSTERY2 = "my_custom_kernel", "another_mystery_kernel"
HTOD = "Memcpy HtoD (Pinned -> Device)"
MEMSET = "Memset (Device)"


def _x(cat, name, ts, dur, **args):
    e = {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur}
    if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        e["args"] = {"device": 0, "stream": 7, "correlation": int(ts), **args}
    return e


def _step(n, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 4242, "tid": 4242,
            "ts": ts, "dur": dur, "args": {"External id": n}}


def hand_trace(shift=0.0):
    """Two step windows with overlapping kernels, a copy, a memset and unknown kernels.

    Window 1, [1000, 2000]: memcpy [1010, 1020]; GEMM [1100, 1300]; add [1250, 1350] (50 under the
    GEMM); flash [1400, 1500]; mystery [1450, 1550] (50 under flash); softmax [1600, 1700]; mystery2
    [1650, 1750] (50 under softmax).
      compute 200 + 100 = 300; memory 10 + 50 + 100 = 160; unknown 50 + 50 = 100; overhead 1000 - 560 = 440.
    Window 2, [2000, 2500]: GEMM [2100, 2200]; memset [2200, 2220]; add [2450, 2550] cut at 2500.
      compute 100; memory 20 + 50 = 70; unknown 0; overhead 500 - 170 = 330.
    Outside both windows (ignored): a GEMM at 500 and an add at 3000. Ignored everywhere: the GPU copy
    of the step annotation, CPU ops, runtime calls, flow events.
    """
    s = shift
    events = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
        _step(1, 1000 + s, 1000), _step(2, 2000 + s, 500),
        _x("kernel", GEMM, 500 + s, 100),
        _x("gpu_memcpy", HTOD, 1010 + s, 10, bytes=1_000_000, **{"memory bandwidth (GB/s)": 100.0}),
        _x("kernel", GEMM, 1100 + s, 200, grid=[132, 1, 1], block=[384, 1, 1]),
        _x("kernel", ADD, 1250 + s, 100),
        _x("kernel", FLASH, 1400 + s, 100),
        _x("kernel", MYSTERY, 1450 + s, 100),
        _x("kernel", SOFTMAX, 1600 + s, 100),
        _x("kernel", MYSTERY2, 1650 + s, 100),
        _x("kernel", GEMM, 2100 + s, 100),
        _x("gpu_memset", MEMSET, 2200 + s, 20, bytes=4096),
        _x("kernel", ADD, 2450 + s, 100),
        _x("kernel", ADD, 3000 + s, 100),
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "pid": 0, "tid": 7,
         "ts": 1000 + s, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 4242, "tid": 4242, "ts": 1050 + s, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 4242, "tid": 4242,
         "ts": 1060 + s, "dur": 5},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 4242, "tid": 4242, "ts": 1060 + s},
    ]
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "computeMajor": 9}],
            "traceEvents": events}


def test_split_arithmetic_by_hand():
    bd = split(hand_trace(), flops_per_step=1e9, peak_flops=1e15, peak_bandwidth=4.8e12)
    assert bd.gpu and bd.gpu_name == "NVIDIA H200" and bd.steps == 2
    per = {s["step"]: s for s in bd.per_step}
    assert per["ProfilerStep#1"] == pytest.approx({"step": "ProfilerStep#1", "window_ms": 1.0, "compute": 0.3,
                                                   "memory": 0.16, "unknown": 0.1, "overhead": 0.44})
    assert per["ProfilerStep#2"] == pytest.approx({"step": "ProfilerStep#2", "window_ms": 0.5, "compute": 0.1,
                                                   "memory": 0.07, "unknown": 0.0, "overhead": 0.33})
    assert bd.step_ms == pytest.approx(0.75)
    assert bd.ms == pytest.approx({"compute": 0.2, "memory": 0.115, "unknown": 0.05, "overhead": 0.385})
    assert sum(bd.ms.values()) == pytest.approx(bd.step_ms)
    assert sum(bd.shares.values()) == pytest.approx(1.0)
    assert bd.shares["compute"] == pytest.approx(0.2 / 0.75)
    # 1e9 FLOPs in 0.2 ms of compute: 5 TFLOP/s.
    assert bd.compute_flops == pytest.approx(5e12)


def test_split_kernel_totals_unknowns_and_transfers():
    bd = split(hand_trace(), peak_bandwidth=4.8e12)
    k = {s.name: s for s in bd.kernels}
    # Per-kernel time is its own duration (overlap not removed), cut at the window's end, per step.
    assert k[GEMM].ms_per_step == pytest.approx((200 + 100) / 1e3 / 2)
    assert k[GEMM].calls_per_step == pytest.approx(1.0)
    assert (k[GEMM].cls, k[GEMM].label) == ("compute", "GEMM (cuBLAS)")
    assert k[ADD].ms_per_step == pytest.approx((100 + 50) / 1e3 / 2)
    assert (k[HTOD].cls, k[HTOD].label) == ("memory", "memcpy")
    assert (k[MEMSET].cls, k[MEMSET].label) == ("memory", "memset")
    assert k[MYSTERY].cls is None
    assert [s.name for s in bd.kernels][:2] == [GEMM, ADD]          # longest first
    assert sorted(bd.unknown) == sorted([MYSTERY, MYSTERY2])
    t = {x.name: x for x in bd.transfers}
    assert t[HTOD].bytes_per_step == pytest.approx(500_000)
    assert t[HTOD].bandwidth == pytest.approx(1e11)                 # 1 MB in 10 us
    assert not t[HTOD].on_device and t[MEMSET].on_device
    assert t[MEMSET].bandwidth == pytest.approx(4096 / 20e-6)


def assert_gaps(bd, expected: dict) -> None:
    """bd's gaps are exactly expected's pairs, each (ms per step, count per step) within float rounding.
    Element by element: pytest 9's approx refuses a dict whose values are tuples."""
    got = {(g.before, g.after): (g.ms_per_step, g.count_per_step) for g in bd.gaps}
    assert sorted(got) == sorted(expected)
    for pair, (ms, count) in expected.items():
        assert got[pair][0] == pytest.approx(ms), pair
        assert got[pair][1] == pytest.approx(count), pair


def test_the_overhead_is_kept_gap_by_gap_with_the_activities_on_either_side():
    bd = split(hand_trace())
    # Window 1: start -> memcpy 10, memcpy -> GEMM 80, add -> flash 50 (add outlasts the GEMM), mystery ->
    # softmax 50 (mystery outlasts flash), mystery2 -> end 250. Window 2: start -> GEMM 100; the memset
    # starts as the GEMM ends (no gap); memset -> add 230; the add runs past the window's end (no gap).
    assert_gaps(bd, {(STEP_START, HTOD): (0.005, 0.5), (HTOD, GEMM): (0.04, 0.5),
                     (ADD, FLASH): (0.025, 0.5), (MYSTERY, SOFTMAX): (0.025, 0.5),
                     (MYSTERY2, STEP_END): (0.125, 0.5), (STEP_START, GEMM): (0.05, 0.5),
                     (MEMSET, ADD): (0.115, 0.5)})
    assert [(g.before, g.after) for g in bd.gaps[:2]] == [(MYSTERY2, STEP_END), (MEMSET, ADD)]   # longest first
    assert sum(g.ms_per_step for g in bd.gaps) == pytest.approx(bd.ms["overhead"])


def test_a_window_without_idle_time_has_no_gaps():
    trace = {"traceEvents": [_step(1, 0, 100), _x("kernel", ADD, 0, 60), _x("kernel", GEMM, 60, 40)]}
    bd = split(trace)
    assert bd.ms["overhead"] == 0 and bd.gaps == []


def test_a_gap_follows_the_activity_that_ended_last_and_repeats_add_up():
    # Per window: a GEMM with an add nested inside it (the add starts later but ends first), then softmax,
    # GEMM, softmax: the GEMM -> softmax pair twice a window, and in both windows.
    events = []
    for w in (0, 200):
        events += [_step(w // 200 + 1, w, 200), _x("kernel", GEMM, w + 10, 90), _x("kernel", ADD, w + 20, 10),
                   _x("kernel", SOFTMAX, w + 120, 10), _x("kernel", GEMM, w + 150, 10),
                   _x("kernel", SOFTMAX, w + 170, 5)]
    bd = split({"traceEvents": events})
    assert_gaps(bd, {(STEP_START, GEMM): (0.010, 1.0), (GEMM, SOFTMAX): (0.030, 2.0),
                     (SOFTMAX, GEMM): (0.020, 1.0), (SOFTMAX, STEP_END): (0.025, 1.0)})
    assert sum(g.ms_per_step for g in bd.gaps) == pytest.approx(bd.ms["overhead"]) == pytest.approx(0.085)


def test_a_window_without_gpu_activity_is_one_gap_from_edge_to_edge():
    trace = {"traceEvents": [_step(1, 0, 100), _step(2, 100, 50), _x("kernel", GEMM, 100, 50)]}
    bd = split(trace)
    assert [(g.before, g.after, g.ms_per_step, g.count_per_step) for g in bd.gaps] == \
        [(STEP_START, STEP_END, pytest.approx(0.05), 0.5)]


def test_split_does_not_depend_on_the_clock_origin():
    a, b = split(hand_trace()), split(hand_trace(shift=1.7e12))
    assert b.ms == pytest.approx(a.ms, abs=1e-6)


def test_overlap_goes_to_compute_first_and_the_parts_fill_the_window():
    trace = {"traceEvents": [_step(1, 0, 100), _x("kernel", ADD, 0, 100), _x("kernel", MYSTERY, 0, 100),
                             _x("kernel", GEMM, 20, 10)]}
    bd = split(trace)
    assert bd.ms == pytest.approx({"compute": 0.01, "memory": 0.09, "unknown": 0.0, "overhead": 0.0})


def test_a_trace_without_step_annotations_is_refused_with_the_fix():
    with pytest.raises(TraceError, match="schedule"):
        split({"traceEvents": [_x("kernel", GEMM, 0, 10)]})


def test_several_gpus_need_a_device():
    trace = hand_trace()
    other = _x("kernel", GEMM, 1010, 10)
    other["args"]["device"] = 1
    trace["traceEvents"].append(other)
    with pytest.raises(TraceError, match="device"):
        split(trace)
    assert split(trace, device=0).ms == pytest.approx(split(hand_trace()).ms)


def test_load_trace_reads_json_and_gzip(tmp_path):
    trace = hand_trace()
    (tmp_path / "t.json").write_text(json.dumps(trace))
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(json.dumps(trace).encode()))
    assert load_trace(tmp_path / "t.json") == trace == load_trace(tmp_path / "t.json.gz")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TraceError, match="not a Chrome trace"):
        load_trace(tmp_path / "bad.json")


# ---------------------------------------------------------------------------------------------
# A real trace from torch.profiler on this machine's CPU

CPU_STEPS = 3


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """A trace exported by torch.profiler around a tiny nn.Linear training step, as the runner profiles."""
    path = str(tmp_path_factory.mktemp("cpu") / "trace_baseline.json")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 16)
    activities = [torch.profiler.ProfilerActivity.CPU]
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=CPU_STEPS, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(1 + CPU_STEPS):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step()
    return path


def test_a_real_cpu_trace_is_split_into_cpu_ops_and_overhead(cpu_trace):
    bd = split(load_trace(cpu_trace))
    assert bd.gpu is False and bd.gpu_name == "cpu"
    assert bd.steps == CPU_STEPS
    assert set(bd.ms) == {"cpu_ops", "overhead"}
    assert bd.ms["cpu_ops"] > 0 and bd.ms["overhead"] >= 0
    assert sum(bd.ms.values()) == pytest.approx(bd.step_ms)
    assert bd.kernels == [] and bd.compute_flops is None


def test_a_cpu_run_reports_that_the_split_is_gpu_only(cpu_trace, tmp_path):
    bd = split(load_trace(cpu_trace))
    shutil.copy(cpu_trace, tmp_path / "trace_baseline.json")
    append_breakdown_csv(str(tmp_path), "baseline", "cpu-run", bd, median_step_ms=bd.step_ms)
    write_report(str(tmp_path))
    md = (tmp_path / "breakdown.md").read_text()
    assert "GPU-only" in md
    rows = _rows(tmp_path / "breakdown.csv")
    assert [r["class"] for r in rows] == ["cpu_ops", "overhead"]
    assert rows[0]["compute_tflops"] == ""


# ---------------------------------------------------------------------------------------------
# The files

CONTEXT = dict(batch_size=16, seq_len=1024, model="gpt2", data="shakespeare", device="cuda", gpu_name="NVIDIA H200",
               n_params=124439808)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _record_run(prefix, run_id, rung):
    append_run(prefix, {"run_id": run_id, "optimization": rung, "status": "ok", "message": "", **CONTEXT}, [])


@pytest.fixture
def profiled(tmp_path):
    """PREFIX with two rungs profiled, flash first, and baseline twice: the second baseline run is the latest."""
    prefix = str(tmp_path)
    trace = hand_trace()
    trace["run_id"] = "flash-1"
    with gzip.open(os.path.join(prefix, "trace_flash.json.gz"), "wt") as f:
        json.dump(trace, f)
    bd = split(trace, flops_per_step=1e9, peak_flops=989.4e12)
    _record_run(prefix, "flash-1", "flash")
    append_breakdown_csv(prefix, "flash", "flash-1", bd, median_step_ms=0.74)
    old = split(hand_trace(shift=5), flops_per_step=1e9, peak_flops=989.4e12)
    append_breakdown_csv(prefix, "baseline", "baseline-old", old, median_step_ms=9.0)
    trace = hand_trace()
    trace["run_id"] = "baseline-2"
    with open(os.path.join(prefix, "trace_baseline.json"), "w") as f:
        json.dump(trace, f)
    _record_run(prefix, "baseline-2", "baseline")
    append_breakdown_csv(prefix, "baseline", "baseline-2", split(trace, flops_per_step=1e9, peak_flops=989.4e12),
                         median_step_ms=0.5)     # the profiled 0.75 ms is 50% over: flagged
    return prefix


def test_breakdown_csv_rows(profiled):
    path = os.path.join(profiled, "breakdown.csv")
    with open(path) as f:
        assert f.readline().rstrip("\n").split(",") == BREAKDOWN_COLUMNS
    rows = _rows(path)
    assert len(rows) == 3 * 4
    flash = [r for r in rows if r["run_id"] == "flash-1"]
    assert [r["class"] for r in flash] == ["compute", "memory", "unknown", "overhead"]
    assert [float(r["ms_per_step"]) for r in flash] == pytest.approx([0.2, 0.115, 0.05, 0.385])
    assert sum(float(r["share"]) for r in flash) == pytest.approx(1.0, abs=1e-5)
    assert {r["profiled_step_ms"] for r in flash} == {"0.75"}
    assert {r["median_step_ms"] for r in flash} == {"0.74"}
    assert {r["profiled_steps"] for r in flash} == {"2"}
    assert float(flash[0]["compute_tflops"]) == pytest.approx(5.0)
    assert float(flash[0]["peak_tflops"]) == pytest.approx(989.4)


def test_latest_run_per_rung_in_ladder_order(profiled):
    df = load_breakdown(profiled)
    assert list(dict.fromkeys(df["rung"])) == ["baseline", "flash"]
    assert set(df.loc[df["rung"] == "baseline", "run_id"]) == {"baseline-2"}


def test_report_files(profiled):
    written = write_report(profiled)
    assert [os.path.basename(p) for p in written] == ["breakdown.md", "breakdown.png"]
    with open(os.path.join(profiled, "breakdown.png"), "rb") as f:
        png = f.read()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    md = open(os.path.join(profiled, "breakdown.md")).read()
    assert md.startswith("# Step-time breakdown: NVIDIA H200 · gpt2 (124M params) · batch 16 × seq_len 1024")
    assert md.index("## baseline") < md.index("## flash")
    assert "baseline-old" not in md
    # The kernels' time by kind, longest first: two unknown kernels in one row, each kind's calls and time summed.
    assert re.search(r"\| compute +\| GEMM \(cuBLAS\) +\| +1 \| +1\.0 \| +0\.150 \| +20\.0% \|\n"
                     r"\| unknown +\| - +\| +2 \| +1\.0 \| +0\.100 \| +13\.3% \|", md)
    # Top kernels, with class and time; the unknown ones listed by name; the copies' bandwidth.
    assert "`nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT`" in md
    assert "at::native::cunn_SoftMaxForward<4, float, float, float, at::native::SoftMaxForwardEpilogue>" in md
    assert re.search(r"\| 1 \| compute +\| GEMM \(cuBLAS\) +\| +1\.0 \| +0\.150 \| +20\.0% \| `nvjet_tst_", md)
    assert "- `my_custom_kernel`: 0.050 ms/step" in md
    assert "- `another_mystery_kernel`: 0.050 ms/step, 0.5 calls/step" in md
    assert "Memcpy HtoD (Pinned -> Device)" in md and "host link" in md
    # Where the overhead sits: baseline's (the hand trace) largest gap first, the sum of all gaps its overhead.
    assert "Where the GPU waits: the overhead's 5 largest parts" in md and "(0.355 of its 0.385 ms)" in md
    assert re.search(r"\| 1 \| +0\.125 \| +0\.5 \| unknown: `another_mystery_kernel` +\| \(step end\)", md)
    assert re.search(r"\| 2 \| +0\.115 \| +0\.5 \| memset: `Memset \(Device\)` +\| elementwise: `", md)
    # Neither hand-made rung has sync_every: each pays the host's time to its first launches every step.
    assert "which this rung, reading its loss back every step, pays in its own steps too" in md
    assert "hides" not in md
    assert "trace: trace_baseline.json (opens in Perfetto" in md
    assert "trace: trace_flash.json.gz (opens in Perfetto" in md
    assert "5.0 TFLOP/s, 0.5% of the 989 TFLOP/s dense bf16 peak" in md
    assert "no bytes per kernel" in md
    # baseline's profiled step (0.75 ms) is 50% over its median (0.5 ms); flash's is within 10%.
    assert "+50% (over 10%)" in md and "+1%" in md
    assert "baseline: the profiled step (0.8 ms) is more than 10% from the median" in md


def test_report_notes_a_trace_from_another_run(profiled):
    trace = load_trace(os.path.join(profiled, "trace_flash.json.gz"))
    trace["run_id"] = "flash-0"
    with gzip.open(os.path.join(profiled, "trace_flash.json.gz"), "wt") as f:
        json.dump(trace, f)
    os.remove(os.path.join(profiled, "trace_baseline.json"))
    write_report(profiled)
    md = open(os.path.join(profiled, "breakdown.md")).read()
    assert "trace_flash.json.gz is from run flash-0, not flash-1" in md
    assert "No readable trace_baseline.json in PREFIX" in md


def test_chart_bars_follow_the_ladder(profiled):
    df = load_breakdown(profiled)
    fig = plot_breakdown(df, "ctx")
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == [r for r in LADDER if r in {"baseline", "flash"}]


def test_a_foreign_breakdown_csv_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "breakdown.csv"
    path.write_text("rung,seconds\nbaseline,1\n")
    before = path.read_bytes()
    with pytest.raises(ResultsError, match="header"):
        append_breakdown_csv(str(tmp_path), "baseline", "r1", split(hand_trace()), 0.75)
    with pytest.raises(ResultsError, match="header"):
        write_report(str(tmp_path))
    assert path.read_bytes() == before


def test_write_report_without_a_breakdown_says_how_to_make_one(tmp_path):
    with pytest.raises(ResultsError, match="make profile"):
        write_report(str(tmp_path))


def test_the_hbm_peak_comes_from_the_one_gpu_table(profiled):
    from Utils.results.gpus import peak_bandwidth
    write_report(profiled)
    md = open(os.path.join(profiled, "breakdown.md")).read()
    assert f"against the HBM peak of {peak_bandwidth('NVIDIA H200') / 1e12:.2f} TB/s" in md
    assert not hasattr(breakdown, "PEAK_HBM_BANDWIDTH") and not hasattr(breakdown, "peak_hbm_bandwidth")


def test_the_chart_carries_its_provenance_and_fits(profiled):
    """A run recorded in runs.csv gives its torch, commit and date; where it records none (a profiled run
    records itself in breakdown.csv only) its trace's metadata gives them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from Utils.report.breakdown.files import _provenance, _recorded_runs
    path = os.path.join(profiled, "trace_flash.json.gz")
    trace = load_trace(path)
    trace.update(git_commit="abcdef1234567890", started_at="2026-02-03T04:05:06+00:00", torch_version="2.11.0")
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    df = load_breakdown(profiled)
    breakdowns = {rung: split(load_trace(breakdown.trace_path(profiled, rung))) for rung in ("baseline", "flash")}
    foot = _provenance(df, _recorded_runs(profiled, df), breakdowns)
    assert foot == "torch unknown, 2.11.0 · commits unknown, abcdef123456 · ran 2026-02-03"
    append_run(profiled, {"run_id": "baseline-3", "optimization": "baseline", "status": "ok", **CONTEXT,
                          "git_commit": "0123456789abcdef", "started_at": "2026-02-01T00:00:00+00:00",
                          "torch_version": "2.11.0"}, [])
    append_breakdown_csv(profiled, "baseline", "baseline-3", breakdowns["baseline"], median_step_ms=0.74)
    df = load_breakdown(profiled)
    foot = _provenance(df, _recorded_runs(profiled, df), breakdowns)
    assert foot == "torch 2.11.0 · commits 0123456789ab, abcdef123456 · ran 2026-02-01 to 2026-02-03"
    fig = plot_breakdown(df, "NVIDIA H200 · " + "a long context " * 12, foot)
    assert fig.get_supxlabel() == foot
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    box = fig.get_tightbbox(fig.canvas.get_renderer())
    width, height = fig.get_size_inches()
    assert box.x0 >= -0.01 and box.y0 >= -0.01 and box.x1 <= width + 0.01 and box.y1 <= height + 0.01


def test_a_damaged_number_in_breakdown_csv_is_named(profiled):
    path = os.path.join(profiled, "breakdown.csv")
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace(",0.75,", ",abc,", 1))
    with pytest.raises(ResultsError, match=r"line 2: profiled_step_ms='abc' is not a number"):
        load_breakdown(profiled)


def test_on_a_gpu_the_profiler_records_only_user_ranges_on_the_host(tmp_path):
    # What _host_scopes gives the profiler on a GPU, tried on a CPU's operators: the ProfilerStep#N windows
    # the breakdown splits steps by remain, the operators (hundreds per step where the host bounds a step)
    # are not recorded. Outside the context the profiler is as torch ships it.
    import torch.autograd.profiler as autograd_profiler
    from torch.profiler import ProfilerActivity, profile, schedule

    from Utils.train.loop import _host_scopes
    shipped = autograd_profiler._enable_profiler
    names = {}
    for device in ("cpu", "cuda"):
        path = tmp_path / f"{device}.json"
        x = torch.ones(8, 8)
        with _host_scopes(torch.device(device)), \
                profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                        on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
            for _ in range(3):
                x = (x @ x).tanh()
                prof.step()
        names[device] = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
        assert autograd_profiler._enable_profiler is shipped
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names["cuda"] and "aten::tanh" not in names["cuda"]
    assert "aten::tanh" in names["cpu"]


# ---------------------------------------------------------------------------------------------
# Splitting the traces that profiled runs leave (add_traces, python -m Utils.report.breakdown)

def _profiled_run_trace(prefix, rung, run_id, started_at, shift=0.0, **meta):
    """A trace as a profiled run writes it: hand_trace's steps, and in its metadata what the split needs."""
    trace = hand_trace(shift)
    trace.update(run_id=run_id, rung=rung, started_at=started_at, git_commit="abc", torch_version="2.x",
                 context=f"NVIDIA H200 · gpt2 (124M params) · batch 16 × seq_len 1024 · data {rung}-data",
                 flops_per_step="1000000000.0", peak_flops="989400000000000.0", median_step_ms="0.74", **meta)
    with gzip.open(os.path.join(prefix, f"trace_{rung}.json.gz"), "wt") as f:
        json.dump(trace, f)
    return trace


def test_add_traces_splits_each_new_trace_once_with_the_figures_its_metadata_carries(tmp_path):
    prefix = str(tmp_path)
    _profiled_run_trace(prefix, "flash", "flash-1", "2026-01-02T00:00:00")
    _profiled_run_trace(prefix, "baseline", "baseline-1", "2026-01-01T00:00:00", shift=5)
    split_now, problems = breakdown.add_traces(prefix)
    assert [rung for rung, _ in split_now] == ["baseline", "flash"] and problems == []   # oldest run first
    rows = _rows(tmp_path / "breakdown.csv")
    flash = [r for r in rows if r["run_id"] == "flash-1"]
    want = split(load_trace(os.path.join(prefix, "trace_flash.json.gz")), flops_per_step=1e9, peak_flops=989.4e12)
    assert {r["rung"] for r in flash} == {"flash"} and {r["median_step_ms"] for r in flash} == {"0.74"}
    assert float(flash[0]["compute_tflops"]) == pytest.approx(want.compute_flops / 1e12)
    assert float(flash[0]["peak_tflops"]) == pytest.approx(989.4)
    assert "flash-data" in (tmp_path / "breakdown.md").read_text()   # the newest trace's context
    assert (tmp_path / "breakdown.png").stat().st_size > 0
    assert breakdown.add_traces(prefix) == ([], []) and len(_rows(tmp_path / "breakdown.csv")) == len(rows)


def test_add_traces_keeps_every_kernel_of_each_run_in_kernels_csv(tmp_path):
    prefix = str(tmp_path)
    _profiled_run_trace(prefix, "flash", "flash-1", "2026-01-02T00:00:00")
    breakdown.add_traces(prefix)
    with open(tmp_path / "kernels.csv") as f:
        assert f.readline().rstrip("\n").split(",") == KERNEL_COLUMNS
    rows = _rows(tmp_path / "kernels.csv")
    want = split(load_trace(os.path.join(prefix, "trace_flash.json.gz")))
    # every kernel, copy and memset, longest first, each with its class, kind, calls and time a step
    assert [r["kernel"] for r in rows] == [k.name for k in want.kernels] and {r["run_id"] for r in rows} == {"flash-1"}
    got = {r["kernel"]: r for r in rows}
    assert (got[GEMM]["class"], got[GEMM]["kind"]) == ("compute", "GEMM (cuBLAS)")
    assert float(got[GEMM]["ms_per_step"]) == pytest.approx(0.15) and float(got[GEMM]["calls_per_step"]) == 1.0
    assert float(got[GEMM]["share"]) == pytest.approx(0.15 / want.step_ms)
    assert (got[MYSTERY]["class"], got[MYSTERY]["kind"]) == ("unknown", "")   # named unknown, its kind not guessed
    # the time of a class can be read without the trace: the kernels' own durations (overlaps counted whole)
    memory = sum(float(r["ms_per_step"]) for r in rows if r["class"] == "memory")
    assert memory == pytest.approx(sum(k.ms_per_step for k in want.kernels if k.cls == "memory"))
    os.remove(os.path.join(prefix, "trace_flash.json.gz"))
    breakdown.add_traces(prefix)
    assert _rows(tmp_path / "kernels.csv") == rows


def test_a_run_whose_kernels_were_kept_before_a_stop_gets_its_breakdown_rows_and_no_kernel_rows_twice(tmp_path):
    # kernels.csv is appended first: a stop before breakdown.csv's append leaves the run to split again
    prefix = str(tmp_path)
    _profiled_run_trace(prefix, "flash", "flash-1", "2026-01-02T00:00:00")
    breakdown.append_kernels_csv(prefix, "flash", "flash-1", split(load_trace(os.path.join(prefix,
                                                                                        "trace_flash.json.gz"))))
    kept = _rows(tmp_path / "kernels.csv")
    split_now, _ = breakdown.add_traces(prefix)
    assert [rung for rung, _ in split_now] == ["flash"] and len(_rows(tmp_path / "breakdown.csv")) == 4
    assert _rows(tmp_path / "kernels.csv") == kept


def test_a_run_split_before_kernels_csv_existed_adds_its_kernels_alone_once(tmp_path):
    prefix = str(tmp_path)
    trace = _profiled_run_trace(prefix, "flash", "flash-1", "2026-01-02T00:00:00")
    append_breakdown_csv(prefix, "flash", "flash-1", split(trace), 0.74)   # as schema version 5 left it
    before = _rows(tmp_path / "breakdown.csv")
    assert breakdown.add_traces(prefix) == ([], [])                         # no new split to report
    rows = _rows(tmp_path / "kernels.csv")
    assert [r["kernel"] for r in rows] == [k.name for k in split(trace).kernels] and {r["run_id"] for r in rows} == {
        "flash-1"}
    assert _rows(tmp_path / "breakdown.csv") == before
    breakdown.add_traces(prefix)
    assert _rows(tmp_path / "kernels.csv") == rows


def test_a_foreign_kernels_csv_is_refused_before_anything_is_appended(tmp_path):
    _profiled_run_trace(str(tmp_path), "flash", "flash-1", "2026-01-02T00:00:00")
    path = tmp_path / "kernels.csv"
    path.write_text("kernel,seconds\ngemm,1\n")
    before = path.read_bytes()
    with pytest.raises(ResultsError, match="header"):
        breakdown.add_traces(str(tmp_path))
    assert path.read_bytes() == before and not (tmp_path / "breakdown.csv").exists()


@pytest.mark.parametrize("meta", [{}, {"run_id": "old-1"}], ids=["no run", "no figures"])
def test_add_traces_leaves_a_trace_without_the_runs_metadata_alone(tmp_path, meta):
    # none: not written by a profiled run; a run_id alone: from before traces carried their figures
    with open(tmp_path / "trace_flash.json", "w") as f:
        json.dump({**hand_trace(), **meta}, f)
    assert breakdown.add_traces(str(tmp_path)) == ([], [])
    assert not (tmp_path / "breakdown.csv").exists() and not (tmp_path / "breakdown.md").exists()


def test_a_trace_that_cannot_be_split_holds_up_no_other(tmp_path):
    _profiled_run_trace(str(tmp_path), "fused", "fused-1", "2026-01-01T00:00:00")
    (tmp_path / "trace_flash.json").write_text("{not json")
    trace = {**hand_trace(), "run_id": "odd-1", "rung": "max", "deviceProperties": 3}   # JSON, not a trace
    with open(tmp_path / "trace_max.json", "w") as f:
        json.dump(trace, f)
    split_now, problems = breakdown.add_traces(str(tmp_path))
    assert [rung for rung, _ in split_now] == ["fused"]
    assert sorted(p.split(":")[0] for p in problems) == ["trace_flash.json", "trace_max.json"]
    assert {r["run_id"] for r in _rows(tmp_path / "breakdown.csv")} == {"fused-1"}


def _split_cli(*args):
    return subprocess.run([sys.executable, "-m", "Utils.report.breakdown", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)


def test_the_command_prints_a_line_per_trace_split_and_nothing_twice(tmp_path):
    _profiled_run_trace(str(tmp_path), "fused", "fused-1", "2026-01-01T00:00:00")
    r = _split_cli("--prefix", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert re.search(r"^profile \| fused: compute [\d.]+ ms, memory", r.stdout, re.M)
    again = _split_cli("--prefix", str(tmp_path))
    assert again.returncode == 0 and "profile |" not in again.stdout


@pytest.mark.parametrize("case", ["no folder", "foreign csv"])
def test_the_command_refuses_bad_input_in_one_line_and_keeps_breakdown_csv(tmp_path, case):
    prefix = tmp_path / "out"
    if case != "no folder":
        prefix.mkdir()
        _profiled_run_trace(str(prefix), "fused", "fused-1", "2026-01-01T00:00:00")
        (prefix / "breakdown.csv").write_text("a,b\n1,2\n")
    before = (prefix / "breakdown.csv").read_bytes() if (prefix / "breakdown.csv").exists() else None
    r = _split_cli("--prefix", str(prefix))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    after = (prefix / "breakdown.csv").read_bytes() if (prefix / "breakdown.csv").exists() else None
    assert after == before


def test_the_command_splits_the_good_traces_and_names_the_bad_one_in_one_line(tmp_path):
    _profiled_run_trace(str(tmp_path), "fused", "fused-1", "2026-01-01T00:00:00")
    (tmp_path / "trace_flash.json").write_text("{not json")
    r = _split_cli("--prefix", str(tmp_path))
    assert r.returncode == 2 and "profile | fused:" in r.stdout
    assert r.stderr.startswith("error: 1 trace(s)") and "trace_flash.json" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert {x["run_id"] for x in _rows(tmp_path / "breakdown.csv")} == {"fused-1"}


def test_the_runs_metadata_survives_quotes_backslashes_and_tabs_in_a_real_trace(tmp_path):
    # a DATA path may hold any of them, and the run's context names it
    from Utils.train.loop import _metadata_text
    path = str(tmp_path / "trace_fused.json")
    model = torch.nn.Linear(4, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        prof.add_metadata("context", _metadata_text('data C:\\my "texts"\tdir'))
        model(torch.randn(2, 4)).sum().backward()
    assert load_trace(path)["context"] == "data C:/my 'texts' dir"


@pytest.mark.parametrize("rung, hides", [("max", True), ("max-sync_every", False), ("fused", False)])
def test_the_gap_table_says_whether_the_rung_hides_its_launch_latency(rung, hides):
    # Only a run with sync_every queues steps ahead of the GPU between read-backs (Utils/train/loop.py).
    text = "\n".join(render._gap_section(split(hand_trace()), rung))
    assert ("`sync_every` hides" in text) == hides
    assert ("reading its loss back every step" in text) == (not hides)


def test_the_gap_table_names_the_addition_the_registry_says_defers_the_read_back(monkeypatch):
    # The fact, not the name: were prefetch the addition that reads back every few steps, max would hide by it.
    for name, deferred in (("prefetch", True), ("sync_every", False)):
        monkeypatch.setitem(ADDITIONS, name, dataclasses.replace(ADDITIONS[name], readback_deferred=deferred))
    text = "\n".join(render._gap_section(split(hand_trace()), "max"))
    assert "which `prefetch` hides in every unprofiled step" in text and "sync_every" not in text
