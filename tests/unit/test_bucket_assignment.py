"""compute_bucket_assignment_by_size: the reducer seed's cases, then properties."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commsched import compute_bucket_assignment_by_size


def test_single_limit_single_dtype():
    tensors = [
        torch.empty([100], dtype=torch.float),
        torch.empty([200], dtype=torch.float),
        torch.empty([100], dtype=torch.float),
        torch.empty([50], dtype=torch.float),
    ]
    result = compute_bucket_assignment_by_size(tensors, [400])
    assert result == [[0], [1], [2], [3]]


def test_single_limit_multi_dtype():
    tensors = [
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
    ]
    result = compute_bucket_assignment_by_size(tensors, [400])
    assert result == [[0, 2], [1, 3], [4], [5]]


def test_multi_limit_single_dtype():
    tensors = [
        torch.empty([10], dtype=torch.float),
        torch.empty([10], dtype=torch.float),
        torch.empty([10], dtype=torch.float),
        torch.empty([10], dtype=torch.float),
    ]
    result = compute_bucket_assignment_by_size(tensors, [40, 80])
    assert result == [[0], [1, 2], [3]]


def test_multi_limit_multi_dtype():
    tensors = [
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
        torch.empty([50], dtype=torch.float),
        torch.empty([25], dtype=torch.double),
    ]
    result = compute_bucket_assignment_by_size(tensors, [200, 400])
    assert result == [[0], [1], [2, 4], [3, 5]]


def test_rejects_bad_limits_and_sparse_tensors():
    import pytest

    with pytest.raises(ValueError, match="at least one limit"):
        compute_bucket_assignment_by_size([torch.empty(3)], [])
    with pytest.raises(ValueError, match="> 0 bytes"):
        compute_bucket_assignment_by_size([torch.empty(3)], [0])
    with pytest.raises(ValueError, match="sparse"):
        compute_bucket_assignment_by_size([torch.empty(3).to_sparse()], [10])


DTYPES = [torch.float32, torch.float64, torch.float16]
tensor_specs = st.lists(
    st.tuples(st.integers(min_value=1, max_value=300), st.sampled_from(DTYPES)), min_size=0, max_size=40
)
limit_lists = st.lists(st.integers(min_value=1, max_value=2000), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(specs=tensor_specs, limits=limit_lists)
def test_assignment_properties(specs, limits):
    tensors = [torch.empty(numel, dtype=dtype) for numel, dtype in specs]
    buckets = compute_bucket_assignment_by_size(tensors, limits)
    size = [t.numel() * t.element_size() for t in tensors]

    # Every tensor in exactly one bucket; no empty bucket.
    flat = sorted(i for bucket in buckets for i in bucket)
    assert flat == list(range(len(tensors)))
    assert all(buckets)
    assert (len(buckets) > 0) == (len(tensors) > 0), (buckets, specs)
    # One dtype per bucket, indices ascending inside, buckets ordered by smallest index.
    for bucket in buckets:
        assert len({tensors[i].dtype for i in bucket}) == 1
        assert bucket == sorted(bucket)
    assert [min(b) for b in buckets] == sorted(min(b) for b in buckets)

    # Replaying per dtype: the k-th bucket of a dtype is closed by limits[min(k, last)];
    # every bucket but the last of its dtype reached its limit, and only with its last tensor.
    replayed = 0
    for dtype in DTYPES:
        of_dtype = sorted((b for b in buckets if tensors[b[0]].dtype == dtype), key=min)
        replayed += len(of_dtype)
        for k, bucket in enumerate(of_dtype):
            limit = limits[min(k, len(limits) - 1)]
            total = sum(size[i] for i in bucket)
            if k < len(of_dtype) - 1:
                assert total >= limit
                assert total - size[bucket[-1]] < limit
            else:
                assert total - size[bucket[-1]] < limit
        # Buckets of one dtype hold consecutive runs of that dtype's tensors.
        indices = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        assert [i for b in of_dtype for i in b] == indices
    assert replayed == len(buckets), "a bucket of a dtype outside DTYPES was not replayed"
