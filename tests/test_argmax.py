"""numpy's argmax (speculant.sampling.argmax) gives ``torch.argmax``'s index on every row: random values, tied
maxima near and far apart, NaNs (the first one wins), infinities, constant rows, short and vocabulary-sized lengths,
float32/float16/float64 and bfloat16 (torch's own), non-contiguous rows; one row and rows at once."""

import pytest
import torch

from speculant.sampling.argmax import first_argmax, rows_argmax

BLOCK = 256

LENGTHS = (1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK, 3 * BLOCK + 45, 49152, 49152 + 37)


def _rows(v: int, g: torch.Generator) -> list[torch.Tensor]:
    """Rows of length ``v`` with the cases the two levels must get right (each checked against torch itself)."""
    base = torch.randn(v, generator=g)
    rows = [base, torch.full((v,), -float("inf")), torch.zeros(v), torch.full((v,), float("inf"))]
    positions = sorted({0, v // 3, v // 2, v - 1, max(0, v - 2), min(v - 1, BLOCK - 1), min(v - 1, BLOCK)})
    for k in range(1, len(positions) + 1):          # the maximum at several places: ties across blocks and the tail
        row = base.clone()
        row[positions[-k:]] = 10.0
        rows.append(row)
        row = base.clone()
        row[positions[:k]] = 10.0
        rows.append(row)
    for p in positions:                             # a NaN at one place, and a NaN after a tie of maxima
        row = base.clone()
        row[p] = float("nan")
        rows.append(row)
        row = base.clone()
        row[positions] = 10.0
        row[p] = float("nan")
        rows.append(row)
    row = base.clone()
    row[positions] = float("inf")
    rows.append(row)
    return rows


@pytest.mark.parametrize("v", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_one_row_is_torch_argmax(v, dtype):
    g = torch.Generator().manual_seed(v)
    for row in _rows(v, g):
        row = row.to(dtype)
        assert first_argmax(row) == int(torch.argmax(row)), row
        assert first_argmax(torch.stack([row, row], 1)[:, 1]) == int(torch.argmax(row))    # a strided view


@pytest.mark.parametrize("v", LENGTHS)
def test_rows_at_once_are_torch_argmax(v):
    g = torch.Generator().manual_seed(v + 1)
    rows = torch.stack(_rows(v, g))
    assert torch.equal(rows_argmax(rows), torch.argmax(rows, -1)) and rows_argmax(rows).dtype == torch.int64
    assert torch.equal(rows_argmax(rows[:1]), torch.argmax(rows[:1], -1))
    assert torch.equal(rows_argmax(rows.t().contiguous().t()), torch.argmax(rows, -1))     # column-major rows


def test_the_premises_both_libraries_document():
    """torch.argmax takes the first of tied maxima and a NaN as the maximum (its first occurrence)."""
    assert int(torch.argmax(torch.tensor([1.0, 3.0, 3.0]))) == 1
    assert int(torch.argmax(torch.tensor([1.0, float("nan"), 5.0, float("nan")]))) == 1


def test_shapes_and_views_numpy_cannot_take_go_to_torch():
    row = torch.tensor([0.5, -2.0, 3.0, 3.0])
    assert first_argmax(row.neg()) == int(torch.argmax(-row)) == 1 and first_argmax(torch._neg_view(row)) == 1
    assert torch.equal(rows_argmax(row), torch.argmax(row, -1)) and rows_argmax(row).dim() == 0
    assert torch.equal(rows_argmax(torch._neg_view(row[None])), torch.tensor([1]))
