# Index model of B2's and B3's staged epilogues (src/cuda/engines/sm90/wgrad_gemm.cu: each
# consumer warp's 16 x 256 block through a 2 KB shared buffer, 64 columns at a time, with
# stmatrix, then 16-byte stores; B3's four warps of a warpgroup share their buffers as one of 64
# rows n x 128 bytes). It checks the kernel's bookkeeping, not the hardware: stmatrix.m8n8.x4 is
# modelled as the PTX ISA describes it (lane 8 i + r supplies the address of row r of matrix i;
# that row receives row r of the fragment matrix, or with .trans its column r; fragment element
# (row, col) is held by lane 4 row + col // 2 in register i, half col % 2). For every lane and
# accumulator of one consumer warp (B3: of a warpgroup's four) it checks that each element (m, n)
# of the block is written once, with its own accumulator, where the kernel means it to go (B3:
# out[n][m]; B2: out[m][n]); that the copy-out's 16-byte reads see exactly what stmatrix wrote;
# and that each stmatrix matrix (8 rows of 16 bytes) covers all 32 banks once. Then the stores'
# addresses: the kernel forms them once a tile (B2: a row address per pass plus 128 bytes a chunk;
# B3: two bases and a running row offset in wrapping 64-bit arithmetic), and for every lane of
# every warp, tile origin, expert and split (inside a tile, at a tile edge, none with out1 null)
# each store must go where the element-wise formula puts it, under the same predicate.
# --self-test: seeded mistakes must be caught.
#   python3 tools/models/wgrad_staged_epilogue_model.py --self-test
import sys


def chunk_stage_byte(r, ch, swizzle=True):  # rows of 128 bytes, 4 * stage_chunk_word
    # B2: a warp's 16 rows m; B3: the warpgroup's 64 rows n, chunk 2 w + h = warp w's 8-m half h
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
    warps = range(4) if form == "B3" else range(1)  # B3: the warpgroup's four share a buffer
    for c in range(4):
        smem = {}  # byte offset -> (m, n) of the 2-byte value stored there
        for w in warps:
            for q in range(4):
                regs = {}  # (lane, i) -> [(m, n) lo, (m, n) hi], m of the warpgroup's 64
                for lane in range(32):
                    for i in range(4):
                        jc = 8 * c + 2 * q + (i >> 1)
                        rr = i & 1
                        if mutation == "matrix order":
                            jc, rr = 8 * c + 2 * q + (i & 1), i >> 1
                        a = 4 * jc + 2 * rr
                        regs[(lane, i)] = [(16 * w + m, n) for m, n in
                                           (acc_elem(lane, a), acc_elem(lane, a + 1))]
                addr = {}
                for lane in range(32):
                    i = lane >> 3
                    if form == "B3":
                        chunk = (2 * w if mutation != "warp chunk" else 0) + (i & 1)
                        addr[lane] = chunk_stage_byte(8 * (2 * q + (i >> 1)) + (lane & 7), chunk,
                                                      swizzle=mutation != "no swizzle")
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
                        errors.append(("bank conflict", c, w, q, i))
        # copy-out (B3: after the warpgroup's barrier): each lane's 16-byte read and where its
        # store puts the 8 values
        for w in warps:
            for p in range(4):
                for lane in range(32):
                    ch = lane & 7
                    if mutation == "copy-out half":
                        ch ^= 1
                    if form == "B3":
                        nl = 16 * w + (lane >> 3) + 4 * p  # the kernel's row of the chunk
                        base = chunk_stage_byte(nl, ch, swizzle=mutation != "no swizzle")
                        m8 = 8 * (lane & 7)  # less the tile's m0 + 64 wg
                        dests = [(m8 + k, 64 * c + nl) for k in range(8)]  # out[n][m8 + k]
                    else:
                        r = (lane >> 3) + 4 * p  # the kernel's row of the warp's 16
                        base = chunk_stage_byte(r, ch, swizzle=mutation != "no swizzle")
                        n = 64 * c + 8 * (lane & 7)  # less n0
                        dests = [(r, n + k) for k in range(8)]  # out[m][n + k]
                    for k, dest in enumerate(dests):
                        got = smem.get(base + 2 * k)
                        if got != dest:
                            errors.append(("wrong element", form, c, w, p, lane, k, got, dest))
                        written[dest] = written.get(dest, 0) + 1
    rows = 64 if form == "B3" else 16
    missing = [(m, n) for m in range(rows) for n in range(256) if written.get((m, n)) != 1]
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
        m_lane = m0 + wg * 64 + 8 * (lane & 7)
        n_lane = n0 + 16 * wiw + (lane >> 3)
        row_bytes = M * size
        base0 = (out0 + (e * stride0 + m_lane) * size) & WRAP
        base1 = (out1 + (e * stride1 + m_lane) * size - split * row_bytes) & WRAP
        if mutation == "base1 without split":
            base1 = (out1 + (e * stride1 + m_lane) * size) & WRAP
        row_offset = n_lane * row_bytes
        for c in range(4):
            for p in range(4):
                n = n_lane + 64 * c + 4 * p
                pred = m_lane < M and n < N
                got = ((base0 if n < split else base1) + row_offset) & WRAP
                row_offset += (16 if mutation == "row step" else 4) * row_bytes
                want = (out0 + (e * stride0 + n * M + m_lane) * size if n < split else
                        out1 + (e * stride1 + (n - split) * M + m_lane) * size)
                if pred and got != want:
                    errors.append(("B3 address", M, N, split, e, m0, n0, wg, wiw, lane, c, p))
            row_offset += 48 * row_bytes
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
            mutations = ("matrix order", "no swizzle", "copy-out half")
            for mutation in mutations + (("warp chunk",) if form == "B3" else ()):
                caught = bool(run(form, mutation))
                print("  mutation %-20s %s" % (mutation + ":", "caught" if caught else "MISSED"))
                failed |= not caught
            for mutation in ("row step", "base1 without split") if form == "B3" else ("row step",):
                caught = bool(store_address_errors(form, mutation))
                print("  mutation %-20s %s" % (mutation + ":", "caught" if caught else "MISSED"))
                failed |= not caught
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
