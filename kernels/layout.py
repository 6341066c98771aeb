"""Alignment of the unified pool layout that kernels and the adapter packer must agree on (DESIGN §2)."""

# Every row of an adapter's A or Bᵀ starts at a multiple of ALIGN elements, and page_elems is a
# multiple of ALIGN, so a kernel tile of up to ALIGN elements of one row never crosses a page.
ALIGN = 64


def align_up(n: int, multiple: int = ALIGN) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    return (n + multiple - 1) // multiple * multiple


# Host-side integer helpers for the wrappers. triton.cdiv and triton.next_power_of_2 are JIT-callable
# functions, and on the host each call cost about 2.6 µs in Triton 3.9 (timeit on the 2-core development
# machine): the wrappers of one eager step made thousands of them.
def cdiv(n: int, d: int) -> int:
    """Ceiling of n / d for positive d."""
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()
