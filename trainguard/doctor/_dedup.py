"""Duplicate samples by hashing, and near duplicates by locality-sensitive hashing.

Exact duplicates: each sample's bytes are hashed to 64 bits with vectorised NumPy (every 8-byte
word is mixed with a splitmix64 finaliser, the words are combined with random odd weights, and
the sum is mixed again). Equal samples always hash equal; samples whose hashes collide are then
compared byte for byte, so a collision costs time but never produces a false duplicate.

Near duplicates: samples are standardised per feature and projected onto random directions; the
projections are cut into cells, and samples that share every cell of a table of projections are
candidates, compared afterwards by their actual distance. Several tables make a near copy likely
to share at least one; it is a cheap screen, not a guarantee.
"""

from __future__ import annotations

import numpy as np

_SEED = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# Rows hashed per block: keeps the temporary arrays within a few megabytes.
_BLOCK_BYTES = 1 << 22

# Near duplicates: tables of projections, projections per table, and the cell width in
# standard-deviation units (projections are onto unit vectors, so a near copy moves by about its
# per-feature noise while distinct standardised samples are spread over about sqrt(2)).
NEAR_TABLES = 4
NEAR_PROJECTIONS = 8
NEAR_CELL = 0.25
# Two samples are near duplicates when their standardised features differ by at most this RMS.
NEAR_TOL = 0.05


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on a uint64 array (wraps modulo 2**64 by design)."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def as_rows(x: np.ndarray) -> np.ndarray:
    """``(N, bytes)`` uint8 view of each sample's bytes (C order), padded to whole 8-byte words."""
    n = x.shape[0]
    raw = np.ascontiguousarray(x).reshape(n, -1).view(np.uint8).reshape(n, -1)
    pad = (-raw.shape[1]) % 8
    if pad:
        raw = np.concatenate([raw, np.zeros((n, pad), np.uint8)], axis=1)
    return raw


def row_hashes(x: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each sample's bytes (equal samples, equal hashes)."""
    rows = as_rows(x)
    n, nbytes = rows.shape
    words = rows.view(np.uint64).reshape(n, -1) if nbytes else np.zeros((n, 1), np.uint64)
    width = words.shape[1]
    rng = np.random.default_rng(20240601)
    salt = rng.integers(0, 2**63, size=width, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    weight = rng.integers(0, 2**63, size=width, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    out = np.empty(n, np.uint64)
    block = max(1, _BLOCK_BYTES // max(8 * width, 1))
    with np.errstate(over="ignore"):
        for i in range(0, n, block):
            w = words[i:i + block] ^ salt
            _mix(w)
            w *= weight
            h = w.sum(axis=1, dtype=np.uint64) ^ (_SEED + np.uint64(width))
            out[i:i + block] = _mix(h)
    return out


def duplicate_groups(x: np.ndarray, hashes: np.ndarray | None = None) -> list[np.ndarray]:
    """Groups (index arrays, two or more each) of byte-identical samples within one split."""
    if hashes is None:
        hashes = row_hashes(x)
    order = np.argsort(hashes)
    sh = hashes[order]
    same = np.flatnonzero(sh[1:] == sh[:-1])
    if same.size == 0:
        return []
    rows = as_rows(x)
    # Runs of equal hashes in sorted order; only runs of two or more can hold duplicates.
    bounds = np.flatnonzero(np.r_[True, sh[1:] != sh[:-1], True])
    groups: list[np.ndarray] = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e - s < 2:
            continue
        idx = order[s:e]
        # Within a run, split by the actual bytes (a run may hold a hash collision).
        _, inverse = np.unique(rows[idx], axis=0, return_inverse=True)
        inverse = inverse.ravel()
        for k in np.unique(inverse):
            members = np.sort(idx[inverse == k])
            if members.size > 1:
                groups.append(members)
    groups.sort(key=lambda g: int(g[0]))
    return groups


def cross_duplicates(a: np.ndarray, b: np.ndarray, ha: np.ndarray | None = None,
                     hb: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Pairs ``(i_in_b, j_in_a)``: samples of ``b`` byte-identical to a sample of ``a``."""
    ha = row_hashes(a) if ha is None else ha
    hb = row_hashes(b) if hb is None else hb
    order = np.argsort(ha)
    sa = ha[order]
    pos = np.minimum(np.searchsorted(sa, hb, side="left"), max(len(sa) - 1, 0))
    cand = np.flatnonzero(sa[pos] == hb) if len(sa) else np.empty(0, np.int64)
    if cand.size == 0:
        return []
    ra, rb = as_rows(a), as_rows(b)
    pairs = []
    lo = pos[cand]
    hi = np.searchsorted(sa, hb[cand], side="right")
    for i, first, last in zip(cand, lo, hi):
        for j in order[first:last]:
            if np.array_equal(rb[i], ra[j]):
                pairs.append((int(i), int(j)))
                break
    return pairs


def near_pairs(z: np.ndarray, split: np.ndarray, *, tables: int = NEAR_TABLES,
               projections: int = NEAR_PROJECTIONS, cell: float = NEAR_CELL, tol: float = NEAR_TOL,
               seed: int = 0) -> list[tuple[int, int, float]]:
    """Candidate near-duplicate pairs ``(i, j, rms_distance)`` among rows of ``z`` (standardised,
    ``(N, D)`` float), found by random-projection hashing and checked by distance.

    ``split`` labels each row; pairs are reported once, with ``i < j``. Exact copies are included
    (distance 0); the caller removes them.
    """
    n, d = z.shape
    if n < 2 or d == 0:
        return []
    rng = np.random.default_rng(seed)
    found: dict[tuple[int, int], float] = {}
    # All tables' projections in one product: one large matrix multiply beats several thin ones.
    proj = rng.standard_normal((d, tables * projections)).astype(z.dtype)
    proj /= np.linalg.norm(proj, axis=0, keepdims=True)
    offset = rng.uniform(0, cell, size=tables * projections).astype(z.dtype)
    scaled = z @ (proj / cell)
    scaled += offset / cell
    all_cells = np.floor(scaled, out=scaled).astype(np.int32)
    del scaled
    for t in range(tables):
        keys = row_hashes(all_cells[:, t * projections:(t + 1) * projections])
        order = np.argsort(keys)
        sk = keys[order]
        new = np.r_[True, sk[1:] != sk[:-1]]
        # Each row is compared with the first row of its cell (a star, not all pairs: linear).
        head = order[np.maximum.accumulate(np.where(new, np.arange(n), 0))]
        member = ~new
        if not member.any():
            continue
        rows, heads = order[member], head[member]
        dist = np.empty(rows.size)
        for s in range(0, rows.size, 65536):  # in blocks: keeps the temporary difference small
            diff = z[rows[s:s + 65536]] - z[heads[s:s + 65536]]
            dist[s:s + 65536] = np.sqrt(np.mean(diff * diff, axis=1))
        for r, h, dv in zip(rows[dist <= tol], heads[dist <= tol], dist[dist <= tol]):
            found[(int(min(r, h)), int(max(r, h)))] = float(dv)
    return sorted((i, j, dv) for (i, j), dv in found.items())
