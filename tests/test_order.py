"""kvpop.order.prefix_kth_smallest (wavelet matrix) against a brute-force twin: sort values[:prefix],
take the kth (1-based) element; -1 where kth < 1 or kth > prefix."""

import pytest
import torch

from kvpop.order import prefix_kth_smallest

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def brute_force(values: torch.Tensor, prefix: torch.Tensor, kth: torch.Tensor, *, one_based: bool = True) -> torch.Tensor:
    """For every (row, query): sorted(values[row, :prefix])[kth - 1], or -1 for an invalid rank.

    ``one_based=False`` is a deliberately wrong (off-by-one) variant, used to show the comparison can fail.
    """
    out = torch.full(prefix.shape, -1, dtype=torch.int64)
    for i in range(prefix.shape[0]):
        row = values[i].tolist()
        for j in range(prefix.shape[1]):
            p, k = int(prefix[i, j]), int(kth[i, j])
            srt = sorted(row[:p])
            idx = k - 1 if one_based else k
            if 1 <= k <= p and 0 <= idx < p:
                out[i, j] = srt[idx]
    return out


def random_case(N: int, n: int, m: int, vmax: int, seed: int):
    """values in [0, vmax] (many duplicates when vmax is small), prefixes in [0, n], ranks in
    [-1, n + 2] (valid, zero, negative and beyond the prefix)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, vmax + 1, (N, n), generator=g)
    prefix = torch.randint(0, n + 1, (N, m), generator=g)
    # half the ranks inside [1, prefix] so most queries are valid, the rest anywhere in [-1, n + 2]
    inside = 1 + (torch.rand(N, m, generator=g) * prefix).long()
    anywhere = torch.randint(-1, n + 3, (N, m), generator=g)
    kth = torch.where(torch.rand(N, m, generator=g) < 0.5, inside, anywhere)
    return values, prefix, kth


# hand-computed: values 5 1 4 1 3 (sorted: 1 1 3 4 5)
HAND_VALUES = torch.tensor([[5, 1, 4, 1, 3]])
HAND_PREFIX = torch.tensor([[5, 5, 5, 3, 1, 0, 4, 2, 5, 4]])
HAND_KTH = torch.tensor([[1, 2, 5, 2, 1, 1, 0, 3, 6, -1]])
#   prefix 5, k 1 -> 1; k 2 -> 1 (the duplicate); k 5 -> 5; prefix 3 (5 1 4), k 2 -> 4; prefix 1, k 1 -> 5;
#   prefix 0 -> -1; k 0 -> -1; k 3 > prefix 2 -> -1; k 6 > prefix 5 -> -1; k -1 -> -1
HAND_ANSWER = torch.tensor([[1, 1, 5, 4, 5, -1, -1, -1, -1, -1]])


def test_hand_computed_answers():
    assert torch.equal(brute_force(HAND_VALUES, HAND_PREFIX, HAND_KTH), HAND_ANSWER)
    # the off-by-one twin gets it wrong, so the twin comparison below has teeth
    assert not torch.equal(brute_force(HAND_VALUES, HAND_PREFIX, HAND_KTH, one_based=False), HAND_ANSWER)
    for bits in (None, 3, 8):
        got = prefix_kth_smallest(HAND_VALUES, HAND_PREFIX, HAND_KTH, bits=bits)
        assert got.dtype == torch.int64
        assert torch.equal(got, HAND_ANSWER), bits


@pytest.mark.parametrize(
    ("N", "n", "m", "vmax"),
    [
        (1, 1, 5, 0),  # a single value, all zeros (inferred bits: 1)
        (3, 7, 20, 2),  # many duplicates
        (4, 16, 40, 15),  # exactly 4 bits
        (2, 33, 50, 16),  # 16 needs 5 bits
        (5, 64, 64, 1000),
        (2, 200, 100, 3),  # long rows, few distinct values
        (3, 50, 30, 2**20 + 7),  # wide values
    ],
)
@pytest.mark.parametrize("bits_mode", ["inferred", "exact", "extra"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_brute_force(N, n, m, vmax, bits_mode, seed):
    values, prefix, kth = random_case(N, n, m, vmax, seed)
    exact = max(1, int(values.max()).bit_length())
    bits = {"inferred": None, "exact": exact, "extra": exact + 3}[bits_mode]
    want = brute_force(values, prefix, kth)
    got = prefix_kth_smallest(values, prefix, kth, bits=bits)
    assert got.shape == (N, m) and got.dtype == torch.int64
    assert torch.equal(got, want)
    # the case is not vacuous: valid and invalid queries both occur, and the off-by-one twin disagrees
    assert (want >= 0).any() and (want == -1).any()
    if n > 1 and vmax > 0:
        assert not torch.equal(got, brute_force(values, prefix, kth, one_based=False))


def test_input_dtypes_and_rows_are_independent():
    """int32 inputs give the same answers; each row answers from its own values only."""
    values, prefix, kth = random_case(6, 40, 25, 9, seed=3)
    want = brute_force(values, prefix, kth)
    got = prefix_kth_smallest(values.int(), prefix.int(), kth.int())
    assert torch.equal(got, want)
    for i in range(6):
        assert torch.equal(prefix_kth_smallest(values[i : i + 1], prefix[i : i + 1], kth[i : i + 1]), want[i : i + 1])


def test_full_prefix_ranks_are_the_sorted_row():
    """Ranks 1..n over the whole row enumerate the sorted values; prefix p, rank p is the prefix maximum."""
    g = torch.Generator().manual_seed(4)
    values = torch.randint(0, 12, (3, 30), generator=g)
    n = values.shape[1]
    kth = torch.arange(1, n + 1).expand(3, n)
    got = prefix_kth_smallest(values, torch.full((3, n), n), kth)
    assert torch.equal(got, values.sort(-1).values)
    p = torch.arange(1, n + 1).expand(3, n)
    assert torch.equal(prefix_kth_smallest(values, p, p), values.cummax(-1).values)


@CUDA
@pytest.mark.parametrize("kernels", ["0", "1"])
def test_cuda_matches_cpu(monkeypatch, kernels):
    """On CUDA: the tensor twin, and the Triton kernels (kvpop.kernels.order, the default) with a block boundary inside the row."""
    monkeypatch.setenv("KVPOP_SELECTION_KERNELS", kernels)
    values, prefix, kth = random_case(8, 5000, 300, 50, seed=5)
    cpu = prefix_kth_smallest(values, prefix, kth)
    gpu = prefix_kth_smallest(values.cuda(), prefix.cuda(), kth.cuda())
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(cpu, brute_force(values, prefix, kth))


@CUDA
@pytest.mark.parametrize("split", [False, True])
def test_cuda_kernels_build_by_blocks_as_by_sequence(split):
    """On CUDA the wavelet levels built by a grid over blocks (kvpop.kernels.order.split_build: few long sequences, the
    pooled prefill's) and by one program per sequence give the tensor twin's answers, on rows of about 148K values
    (its size at Qwen3-4B) and a short one."""
    from kvpop.kernels.order import wavelet_kth_smallest
    from kvpop.order import prefix_kth_smallest_reference

    for N, n, vmax in [(1, 148_000, 147_999), (2, 70_000, 500), (3, 100, 7)]:
        values, prefix, kth = random_case(N, n, 2000, vmax, seed=n)
        bits = max(1, vmax.bit_length())
        want = prefix_kth_smallest_reference(values, prefix, kth, bits=bits)
        got = wavelet_kth_smallest(values.cuda(), prefix.cuda(), kth.cuda(), bits, split=split)
        assert torch.equal(got.cpu(), want), (N, n, split)
