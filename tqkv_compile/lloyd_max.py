"""Lloyd-Max scalar quantizer for the coordinates of a rotated unit vector.

After an orthonormal rotation, each coordinate of a D-dimensional unit vector is close to N(0, 1/D).
The optimal 2^b-level quantizer for that distribution is found by Lloyd's iteration.

The numbers must be vLLM's to the last bit (its store kernel compares against midpoints derived from
these centroids), so the iteration follows the same numerical recipe: 200-interval trapezoid integration
on [-10.5 sigma, 10.5 sigma], start from uniform cells on [-3.5 sigma, 3.5 sigma], stop when no centroid
moves by 1e-10. A test checks the table against vLLM's own.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def _trapezoid(f, a: float, b: float, intervals: int = 200) -> float:
    step = (b - a) / intervals
    total = 0.5 * (f(a) + f(b))
    for i in range(1, intervals):
        total += f(a + i * step)
    return total * step


def _solve(dim: int, bits: int, max_iter: int = 200, tol: float = 1e-10) -> list[float]:
    levels = 2**bits
    variance = 1.0 / dim
    sigma = math.sqrt(variance)
    norm_const = 1.0 / math.sqrt(2 * math.pi * variance)

    def pdf(x: float) -> float:
        return norm_const * math.exp(-x * x / (2 * variance))

    def first_moment(x: float) -> float:
        return x * pdf(x)

    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(max_iter):
        cuts = [(centroids[i] + centroids[i + 1]) / 2.0 for i in range(levels - 1)]
        edges = [lo * 3, *cuts, hi * 3]
        updated = []
        for i in range(levels):
            mass = _trapezoid(pdf, edges[i], edges[i + 1])
            moment = _trapezoid(first_moment, edges[i], edges[i + 1])
            updated.append(moment / mass if mass > 1e-15 else centroids[i])
        if max(abs(u - c) for u, c in zip(updated, centroids)) < tol:
            break
        centroids = updated
    return centroids


@lru_cache(maxsize=None)
def _tables(dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    centroids = torch.tensor(_solve(dim, bits), dtype=torch.float32)
    midpoints = (centroids[:-1] + centroids[1:]) / 2
    return centroids, midpoints


def centroids(dim: int, bits: int) -> torch.Tensor:
    """fp32 [2^bits] sorted centroids for N(0, 1/dim)."""
    return _tables(dim, bits)[0].clone()


def midpoints(dim: int, bits: int) -> torch.Tensor:
    """fp32 [2^bits - 1] decision boundaries, computed in fp32 from the fp32 centroids (as vLLM does)."""
    return _tables(dim, bits)[1].clone()
