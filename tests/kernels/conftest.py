"""Kernel tests run on the device named by ``LLMCTL_TEST_DEVICE`` (default ``cpu``).

On a CPU the Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``). On CUDA (``LLMCTL_TEST_DEVICE=cuda``) they compile for the GPU, which
needs ``TRITON_INTERPRET=0`` in the environment *before* pytest starts (``scripts/gpu_check.sh``
does that).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import DEVICE, interpreter_on


def pytest_configure(config):
    config.addinivalue_line("markers", "no_device: a kernel test that runs no kernel (never skipped for the device)")


def pytest_collection_modifyitems(config, items):
    reason = None
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        reason = "LLMCTL_TEST_DEVICE=cuda but no CUDA device is available"
    elif DEVICE.type == "cuda" and interpreter_on():
        reason = "TRITON_INTERPRET is on: set TRITON_INTERPRET=0 to run the kernels on CUDA"
    elif DEVICE.type == "cpu" and not interpreter_on():
        reason = "Triton kernels on a CPU need TRITON_INTERPRET=1"
    if reason is None:
        return
    here = str(config.rootpath / "tests" / "kernels")
    for item in items:
        if str(item.path).startswith(here) and "no_device" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
