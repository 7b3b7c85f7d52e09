"""Triton kernels of the CUDA path. Each has a tensor twin that it is tested equal to; the CPU
(and a CUDA machine without Triton) runs the twin.

* :mod:`kvpop.kernels.decay`: the decaying cache's eviction times (``trimkv``), twin
  :func:`kvpop.selection.decaying_eviction_times_reference`.
* :mod:`kvpop.kernels.insert`: a decoded token's arrival in the bounded cache (the leaver's score,
  the victim slot, the two-slot write), twin :meth:`kvpop.decode.engine.DecodeEngine._insert`'s
  tensor code; tested on the CPU under Triton's interpreter (tests/test_kernels.py).
* :mod:`kvpop.kernels.order`: the prefix order statistic (a wavelet matrix) behind the selection's
  eviction times and the boundary labels, twin :func:`kvpop.order.prefix_kth_smallest_reference`;
  tested under the interpreter too.
* :mod:`kvpop.kernels.blockmask`: the training BlockMask's block lists, twin
  :func:`kvpop.masks.block_lists_reference`; tested under the interpreter too.

The last two are on by default on CUDA; ``KVPOP_SELECTION_KERNELS=0`` runs their twins instead
(:func:`selection_kernels_enabled`), after their GPU tests (tests/test_gpu.py, tests/test_order.py)
ran green on an H200 (BENCHMARKS.md).

tests/test_kernels.py also compiles every kernel to a cubin for sm_80 and sm_90 on the CPU.

Kernels import nothing from the library (the library dispatches to them), so no import cycle forms.
"""

from __future__ import annotations

import functools
import importlib.util
import os

SELECTION_KERNELS_ENV = "KVPOP_SELECTION_KERNELS"


def selection_kernels_enabled() -> bool:
    """Whether the training selection's kernels (:mod:`kvpop.kernels.order`, :mod:`kvpop.kernels.blockmask`)
    run on CUDA: yes where Triton is installed, unless ``KVPOP_SELECTION_KERNELS=0`` asks for their
    tensor twins (to compare the two, as bench/kernels/bench_selection.py does, or to rule a kernel out)."""
    value = os.environ.get(SELECTION_KERNELS_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{SELECTION_KERNELS_ENV} must be 0 (the tensor twins) or 1 (the Triton kernels), got {value!r}")
    return value == "1" and triton_available()


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (CUDA builds of torch ship it; the CPU build does not)."""
    return importlib.util.find_spec("triton") is not None
