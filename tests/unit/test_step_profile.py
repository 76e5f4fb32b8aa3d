"""``bench backends --profile``'s summary on the CPU: kernel kinds by name, the GPU's busy time as a union."""

from __future__ import annotations

import pytest

from actors.commands.bench.step_profile import busy_time, categorise


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "gemm"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "gemm"),
        ("void at::cuda::detail::grouped_mm_kernel<cutlass::bfloat16_t>", "grouped_gemm"),
        ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long>", "copy"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>", "reduction"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
        ("some_custom_kernel", "other"),
    ],
)
def test_categorise_by_name(name: str, kind: str) -> None:
    assert categorise(name) == kind


def test_busy_time_counts_overlaps_once() -> None:
    assert busy_time([]) == 0.0
    assert busy_time([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert busy_time([(0.0, 5.0), (1.0, 2.0)]) == pytest.approx(5.0)  # nested
    assert busy_time([(2.0, 3.0), (0.0, 1.0)]) == pytest.approx(2.0)  # unsorted
