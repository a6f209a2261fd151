import os
import numba as nb, numpy as np
from llorch_ref.backends import numba_kernels as K
from llorch_ref.backends import numba_simd as S

SRC = '''
@nb.njit(parallel=True, cache=False, fastmath=False)
def rows_times_w(code, rows, n_blocks, x, out):
    t_n, k = x.shape
    n = rows.shape[0]
    ra, xa, oa = rows.ctypes.data, x.ctypes.data, out.ctypes.data
    full, quads = t_n - t_n % {T}, n // {P}
    chunks = nb.get_num_threads()
    buf = np.empty((chunks, {P}, k), np.float32)
    per = (quads + chunks - 1) // chunks
    for c in nb.prange(chunks):
        wa = buf[c].ctypes.data
        for q in range(c * per, min(quads, (c + 1) * per)):
            r = {P} * q
            ahead = ra + 8 * (r + {P} if q + 1 < quads else r)
            S.weights_rows(code, {P}, 1, ra + 8 * r, ahead, wa, k, n_blocks)
            for t in range(0, full, {T}):
                for rr in range(0, {P}, {R}):
                    S.float_tile(code, {R}, {T}, wa + 4 * rr * k, k, xa + 4 * t * k, k, oa + 4 * (t * n + r + rr), n, n_blocks)
            for t in range(full, t_n):
                S.float_tile(code, {P}, 1, wa, k, xa + 4 * t * k, k, oa + 4 * (t * n + r), n, n_blocks)
    for r in range(n - n % {P}, n):
        for t in range(t_n):
            S.dot_tile(code, 1, 1, ra + 8 * r, ra + 8 * r, xa + 4 * t * k, k, oa + 4 * (t * n + r), n, n_blocks)
'''
def make(R, T, P=4):
    g = {"nb": nb, "np": np, "S": S}
    exec(SRC.format(R=R, T=T, P=P), g)
    f = g["rows_times_w"]
    def matmul_w(code, rows, n_blocks, x, out):
        f(code, rows, n_blocks, K._in_lane_order(code, x), out)
    return matmul_w
R, T, P = map(int, os.environ.get("TILE", "2x4x4").split("x"))
matmul_w = make(R, T, P)
