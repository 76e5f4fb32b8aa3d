"""``bench backends --profile``'s summary on the CPU: kernel kinds by name, the GPU's busy time as a union, host syncs
counted by the code that caused them."""

from __future__ import annotations

import warnings

import pytest
import torch

from actors.commands.bench.step_profile import (
    SYNC_WARNING,
    busy_time,
    categorise,
    device_intervals,
    recording_sync_sites,
    top_ops,
)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl"),
        ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>", "gemm"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "gemm"),
        ("void at::cuda::detail::grouped_mm_kernel<cutlass::bfloat16_t>", "grouped_gemm"),
        ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long>", "copy"),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>",
            "reduction",
        ),
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


def _transposed_product(a: torch.Tensor) -> torch.Tensor:
    return a.t().contiguous() @ a


def test_top_ops_names_the_op_and_its_shapes() -> None:
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(256, 64)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            _transposed_product(a)
    ops = top_ops(prof.events(), time_attr="self_cpu_time_total")
    assert ops and all(o["op"].startswith("aten::") for o in ops)
    assert [o["s"] for o in ops] == sorted((o["s"] for o in ops), reverse=True)
    mm = next(o for o in ops if o["op"] == "aten::mm")
    assert mm["calls"] == 3 and mm["shapes"] == [[64, 256], [256, 64]]


def _waits_on_the_device() -> None:
    warnings.warn(f"called a {SYNC_WARNING}", UserWarning, stacklevel=1)  # what torch warns in sync debug mode


def test_sync_sites_name_the_frame_that_waited_and_let_other_warnings_through() -> None:
    line = _waits_on_the_device.__code__.co_firstlineno + 1
    with pytest.warns(DeprecationWarning, match="not a sync"), recording_sync_sites() as sites:
        for _ in range(3):
            _waits_on_the_device()
        warnings.warn("not a sync", DeprecationWarning, stacklevel=1)
        _waits_on_the_device()
    assert sites.top() == [{"site": f"tests/unit/test_step_profile.py:{line} _waits_on_the_device", "calls": 4}]


def _event(name: str, start_us: int, end_us: int, device: str = "DeviceType.CUDA", annotation: bool = False):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    span = SimpleNamespace(start=start_us, end=end_us, elapsed_us=lambda: end_us - start_us)
    return SimpleNamespace(name=name, device_type=device, time_range=span, is_user_annotation=annotation)


def test_a_collective_counts_once_not_with_the_range_torch_marks_around_it() -> None:
    events = [
        _event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 100, 400),
        _event("nccl:all_to_all", 100, 400),  # torch's device-side range around the same kernel
        _event("gpu_user_range", 500, 900, annotation=True),
        _event("void at::native::vectorized_elementwise_kernel<4>", 400, 450),
        _event("cudaStreamSynchronize", 0, 10, device="DeviceType.CPU"),
        _event("cudaMemcpyAsync", 20, 30, device="DeviceType.CPU"),  # short: a copy, not a wait
    ]
    kernels, syncs = device_intervals(events)
    assert [k[0] for k in kernels] == [events[0].name, events[3].name]
    assert kernels[0][1:] == pytest.approx((100e-6, 400e-6)) and syncs == 1
