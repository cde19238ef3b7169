"""``sum64``: the bucket digest of a weight broadcast whose source is on a GPU, computed where the
bytes are (hashing on the host would copy every byte across PCIe and take longer than moving it).

Two sums, modulo 2^64, of the buffer's 64-bit words (then its last bytes, one a word) times odd
pseudo-random multipliers drawn from each word's position (splitmix64 of the index): a changed
word always changes both (an odd multiplier is invertible modulo 2^64), and words swapped or
moved change them but for a 2^-64 chance. It is a checksum against damage, not a MAC: who may
send is decided by the API keys that seat a member.

On CUDA with Triton (which CUDA builds of torch bring) one kernel reads each byte once, and
``copy_sum64`` also writes it to a destination as it goes, so a receiver checks a bucket in the
time of copying it. Elsewhere the same numbers come from torch ops (several passes).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK = 4096  # words per Triton program


def sum64(buffer: torch.Tensor) -> torch.Tensor:
    """The 16-byte digest (uint8, on the host) of a uint8 buffer on any device."""
    return _digest(buffer, None)


def copy_sum64(source: torch.Tensor, destination: torch.Tensor) -> torch.Tensor:
    """``destination.copy_(source)`` and ``sum64(destination)``, in one pass where a kernel can."""
    return _digest(source, destination)


def _digest(source: torch.Tensor, destination: torch.Tensor | None) -> torch.Tensor:
    whole = source.numel() - source.numel() % 8
    same_device = destination is None or destination.device == source.device
    kernel = _kernel() if source.is_cuda and whole and same_device else None
    if kernel is not None and source.data_ptr() % 8 == 0 and (destination is None or destination.data_ptr() % 8 == 0):
        words = source[:whole].view(torch.int64)
        into = destination[:whole].view(torch.int64) if destination is not None else words
        programs = -(-words.numel() // BLOCK)
        partial = torch.empty(2, programs, dtype=torch.int64, device=source.device)
        kernel[(programs,)](words, into, partial, words.numel(), programs, BLOCK=BLOCK, COPY=destination is not None)
        sums = partial.sum(dim=1)
        if destination is not None:
            destination[whole:].copy_(source[whole:])
    else:
        if destination is not None:
            destination.copy_(source)
            source = destination
        words = source[:whole].view(torch.int64)
        sums = torch.stack([(words * multipliers(0, words.numel(), lane, source.device)).sum() for lane in (0, 1)])
    if whole < source.numel():  # (most buckets are whole words: no launches for an empty tail)
        tail = source[whole:].to(torch.int64)
        sums = sums + torch.stack(
            [(tail * multipliers(whole // 8, tail.numel(), lane, source.device)).sum() for lane in (0, 1)]
        )
    return sums.cpu().view(torch.uint8)


def multipliers(first: int, count: int, lane: int, device: torch.device) -> torch.Tensor:
    """The odd multipliers of words ``first`` .. ``first + count`` in ``lane`` (0 or 1)."""
    index = torch.arange(first, first + count, dtype=torch.int64, device=device)
    return _splitmix64(index * 2 + lane) | 1


def _signed(constant: int) -> int:
    return constant - (1 << 64) if constant >= 1 << 63 else constant


GOLDEN, MIX1, MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    # (int64 shifts are arithmetic in torch and Triton alike: not splitmix64's exact numbers, but
    # the same ones on every device)
    x = x + GOLDEN
    x = (x ^ (x >> 30)) * MIX1
    x = (x ^ (x >> 27)) * MIX2
    return x ^ (x >> 31)


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def sum64_kernel(words, into, partial, n, programs, BLOCK: tl.constexpr, COPY: tl.constexpr):
        program = tl.program_id(0)
        index = program.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = index < n
        x = tl.load(words + index, mask=inside, other=0)
        if COPY:
            tl.store(into + index, x, mask=inside)
        for lane in tl.static_range(2):
            # _splitmix64 with GOLDEN, MIX1 and MIX2 written out (a kernel reads no module globals)
            k = index * 2 + lane + -7046029254386353131
            k = (k ^ (k >> 30)) * -4658895280553007687
            k = (k ^ (k >> 27)) * -7723592293110705685
            k = (k ^ (k >> 31)) | 1
            tl.store(partial + lane * programs + program, tl.sum(x * k, axis=0))

    return sum64_kernel
