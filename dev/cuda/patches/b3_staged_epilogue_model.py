# Index model of b3-staged-epilogue.patch (B3's epilogue through shared memory with stmatrix.trans).
# It checks the patch's bookkeeping, not the hardware: stmatrix.m8n8.x4.trans is modelled as the
# PTX ISA describes it (lane 8 i + r supplies the address of row r of matrix i; with .trans that
# row receives column r of the fragment matrix, whose element (row, col) lane 4 row + col // 2
# holds in register i, half col % 2). For every lane and accumulator of one consumer warp it
# checks that each output element (m, n) of the warp's 16 x 256 block is written once, with its
# own accumulator, at out[n][m]; that the copy-out's 16-byte reads see exactly what stmatrix
# wrote; and that each stmatrix matrix (8 rows of 16 bytes) covers all 32 banks once.
#   /usr/bin/python3 dev/cuda/patches/b3_staged_epilogue_model.py
import sys


def stage_byte(n, h):  # trans_stage_byte
    return n * 32 + ((h ^ ((n >> 2) & 1)) << 4)


def run():
    errors = []
    # Accumulator a of lane (g, t4) = element (m = g + 8 rr, n = 8 jc + 2 t4 + half) with
    # a = 4 jc + 2 rr + half (wgmma m64n256 layout, the kernel's comment).
    def acc_elem(lane, a):
        g, t4 = lane >> 2, lane & 3
        jc, rr, half = a >> 2, (a >> 1) & 1, a & 1
        return (g + 8 * rr, 8 * jc + 2 * t4 + half)

    written = {}
    for c in range(4):
        smem = {}  # byte offset -> (m, n) of the 2-byte value stored there
        for q in range(4):
            regs = {}  # (lane, i) -> [(m, n) lo, (m, n) hi]
            for lane in range(32):
                for i in range(4):
                    a = 4 * (8 * c + 2 * q + (i >> 1)) + 2 * (i & 1)
                    regs[(lane, i)] = [acc_elem(lane, a), acc_elem(lane, a + 1)]
            addr = {}
            for lane in range(32):
                i = lane >> 3
                addr[lane] = stage_byte(8 * (2 * q + (i >> 1)) + (lane & 7), i & 1)
            for i in range(4):
                banks = set()
                for r in range(8):  # row r of matrix i in shared memory: column r of the fragment
                    base = addr[8 * i + r]
                    banks |= {((base + b) // 4) % 32 for b in range(0, 16, 4)}
                    for row in range(8):
                        lane, half = 4 * row + r // 2, r % 2
                        smem[base + 2 * row] = regs[(lane, i)][half]
                if len(banks) != 32:
                    errors.append(("bank conflict", c, q, i))
        # copy-out: lane reads 16 bytes at stage_byte(nl, h) and writes out[n][m_half .. + 8]
        for p in range(4):
            for lane in range(32):
                nl = (lane >> 1) + 16 * p  # the kernel's row of the chunk
                base = stage_byte(nl, lane & 1)  # its ld_shared_v4 address
                m_half = 8 * (lane & 1)  # its m_half (less the warp's m0 + 64 wg + 16 warp_in_wg)
                for k in range(8):
                    m_out, n_out = m_half + k, 64 * c + nl  # where the store puts byte pair k
                    got = smem.get(base + 2 * k)
                    if got != (m_out, n_out):
                        errors.append(("wrong element", c, p, lane, k, got, (m_out, n_out)))
                    written[(m_out, n_out)] = written.get((m_out, n_out), 0) + 1
    missing = [(m, n) for m in range(16) for n in range(256) if written.get((m, n)) != 1]
    if missing:
        errors.append(("not written exactly once", len(missing)))
    return errors


if __name__ == "__main__":
    errs = run()
    print("b3 staged epilogue index model:", "PASS" if not errs else "FAIL %s" % errs[:5])
    sys.exit(1 if errs else 0)
