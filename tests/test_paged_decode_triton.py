"""The Triton paged decode kernels (plain and group-shared) against the torch reference paths.

The kernel cases live in tests/paged_decode_triton_cases.py and
tests/cascade_decode_triton_cases.py and run in a fresh process: in Triton's CPU interpreter (TRITON_INTERPRET=1, which must be set
before triton is first imported) without a GPU, compiled on a CUDA machine.
triton comes with the dev extra.
"""

from kernel_cases import assert_cases_pass, assert_imports_without_triton
from rollplex.ops import paged_decode_triton as pdt


def test_module_imports_without_triton():
    assert_imports_without_triton(["rollplex.ops.paged_decode_triton as m", "rollplex.ops.cascade_decode_triton"],
                                  "assert not m.triton_available()")


def test_kernel_cases():
    assert_cases_pass(["paged_decode_triton_cases.py", "cascade_decode_triton_cases.py"], timeout=900)


def test_default_num_splits_shape_only():
    # Many sequences: the (sequence, kv head) programs fill the GPU, no split.
    assert pdt.default_num_splits(64, 4, 8192, 64, 132) == 1
    # Short context: not worth splitting.
    assert pdt.default_num_splits(1, 2, 128, 64, 132) == 1
    # One long sequence: split, bounded.
    n = pdt.default_num_splits(1, 2, 32768, 64, 132)
    assert 1 < n <= 64
