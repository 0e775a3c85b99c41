# Index model of B2's and B3's staged epilogues (src/cuda/engines/sm90/wgrad_gemm.cu: each consumer warp's
# 16 x 256 block through a 2 KB shared buffer, 64 columns at a time, with stmatrix, then 16-byte
# stores). It checks the kernel's bookkeeping, not the hardware: stmatrix.m8n8.x4 is modelled as the
# PTX ISA describes it (lane 8 i + r supplies the address of row r of matrix i; that row receives
# row r of the fragment matrix, or with .trans its column r; fragment element (row, col) is held by
# lane 4 row + col // 2 in register i, half col % 2). For every lane and accumulator of one
# consumer warp it checks that each element (m, n) of the warp's block is written once, with its
# own accumulator, where the kernel means it to go (B3: out[n][m]; B2: out[m][n]); that the
# copy-out's 16-byte reads see exactly what stmatrix wrote; and that each stmatrix matrix (8 rows
# of 16 bytes) covers all 32 banks once. Then the stores' addresses: the kernel forms them once a
# tile (B2: a row address per pass plus 128 bytes a chunk; B3: two bases and a running row offset
# in wrapping 64-bit arithmetic), and for every lane of every warp, tile origin, expert and split
# (inside a tile, at a tile edge, none with out1 null) each store must go where the element-wise
# formula puts it, under the same predicate. --self-test: seeded mistakes must be caught.
#   python3 tools/models/wgrad_staged_epilogue_model.py --self-test
import sys


def trans_stage_byte(n, h, swap=True):  # B3: 64 rows n of 32 bytes (two 8-m halves h)
    return n * 32 + ((h ^ (((n >> 2) & 1) if swap else 0)) << 4)


def chunk_stage_byte(r, ch, swizzle=True):  # B2: 16 rows of 128 bytes, 4 * stage_chunk_word
    return r * 128 + ((ch ^ ((r & 7) if swizzle else 0)) << 4)


def acc_elem(lane, a):
    """Accumulator a of lane (g, t4) = element (m = g + 8 rr, n = 8 jc + 2 t4 + half) of the
    warp's 16 x 256 block, a = 4 jc + 2 rr + half (wgmma m64n256 layout, the kernel's comment)."""
    g, t4 = lane >> 2, lane & 3
    jc, rr, half = a >> 2, (a >> 1) & 1, a & 1
    return (g + 8 * rr, 8 * jc + 2 * t4 + half)


def run(form, mutation=None):
    errors = []
    written = {}
    for c in range(4):
        smem = {}  # byte offset -> (m, n) of the 2-byte value stored there
        for q in range(4):
            regs = {}  # (lane, i) -> [(m, n) lo, (m, n) hi]
            for lane in range(32):
                for i in range(4):
                    jc = 8 * c + 2 * q + (i >> 1)
                    rr = i & 1
                    if mutation == "matrix order":
                        jc, rr = 8 * c + 2 * q + (i & 1), i >> 1
                    a = 4 * jc + 2 * rr
                    regs[(lane, i)] = [acc_elem(lane, a), acc_elem(lane, a + 1)]
            addr = {}
            for lane in range(32):
                i = lane >> 3
                if form == "B3":
                    addr[lane] = trans_stage_byte(8 * (2 * q + (i >> 1)) + (lane & 7), i & 1,
                                                  swap=mutation != "no swizzle")
                else:
                    r = 8 * (i & 1) + (lane & 7)
                    addr[lane] = chunk_stage_byte(r, 2 * q + (i >> 1),
                                                  swizzle=mutation != "no swizzle")
            for i in range(4):
                banks = set()
                for r in range(8):  # row r of matrix i in shared memory
                    base = addr[8 * i + r]
                    banks |= {((base + b) // 4) % 32 for b in range(0, 16, 4)}
                    for k in range(8):  # its 8 elements: column r (.trans) or row r
                        row, col = (k, r) if form == "B3" else (r, k)
                        smem[base + 2 * k] = regs[(4 * row + col // 2, i)][col % 2]
                if len(banks) != 32:
                    errors.append(("bank conflict", c, q, i))
        # copy-out: each lane's 16-byte read and where its store puts the 8 values
        for p in range(4):
            for lane in range(32):
                if form == "B3":
                    nl = (lane >> 1) + 16 * p  # the kernel's row of the chunk
                    h = lane & 1
                    if mutation == "copy-out half":
                        h ^= 1
                    base = trans_stage_byte(nl, h, swap=mutation != "no swizzle")
                    m_half = 8 * (lane & 1)  # less the warp's m0 + 64 wg + 16 warp_in_wg
                    dests = [(m_half + k, 64 * c + nl) for k in range(8)]  # out[n][m_half + k]
                else:
                    r = (lane >> 3) + 4 * p  # the kernel's row of the warp's 16
                    ch = lane & 7
                    base = chunk_stage_byte(r, ch if mutation != "copy-out half" else ch ^ 1,
                                            swizzle=mutation != "no swizzle")
                    n = 64 * c + 8 * ch  # less n0
                    dests = [(r, n + k) for k in range(8)]  # out[m][n + k]
                for k, dest in enumerate(dests):
                    got = smem.get(base + 2 * k)
                    if got != dest:
                        errors.append(("wrong element", form, c, p, lane, k, got, dest))
                    written[dest] = written.get(dest, 0) + 1
    missing = [(m, n) for m in range(16) for n in range(256) if written.get((m, n)) != 1]
    if missing:
        errors.append(("not written exactly once", len(missing)))
    return errors


WRAP = (1 << 64) - 1  # the kernel's uint64_t arithmetic


def store_address_errors(form, mutation=None):
    """The kernel's once-a-tile store addresses against the element-wise formula (2-byte T)."""
    errors = []
    out0, size = 0x7F0000000000, 2
    for M, N, split, with_out1 in ((192, 512, 512, False), (192, 512, 256, True),
                                   (200, 360, 136, True), (136, 264, 8, True)):
        if form == "B2":  # split, rows of out0, is along M: the same cases with M and N swapped
            M, N = N, M
            split = min(split, M)
            with_out1 = split < M
        out1 = 0x7F8000000000 if with_out1 else 0
        extent = (N if form == "B3" else M)
        stride0 = split * (M if form == "B3" else N)
        stride1 = (extent - split) * (M if form == "B3" else N)
        out_ld = N + 24  # B2: a column chunk of a wider output
        for e in (0, 5):
            for m0 in range(0, M, 128):
                for n0 in range(0, N, 256):
                    for warp in range(8):
                        wg, wiw = warp >> 2, warp & 3
                        for lane in range(32):
                            errors += store_address_lane(form, mutation, M, N, split, out0, out1,
                                                         stride0, stride1, out_ld, size, e, m0,
                                                         n0, wg, wiw, lane)
    return errors


def store_address_lane(form, mutation, M, N, split, out0, out1, stride0, stride1, out_ld, size,
                       e, m0, n0, wg, wiw, lane):
    errors = []
    if form == "B3":
        m_half = m0 + wg * 64 + wiw * 16 + 8 * (lane & 1)
        n_lane = n0 + (lane >> 1)
        row_bytes = M * size
        base0 = (out0 + (e * stride0 + m_half) * size) & WRAP
        base1 = (out1 + (e * stride1 + m_half) * size - split * row_bytes) & WRAP
        if mutation == "base1 without split":
            base1 = (out1 + (e * stride1 + m_half) * size) & WRAP
        row_offset = n_lane * row_bytes
        for c in range(4):
            for p in range(4):
                n = n_lane + 64 * c + 16 * p
                pred = m_half < M and n < N
                got = ((base0 if n < split else base1) + row_offset) & WRAP
                row_offset += (4 if mutation == "row step" else 16) * row_bytes
                want = (out0 + (e * stride0 + n * M + m_half) * size if n < split else
                        out1 + (e * stride1 + (n - split) * M + m_half) * size)
                if pred and got != want:
                    errors.append(("B3 address", M, N, split, e, m0, n0, wg, wiw, lane, c, p))
    else:
        warp_row0 = m0 + wg * 64 + wiw * 16
        n_lane = n0 + 8 * (lane & 7)
        rows = []
        for p in range(4):
            m = warp_row0 + (lane >> 3) + 4 * p
            if m < split:
                address = out0 + (e * stride0 + m * out_ld + n_lane) * size
            else:
                address = out1 + (e * stride1 + (m - split) * out_ld + n_lane) * size
            rows.append((m < M, address & WRAP))
        for c in range(4):
            n = n0 + 64 * c + 8 * (lane & 7)
            for p in range(4):
                ok, address = rows[p]
                got = (address + 64 * c * (1 if mutation == "row step" else size)) & WRAP
                r = (lane >> 3) + 4 * p
                m = warp_row0 + r
                want = (out0 + (e * stride0 + m * out_ld + n) * size if m < split else
                        out1 + (e * stride1 + (m - split) * out_ld + n) * size)
                if ok != (m < M):
                    errors.append(("B2 predicate", M, N, split, m))
                if ok and n < N and got != want:
                    errors.append(("B2 address", M, N, split, e, m0, n0, wg, wiw, lane, c, p))
    return errors


def main():
    failed = False
    for form in ("B2", "B3"):
        for what, errs in (("staged epilogue index model", run(form)),
                           ("store addresses once a tile", store_address_errors(form))):
            print("%s %s:" % (form, what), "PASS" if not errs else "FAIL %s" % errs[:5])
            failed |= bool(errs)
        if "--self-test" in sys.argv:
            for mutation in ("matrix order", "no swizzle", "copy-out half"):
                caught = bool(run(form, mutation))
                print("  mutation %-20s %s" % (mutation + ":", "caught" if caught else "MISSED"))
                failed |= not caught
            mutations = ("row step", "base1 without split") if form == "B3" else ("row step",)
            for mutation in mutations:
                caught = bool(store_address_errors(form, mutation))
                print("  mutation %-20s %s" % (mutation + ":", "caught" if caught else "MISSED"))
                failed |= not caught
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
