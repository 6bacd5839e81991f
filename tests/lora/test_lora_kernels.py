"""The multi-LoRA kernels against the torch reference: the grouped torch path, the native CPU kernel
(every ISA variant this CPU runs) and the Triton kernels (under TRITON_INTERPRET=1 on a CPU), on
batches mixing adapters, ranks and base-model tokens."""

from __future__ import annotations

import pytest
import torch

from llmctl_kernels.cpu_features import isa_level, supported_isa_levels
from llmctl_kernels.cpu_native import load_native, native_unavailable_reason
from llmctl_kernels.lora import NO_ADAPTER, lora_add_grouped, lora_add_native, lora_delta_reference, plan_lora_batch


def _weights(slots: int, rank: int, k: int, n: int, dtype: torch.dtype, used_rank: list[int]):
    g = torch.Generator().manual_seed(rank * 7 + k)
    a = torch.randn(slots, rank, k, generator=g) * 0.2
    b = torch.randn(slots, n, rank, generator=g) * 0.2
    for s, r in enumerate(used_rank):  # an adapter of smaller rank: the padding is zero
        a[s, r:] = 0
        b[s, :, r:] = 0
    scale = torch.tensor([0.5 + s for s in range(slots)], dtype=torch.float32)
    return a.to(dtype), b.to(dtype), scale


# tokens of slots 2, 0, base, 1 interleaved: groups that are neither contiguous nor sorted
TOKEN_SLOTS = [2, 2, 0, NO_ADAPTER, 1, 0, 2, NO_ADAPTER] + [1] * 19 + [0, 2, NO_ADAPTER]


@pytest.mark.parametrize("rank", [8, 64])
def test_grouped_matches_reference(rank: int) -> None:
    k, n = 48, 40
    a, b, scale = _weights(3, rank, k, n, torch.float32, [rank, rank // 2, 3])
    x = torch.randn(len(TOKEN_SLOTS), k)
    base = torch.randn(len(TOKEN_SLOTS), n)
    plan = plan_lora_batch(TOKEN_SLOTS, x.device)
    out = base.clone()
    lora_add_grouped(out, x, a, b, scale, plan)
    expected = base + lora_delta_reference(x, a, b, scale, plan.slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    base_rows = [t for t, s in enumerate(TOKEN_SLOTS) if s == NO_ADAPTER]
    assert torch.equal(out[base_rows], base[base_rows])  # the base model's tokens are untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 64])
def test_triton_matches_reference(rank: int, dtype: torch.dtype) -> None:
    from llmctl_kernels.lora_triton import BLOCK_M, lora_add_triton

    k, n, wide = 48, 40, 100
    a, b, scale = _weights(3, rank, k, n, dtype, [rank, rank // 2, 3])
    x = torch.randn(len(TOKEN_SLOTS), k).to(dtype)
    full = torch.randn(len(TOKEN_SLOTS), wide).to(dtype)
    expected = full.clone()
    plan = plan_lora_batch(TOKEN_SLOTS, x.device, block_m=BLOCK_M)
    # the delta lands in a column slice of a wider output (one part of a fused projection)
    expected[:, 30 : 30 + n] = (full[:, 30 : 30 + n].float() + lora_delta_reference(x, a, b, scale, plan.slots)).to(
        dtype
    )
    lora_add_triton(full[:, 30 : 30 + n], x, a, b, scale, plan)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), expected.float(), rtol=tol, atol=tol)


def _transposed(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The native kernel's stacks: A^T [slots, in, R16], B^T [slots, R16, n], R zero-padded."""
    slots, rank, k = a.shape
    padded = -(-rank // 16) * 16
    a_t = torch.zeros(slots, k, padded, dtype=a.dtype)
    b_t = torch.zeros(slots, padded, b.shape[1], dtype=b.dtype)
    a_t[:, :, :rank] = a.transpose(1, 2)
    b_t[:, :rank] = b.transpose(1, 2)
    return a_t, b_t


@pytest.fixture(params=supported_isa_levels())
def isa(request):
    """Each kernel variant this CPU can execute, then the best one again."""
    module = load_native()
    if module is None:
        pytest.skip(f"native CPU kernels: {native_unavailable_reason()}")
    module.set_isa(request.param)
    yield request.param
    module.set_isa(isa_level())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 64])
def test_native_matches_reference(isa: str, rank: int, dtype: torch.dtype) -> None:
    """Two slices of a wider output (one 40 columns wide: a chunk narrower than 16), index groups
    and range groups, ranks padded to 16: every slice within rounding of the reference, the base
    model's rows and the columns outside the slices untouched."""
    k, sizes, offsets, wide = 72, (40, 96), (5, 50), 160
    stacks, deltas = [], []
    slots_of = [TOKEN_SLOTS, sorted(TOKEN_SLOTS)]  # the second batch: each slot's rows contiguous
    x = torch.randn(len(TOKEN_SLOTS), k).to(dtype)
    for n, offset in zip(sizes, offsets):
        a, b, scale = _weights(3, rank, k, n, dtype, [rank, rank // 2, 3])
        stacks.append((offset, n, *_transposed(a, b), scale))
        deltas.append((offset, n, a, b, scale))
    for token_slots in slots_of:
        plan = plan_lora_batch(token_slots, x.device)
        base = torch.randn(len(token_slots), wide).to(dtype)
        out = base.clone()
        lora_add_native(out, x, stacks, plan)
        expected = base.float().clone()
        for offset, n, a, b, scale in deltas:
            expected[:, offset : offset + n] += lora_delta_reference(x.float(), a, b, scale, plan.slots)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected.to(dtype).float(), rtol=tol, atol=tol)
        base_rows = [t for t, s in enumerate(token_slots) if s == NO_ADAPTER]
        assert torch.equal(out[base_rows], base[base_rows])
        untouched = [c for c in range(wide) if not any(o <= c < o + n for o, n in zip(offsets, sizes))]
        assert torch.equal(out[:, untouched], base[:, untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_batched_rows_get_their_bits_alone(isa: str, dtype: torch.dtype) -> None:
    """A row's deltas do not depend on the rows beside it (block of 8, 4, 2 or one): 37 rows over
    three adapters give each row exactly what it gets as a batch of one."""
    k, n = 96, 80
    a, b, scale = _weights(3, 16, k, n, dtype, [16, 16, 5])
    stacks = [(0, n, *_transposed(a, b), scale)]
    token_slots = [t % 3 for t in range(37)]
    x = torch.randn(len(token_slots), k).to(dtype)
    base = torch.randn(len(token_slots), n).to(dtype)
    batched = base.clone()
    lora_add_native(batched, x, stacks, plan_lora_batch(token_slots, x.device))
    for t, slot in enumerate(token_slots):
        alone = base[t : t + 1].clone()
        lora_add_native(alone, x[t : t + 1], stacks, plan_lora_batch([slot], x.device))
        assert torch.equal(alone[0], batched[t]), f"row {t}"


def test_native_refuses_bad_stacks() -> None:
    """Stacks in the wrong layout are refused with a reason, before anything is written."""
    if load_native() is None:
        pytest.skip(f"native CPU kernels: {native_unavailable_reason()}")
    k, n = 32, 16
    a, b, scale = _weights(2, 8, k, n, torch.float32, [8, 8])
    a_t, b_t = _transposed(a, b)
    out = torch.zeros(4, n)
    x = torch.randn(4, k)
    plan = plan_lora_batch([0, 1, 0, 1], x.device)
    with pytest.raises(RuntimeError, match="R a multiple of 16"):
        lora_add_native(out, x, [(0, n, a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous(), scale)], plan)
    with pytest.raises(RuntimeError, match="past the output"):
        lora_add_native(out, x, [(8, n, a_t, b_t, scale)], plan)
    with pytest.raises(RuntimeError, match="of one dtype"):
        lora_add_native(out, x, [(0, n, a_t.double(), b_t, scale)], plan)
    with pytest.raises(RuntimeError, match="activations' dtype"):
        lora_add_native(out, x, [(0, n, a_t.bfloat16(), b_t.bfloat16(), scale)], plan)
    assert not out.any()
