"""Which shared-memory bytes does wgmma read? A probe of the hardware against the descriptor model of
pycalm.kernels.warpgroup (descriptor_addresses), element by element (llm.c dev/cuda style).

    python scripts/kernels/wgmma_probe.py                  # GPU: every byte of A, both layouts
    NUMBA_ENABLE_CUDASIM=1 python scripts/kernels/wgmma_probe.py --slots 24   # the harness, simulator

A test that multiplies random tiles says whether the model holds; this says where it fails. Each
block of the probe stages one shared image: A's region (64 rows of 128 bytes, 8 KiB) all zeros but
one fp16 slot set to 1.0, and B's region (64 rows of 128 bytes) holding 4,096 distinct exact fp16
values (slot s: s % 2048 + 1, negated from 2048 on). One wgmma m64n64k16 through the two
descriptors of a layout then gives D[r, j] = B's value at the slot the hardware reads for (k, j),
on the rows r for which it reads A's set slot at some k, and zeros elsewhere. A block a slot of A,
4,096 blocks a layout and a 16 of K: the rows each A slot feeds and, for each, the 64 B slots read
with it, against the model's. The model may name k in another order than the hardware, as long as
A and B agree (the product is the same): the comparison is of rows and B slots, not of k.

Layouts (the two the kernels use): the 128-byte swizzle (rows of 128 bytes, 8 rows a 1 KiB atom,
SBO 1,024) and none (core matrices of 8 rows x 16 bytes, LBO 128 along K, SBO 1,024 along rows),
each at the k-th 16 of K (kk = 0..3: start + 32 kk bytes swizzled, + 256 kk none).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from numba import config as numba_config
from numba import cuda, float32, int32

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from pycalm.kernels.warpgroup import (  # noqa: E402
    SWIZZLE_128B,
    SWIZZLE_NONE,
    descriptor_addresses,
    encode_descriptor,
    fence_proxy_async,
    shared_byte_address,
    smem_desc,
    wgmma_commit,
    wgmma_f16,
    wgmma_fence,
    wgmma_wait,
)

N = 64  # the wgmma's n: B's 64 rows (columns of B)
REGION_WORDS = 64 * 128 // 4  # A's region, and B's: 64 rows of 128 bytes
SLOTS = 2 * REGION_WORDS  # fp16 slots of A's region
SMEM_WORDS = 2 * REGION_WORDS + 256  # the image, and 1 KiB to align it
ACC_N = N // 2  # a thread's accumulators
ONE = 0x3C00  # 1.0 in fp16
# name: (swizzle, LBO, SBO, bytes the start moves a 16 of K)
LAYOUTS = {"128B": (SWIZZLE_128B, 16, 1024, 32), "none": (SWIZZLE_NONE, 128, 1024, 256)}

_wgmma = wgmma_f16(N)
_wait_all = wgmma_wait(0)


@cuda.jit
def probe_kernel(image, slots, out, offset, lbo, sbo, swizzle):  # noqa: ANN001, ANN201
    """Block b: the image (A's region, then B's, int32 words) in shared memory with A's slot
    slots[b] set to 1.0, then out[b] (64, N) = one wgmma through descriptors at byte `offset` of
    each region."""
    smem = cuda.shared.array(SMEM_WORDS, int32)  # the image, and 1 KiB to align it
    tid = cuda.threadIdx.x
    pad = ((1024 - (shared_byte_address(smem, 0) & 1023)) & 1023) >> 2  # words to a 1 KiB boundary
    for i in range(tid, 2 * REGION_WORDS, 128):
        smem[pad + i] = image[i]
    cuda.syncthreads()  # the image in place before its one slot is set
    if tid == 0:
        slot = slots[cuda.blockIdx.x]
        word, shift = pad + (slot >> 1), 16 * (slot & 1)
        smem[word] = (smem[word] & ~(0xFFFF << shift)) | (ONE << shift)
    fence_proxy_async()  # the stores above, visible to the tensor cores' reads
    cuda.syncthreads()  # every store in place before the wgmma reads them
    acc = cuda.local.array(ACC_N, float32)  # (N / 8, 4) this thread's D elements
    for i in range(ACC_N):
        acc[i] = 0.0
    wgmma_fence()
    da = smem_desc(smem, pad + (offset >> 2), lbo, sbo, swizzle)
    db = smem_desc(smem, pad + REGION_WORDS + (offset >> 2), lbo, sbo, swizzle)
    _wgmma(acc, smem, da, db, 0)
    wgmma_commit()
    _wait_all()  # every sum in acc
    q, lane = tid >> 5, tid & 31
    g, t = lane >> 2, lane & 3
    b = cuda.blockIdx.x
    for j in range(N // 8):
        out[b, 16 * q + g, 8 * j + 2 * t] = acc[4 * j]
        out[b, 16 * q + g, 8 * j + 2 * t + 1] = acc[4 * j + 1]
        out[b, 16 * q + g + 8, 8 * j + 2 * t] = acc[4 * j + 2]
        out[b, 16 * q + g + 8, 8 * j + 2 * t + 1] = acc[4 * j + 3]


def b_values() -> np.ndarray:
    """B's region: slot s holds s % 2048 + 1, negated from 2048 on (4,096 distinct exact fp16)."""
    s = np.arange(SLOTS)
    return ((s % 2048 + 1) * np.where(s < 2048, 1, -1)).astype(np.float16)


def b_slot(value: np.ndarray) -> np.ndarray:
    """The B slot that holds each value (b_values' inverse)."""
    v = value.astype(np.int64)
    return np.where(v > 0, v - 1, 2048 - v - 1)


def model(offset: int, lbo: int, sbo: int, swizzle: int) -> tuple[dict, np.ndarray]:
    """The model's reads: {A slot: [(r, k), ...]} and B's slot of each (k, j), (16, N)."""
    desc = encode_descriptor(offset, lbo, sbo, swizzle)
    a = descriptor_addresses(desc, 64)  # (64, 16) bytes of A's region
    feeds: dict[int, list] = {}
    for r in range(64):
        for k in range(16):
            feeds.setdefault(int(a[r, k]) >> 1, []).append((r, k))
    b = descriptor_addresses(desc, N).T >> 1  # (16, N): B's slot of (k, j)
    return feeds, b


def probe(name: str, kk: int, slots: np.ndarray) -> tuple[int, int]:
    """Run one layout at the kk-th 16 of K for these A slots; print the mismatches -> (their
    count, how many of the slots the model reads)."""
    swizzle, lbo, sbo, step = LAYOUTS[name]
    offset = kk * step
    image = np.concatenate([np.zeros(SLOTS, np.float16), b_values()]).view(np.int32)
    out = cuda.device_array((len(slots), 64, N), np.float32)
    probe_kernel[len(slots), 128](cuda.to_device(image), cuda.to_device(slots.astype(np.int32)), out, offset, lbo,
                                  sbo, swizzle)  # fmt: skip
    got = out.copy_to_host()
    feeds, b = model(offset, lbo, sbo, swizzle)
    bad = 0
    for i, slot in enumerate(slots):
        want_rows = {r: b[k] for r, k in feeds.get(int(slot), [])}
        rows = np.nonzero(np.any(got[i] != 0, axis=1))[0]
        seen = {int(r): b_slot(got[i, r]) for r in rows}
        ok = set(seen) == set(want_rows) and all(np.array_equal(seen[r], want_rows[r]) for r in seen)
        if not ok:
            bad += 1
            if bad <= 6:
                row, byte = divmod(2 * int(slot), 128)
                print(f"  {name} kk={kk} A slot {slot} (region row {row}, byte {byte}): hardware rows "
                      f"{sorted(seen)} B slots {[seen[r][:4].tolist() for r in sorted(seen)][:2]}; model rows "
                      f"{sorted(want_rows)} B slots {[want_rows[r][:4].tolist() for r in sorted(want_rows)][:2]}")  # fmt: skip
    return bad, sum(1 for slot in slots if int(slot) in feeds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=0, help="probe this many A slots at random (0: all 4,096)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    if args.slots == 0:
        slots, kks = np.arange(SLOTS), range(4)
    else:  # half of them among the slots the model reads at kk = 1, half anywhere
        read = sorted(model(LAYOUTS["128B"][3], 16, 1024, SWIZZLE_128B)[0])
        slots = np.unique(
            np.concatenate([rng.choice(read, args.slots // 2), rng.choice(SLOTS, args.slots // 2)])
        )
        kks = [1]
    total = 0
    for name in LAYOUTS:
        for kk in kks:
            bad, read_count = probe(name, kk, slots)
            print(f"{name} kk={kk}: {len(slots)} A slots ({read_count} read by the model): "
                  + ("the model holds" if bad == 0 else f"{bad} differ"), flush=True)  # fmt: skip
            total += bad
    if total:
        sys.exit(
            f"the descriptor model differs from the {'simulator' if numba_config.ENABLE_CUDASIM else 'GPU'}"
        )


if __name__ == "__main__":
    main()
