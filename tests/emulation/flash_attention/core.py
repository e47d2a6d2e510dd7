# Lane-level machine model for simulating the tensor-core attention kernels.
#
# * mma.m16n8k16 (.row.col, f32 accumulate) from the PTX ISA fragment tables.
# * ldmatrix.m8n8.{x1,x2,x4}{.trans}.b16: lane 8*i + r supplies the row address of row r of matrix
#   i (lanes past 8*num are ignored); register i of lane l receives M_i[l/4][2(l%4) + {0,1}], or
#   with .trans M_i[2(l%4) + {0,1}][l/4]. Row addresses must be 16-byte aligned.
# * cp.async (16 or 4 bytes, zero-fill when src-size is 0): the destination is poisoned (NaN,
#   "busy") from the issue until the issuing warp's cp.async.wait_all; the landing is a write of
#   the wait phase and is visible to the block only after the next __syncthreads.
# * Race detector: per barrier phase, every shared element written (store, cp.async issue or
#   landing) by one warp must not be read or written by another warp in the same phase; a read of
#   a busy element, or of an element that landed in the current phase, is an error.
import numpy as np

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
lanes = np.arange(32)
G = lanes >> 2
T4 = lanes & 3


class SimError(AssertionError):
    pass


def check(cond, msg):
    if not cond:
        raise SimError(msg)


def rnd(x, dtype):
    x = np.asarray(x, dtype=np.float32)
    if dtype == 'bf16':
        b = x.view(np.uint32).astype(np.uint64)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return r.astype(np.uint32).view(np.float32)
    assert dtype == 'f16'
    with np.errstate(over='ignore'):
        return x.astype(np.float16).astype(np.float32)


# ---- PTX ISA fragment tables for mma.m16n8k16 with .f16/.bf16 inputs ----------------------------
# A: a0..a7 in four .b32 registers (a0 low half of reg 0); row groupID for a0,a1,a4,a5 and
# groupID + 8 for a2,a3,a6,a7; col tig*2 + (i & 1), + 8 for i >= 4.
A_ROW = np.zeros((32, 4, 2), int); A_COL = np.zeros((32, 4, 2), int)
B_ROW = np.zeros((32, 2, 2), int); B_COL = np.zeros((32, 2, 2), int)
C_ROW = np.zeros((32, 4), int); C_COL = np.zeros((32, 4), int)
for l in range(32):
    gid, tig = l >> 2, l & 3
    for i in range(8):
        A_ROW[l, i // 2, i % 2] = gid if i in (0, 1, 4, 5) else gid + 8
        A_COL[l, i // 2, i % 2] = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
    for i in range(4):  # B: row (k) tig*2 + (i & 1), + 8 for i >= 2; col (n) groupID
        B_ROW[l, i // 2, i % 2] = tig * 2 + (i & 1) + (8 if i >= 2 else 0)
        B_COL[l, i // 2, i % 2] = gid
    for i in range(4):  # C: row groupID (c0, c1) / groupID + 8 (c2, c3); col tig*2 + (i & 1)
        C_ROW[l, i] = gid if i < 2 else gid + 8
        C_COL[l, i] = tig * 2 + (i & 1)
assert len(set(zip(A_ROW.ravel(), A_COL.ravel()))) == 256
assert len(set(zip(B_ROW.ravel(), B_COL.ravel()))) == 128
assert len(set(zip(C_ROW.ravel(), C_COL.ravel()))) == 128

stats = {'mma': 0, 'ldsm': 0, 'cp16': 0, 'cp4': 0, 'sync': 0}


def mma(c, a, b):
    """c[32,4] (float32, updated in place) += A(a[32,4,2]) @ B(b[32,2,2])."""
    a = np.asarray(a); b = np.asarray(b)
    check(a.shape == (32, 4, 2) and b.shape == (32, 2, 2), 'mma operand shape')
    check(np.isfinite(a).all() and np.isfinite(b).all(), 'mma operand not finite (poisoned data?)')
    A = np.empty((16, 16)); A[A_ROW, A_COL] = a
    Bm = np.empty((16, 8)); Bm[B_ROW, B_COL] = b
    D = A @ Bm
    c[...] = (c.astype(np.float64) + D[C_ROW, C_COL]).astype(np.float32)
    stats['mma'] += 1


def pack2(lo, hi, dtype):
    return np.stack([rnd(lo, dtype), rnd(hi, dtype)], -1)


def afrag(s, kc, dtype):
    """A fragment of P from the accumulators of 8-column tiles 2kc and 2kc+1 (s[nt][32,4])."""
    return np.stack([pack2(s[2 * kc][:, 0], s[2 * kc][:, 1], dtype),
                     pack2(s[2 * kc][:, 2], s[2 * kc][:, 3], dtype),
                     pack2(s[2 * kc + 1][:, 0], s[2 * kc + 1][:, 1], dtype),
                     pack2(s[2 * kc + 1][:, 2], s[2 * kc + 1][:, 3], dtype)], 1)


def quad_max(v):
    v = np.fmax(v, v[lanes ^ 1]); return np.fmax(v, v[lanes ^ 2])


def quad_sum(v):
    v = (v + v[lanes ^ 1]).astype(np.float32); return (v + v[lanes ^ 2]).astype(np.float32)


def fmaf(a, b, c):
    return (np.float64(1) * a * b + c).astype(np.float32)


class Smem:
    """Shared memory of one block: `elem` bytes per element, regions {name: (start, end)} in
    elements. Byte address of element i is base_byte + elem * i."""

    def __init__(self, n, elem, nwarps, regions, base_byte=0):
        self.n, self.elem, self.nw, self.base = n, elem, nwarps, base_byte
        self.val = np.full(n, np.nan, np.float32)
        self.busy = np.zeros(n, bool)
        self.landed = np.zeros(n, bool)  # landed in the current phase
        self.rd = np.zeros((nwarps, n), bool)
        self.wr = np.zeros((nwarps, n), bool)
        self.pending = [[] for _ in range(nwarps)]  # per warp: list of (idx, values)
        self.regions = regions
        ends = sorted(regions.values())
        for (s0, e0), (s1, e1) in zip(ends, ends[1:]):
            check(e0 <= s1, 'overlapping shared regions')
        check(all(0 <= s0 < e0 <= n for s0, e0 in ends), 'region outside shared memory')

    def _region(self, idx, count, what):
        idx = np.asarray(idx)
        for s0, e0 in self.regions.values():
            pass
        ok = np.zeros(idx.shape, bool)
        for s0, e0 in self.regions.values():
            ok |= (idx >= s0) & (idx + count <= e0)
        check(ok.all(), f'{what}: access outside its region, indices {idx[~ok][:4]}')

    def read(self, w, idx, what='ld.shared'):
        idx = np.asarray(idx)
        self._region(idx, 1, what)
        check(not self.busy[idx].any(), f'{what}: read of a buffer with a cp.async in flight')
        check(not self.landed[idx].any(), f'{what}: read of cp.async data before __syncthreads')
        v = self.val[idx]
        check(not np.isnan(v).any(), f'{what}: read of uninitialised shared memory')
        self.rd[w, idx] = True
        return v

    def store(self, w, idx, vals):
        idx = np.asarray(idx)
        self._region(idx, 1, 'st.shared')
        check(not self.busy[idx].any(), 'st.shared into a buffer with a cp.async in flight')
        self.val[idx] = vals
        self.wr[w, idx] = True

    def ldmatrix(self, w, addr, num, trans):
        """addr: element index per lane (32,). Returns regs [32, num, 2]."""
        addr = np.asarray(addr)
        stats['ldsm'] += 1
        out = np.empty((32, num, 2), np.float32)
        for i in range(num):
            rows = addr[8 * i:8 * i + 8]
            check(((self.base + self.elem * rows) % 16 == 0).all(), 'ldmatrix row address not 16-byte aligned')
            self._region(rows, 8, 'ldmatrix')
            M = self.read(w, rows[:, None] + np.arange(8)[None, :], 'ldmatrix')  # [8 rows, 8 cols]
            if trans:
                out[:, i, 0] = M[2 * T4, G]; out[:, i, 1] = M[2 * T4 + 1, G]
            else:
                out[:, i, 0] = M[G, 2 * T4]; out[:, i, 1] = M[G, 2 * T4 + 1]
        return out

    def cp_async(self, w, dst, src_arr, src_idx, valid, count, lo, hi):
        """Copies of `count` elements per entry: dst[j] <- src_arr[src_idx[j]:+count] if valid[j]
        else zeros. [lo, hi) is the allowed source range (the tensor slice the kernel owns)."""
        dst = np.asarray(dst); src_idx = np.asarray(src_idx); valid = np.asarray(valid, bool)
        nbytes = self.elem * count
        stats['cp16' if nbytes == 16 else 'cp4'] += len(dst)
        check(nbytes in (4, 8, 16), 'cp.async size')
        check(((self.base + self.elem * dst) % nbytes == 0).all(), 'cp.async shared address misaligned')
        check(((src_idx * src_arr.itemsize) % nbytes == 0).all(), 'cp.async global address misaligned')
        # every address passed must lie in the tensor, valid or not (src-size 0 reads nothing)
        check(((src_idx >= lo) & (src_idx + count <= hi)).all(), 'cp.async global address out of range')
        self._region(dst, count, 'cp.async')
        idx = (dst[:, None] + np.arange(count)[None, :]).ravel()
        check(not self.busy[idx].any(), 'cp.async into a buffer with a cp.async in flight')
        check(len(np.unique(idx)) == len(idx), 'cp.async copies overlap')
        data = np.where(valid[:, None], src_arr[np.where(valid, src_idx, lo)[:, None] + np.arange(count)[None, :]], 0)
        self.busy[idx] = True
        self.val[idx] = np.nan  # contents undefined while in flight
        self.wr[w, idx] = True
        if not self.pending[w] or self.pending[w][-1] is None:
            self.pending[w].append([])
        self.pending[w][-1].append((idx, data.ravel().astype(np.float32)))

    def commit(self, w):
        if self.pending[w] and self.pending[w][-1] is not None:
            self.pending[w].append(None)  # group boundary marker

    def wait_all(self, w):
        for grp in self.pending[w]:
            if grp is None:
                continue
            for idx, data in grp:
                self.val[idx] = data
                self.busy[idx] = False
                self.landed[idx] = True
                self.wr[w, idx] = True
        self.pending[w] = []

    def sync(self):
        touch = (self.rd | self.wr).sum(0)
        writers = self.wr.sum(0)
        bad = (writers >= 1) & (touch >= 2)
        check(not bad.any(), f'race: element(s) {np.nonzero(bad)[0][:4]} written by one warp and accessed by another in the same phase')
        self.rd[:] = False; self.wr[:] = False; self.landed[:] = False

    def finish(self):
        check(all(not p for p in self.pending), 'cp.async still pending at exit (not waited)')
        check(not self.busy.any(), 'cp.async still in flight at exit')


class Block:
    def __init__(self, nwarps, *smems):
        self.nw = nwarps; self.smems = smems

    def sync(self):
        stats['sync'] += 1
        for s in self.smems:
            s.sync()

    def finish(self):
        for s in self.smems:
            s.finish()


def copy_rows_async(sm, w, dst, src, base, row0, seq, ROWS, D, LD, NT):
    """copy_rows_async<ROWS, D, LD, NT>, the part issued by the threads of warp w."""
    kchunks = D // 8
    check((ROWS * kchunks) % NT == 0, 'copy_rows_async: uneven split')
    idx = np.arange(ROWS * kchunks)
    idx = idx[(idx % NT) // 32 == w]  # loop idx = tid; idx += NT -> thread idx % NT
    r = idx // kchunks; c = (idx % kchunks) * 8
    valid = row0 + r < seq
    srci = np.where(valid, base + (row0 + r) * D + c, base)
    sm.cp_async(w, dst + r * LD + c, src, srci, valid, 8, base, base + seq * D)
