"""Fixtures for the device layer's CPU tests: a small sim device with its own gate."""
from __future__ import annotations

import threading

import pytest

from gpu_worker.device import Device
from gpu_worker.device.backend import KernelArg
from gpu_worker.device.gate import CaptureGate
from gpu_worker.device.sim_backend import SimBackend
from gpu_worker.device.sim_kernels import register_sim_kernel

KiB = 1 << 10
GRANULE = 64 * KiB

# Test kernels (the image only has to name the entry, as a real PTX/CUBIN does).
IMAGE = b".entry copy_u8 .entry add_one .entry wait_then_copy"
GATES: dict[int, threading.Event] = {}


@register_sim_kernel("copy_u8")
def _copy(mem, grid, block, args: list[KernelArg]) -> None:
    n = args[2].value
    mem.view(args[1].value, n)[:] = mem.view(args[0].value, n)


@register_sim_kernel("add_one")
def _add_one(mem, grid, block, args: list[KernelArg]) -> None:
    mem.view(args[0].value, args[1].value)[:] += 1


@register_sim_kernel("wait_then_copy")
def _wait_then_copy(mem, grid, block, args: list[KernelArg]) -> None:
    """A kernel still running: blocks on GATES[id] (the test opens it), then reads its source."""
    assert GATES[args[3].value].wait(10), "test never released the kernel"
    n = args[2].value
    mem.view(args[1].value, n)[:] = mem.view(args[0].value, n)


def make_device(budget=None, weight_budget=None, gate=None, total=256 << 20,
                report_interval_s: float | None = 0) -> Device:
    backend = SimBackend(total_bytes=total, granule_bytes=GRANULE, context_bytes=16 << 20)
    return Device(backend, budget=budget, reserve_bytes=total, gate=gate or CaptureGate(),
                  weight_budget_bytes=weight_budget, report_interval_s=report_interval_s)


@pytest.fixture
def dev():
    d = make_device()
    yield d
    d.close()
