# Index model of the rows kernel's epilogue-warp forms (src/cuda/engines/sm90/rows_b1_epilogue.cuh:
# B1's epilogue run by warps 1-3 of the producer warpgroup from a 64 KB bf16 hand-off of v; and
# F2's and B4's store from the same hand-off). It checks the kernel's
# bookkeeping, not the hardware:
#  - the consumers' hand-off writes (register 4j + q of lane (g, t4) of consumer warp w) and the
#    epilogue warps' 16-byte reads agree: every element (row, col) of the 128 x 256 tile is read
#    back from where it was written, and each warp store instruction of the hand-off (fixed j, rr)
#    touches all 32 banks once;
#  - the item loop (b1_epilogue_items: idx = 32 w + lane + 32 W i, W = 3 epilogue warps, 4, or the
#    8 consumer warps) covers every (row, 16-byte chunk) of its groups exactly once, each warp runs
#    a warp-uniform number of iterations (the dg shuffles need all 32 lanes), and the 8 lanes of a
#    row are consecutive and 8-aligned in one warp (so the xor-1/2/4 shuffles sum exactly that
#    row's chunks); in the two-group split the consumers' groups 0-1 and the epilogue warps' 2-3
#    together cover the tile exactly once (split_errors);
#  - a consumer-issued TMA schedule (issue_ahead: four epilogue warps, one consumer thread issuing
#    the loads; slower on the H200, so not in the kernels) issues every (tile, k-step) of a CTA
#    once, into the slot and phase of its loop position, before the loop reaches it, for k_tiles
#    down to 1 (tma_schedule_errors). It is the schedule any consumer-issued lookahead (ping-pong
#    consumers) must satisfy.
#  - the consumers write the hand-off with stmatrix.x4 (primitives.cuh, store_handoff; F1 and the
#    rows kernels): every element lands on the word of the layout above (the one the epilogue
#    warps read), once, for every first group the split forms hand off from, and each matrix's 8
#    rows fall in 8 different 16-byte bank quads; the same addressing without the chunk xor must
#    fail (stmatrix_errors);
#  - F2's and B4's store form (rows_gemm.cu, rows_store_warps): epilogue warp ew stores rows ew,
#    ew + 3, ... and lane q copies 16-byte chunk q & 7 of group q >> 3 of its row from the same
#    hand-off: every (row, column pair) is stored from the word the consumers wrote for it, once,
#    and the running address of consecutive rows is each row's own (rows_store_errors; a step of
#    one row instead of three must fail).
#   python3 tools/models/b1_epilogue_warps_model.py
import sys

K_BM, SUB_WORDS = 128, 128 * 64 * 2 // 4


def run(epi_warps, first=0, last=4, seen=None):
    """The item loop of `epi_warps` warps over groups first..last-1; `seen` (row, col) -> count
    accumulates over calls. Without `seen`, every chunk of the tile must be covered once."""
    check_all = seen is None
    seen = {} if seen is None else seen
    errors = []
    written = {}  # word -> (row, col of the word's first element)
    for cw in range(8):  # consumer warp: warpgroup cw // 4, warp_in_wg cw % 4
        tile_row = (cw // 4) * 64 + (cw % 4) * 16
        for j in range(32):
            for rr in range(2):
                banks = set()
                for lane in range(32):
                    g, t4 = lane >> 2, lane & 3
                    row = tile_row + g + 8 * rr
                    word = (j >> 3) * SUB_WORDS + row * 32 + (((j & 7) ^ g) << 2) + t4
                    if word in written:
                        errors.append(("hand-off word written twice", word))
                    written[word] = (row, 8 * j + 2 * t4)
                    banks.add(word % 32)
                if len(banks) != 32:
                    errors.append(("hand-off bank conflict", cw, j, rr))
    for ew in range(epi_warps):
        iters = 0
        base = 32 * ew
        while base < K_BM * 8:
            iters += 1
            rows_of_lanes = {}
            for lane in range(32):
                idx = base + lane
                row, ch = idx >> 3, idx & 7
                rows_of_lanes.setdefault(row, []).append(lane)
                if row >= K_BM:  # the last pass of 3 warps: past the tile's 1024 items
                    continue
                for group in range(first, last):
                    col = group * 64 + ch * 8
                    for k in range(4):  # the uint4's 4 words, 2 elements each
                        word = group * SUB_WORDS + row * 32 + ((ch ^ (row & 7)) << 2) + k
                        if written.get(word) != (row, col + 2 * k):
                            errors.append(("read != write", ew, lane, group, k))
                    key = (row, col)
                    seen[key] = seen.get(key, 0) + 1
            for row, lanes in rows_of_lanes.items():
                if len(lanes) != 8 or lanes[0] % 8 != 0 or lanes != list(range(lanes[0], lanes[0] + 8)):
                    errors.append(("row lanes not an aligned octet", ew, row, lanes))
            base += 32 * epi_warps
        if iters == 0:
            errors.append(("warp without items", ew))
    if check_all:
        errors += coverage_errors(seen)
    return errors


def coverage_errors(seen):
    return [("chunk not covered exactly once", row, col, seen.get((row, col)))
            for row in range(K_BM) for col in range(0, 256, 8) if seen.get((row, col)) != 1]


def split_errors(consumer_groups, consumer_first_end=None):
    """The two-group split (consumer_groups 2): the 8 consumer warps run groups 0..F-1, the 3
    epilogue warps F..3, from the same hand-off. consumer_first_end: a mutation (the consumers' range end), which must fail."""
    seen = {}
    end = consumer_groups if consumer_first_end is None else consumer_first_end
    errors = run(8, 0, end, seen) + run(3, consumer_groups, 4, seen)
    return errors + coverage_errors(seen)


def tma_schedule_errors(k_tiles, total_tiles, grid, cta, stages=3, one_tile_ahead=False):
    """The consumer-issued TMA schedule (issue_ahead) of one CTA.
    Prologue: k-steps 0 .. lead - 1; at k-step it of tile t (k-step kt): k-step it + lead, which
    may lie `skip` tiles ahead. Every (tile, k-step) the CTA's main loop runs must be issued exactly
    once, as global k-step it' = its position in the loop (slot it' % stages, phase it' / stages),
    and before the loop reaches it; nothing past the CTA's last tile."""
    lead = stages - 1
    errors, issued = [], {}

    def issue_ahead(t, kt, it, ahead):
        t2, kt2 = t, kt + ahead
        if kt2 >= k_tiles:
            skip = 1 if one_tile_ahead else kt2 // k_tiles  # one_tile_ahead: a mutation
            kt2 -= skip * k_tiles
            t2 += skip * grid
        if t2 >= total_tiles:
            return
        key = (t2, kt2)
        if key in issued:
            errors.append(("issued twice", key))
        issued[key] = (it + ahead, it)  # (global k-step it names, the loop step it was issued at)

    if cta < total_tiles:
        for j in range(lead):
            issue_ahead(cta, 0, 0, j)
    it = 0
    for t in range(cta, total_tiles, grid):
        for kt in range(k_tiles):
            got = issued.get((t, kt))
            if got is None:
                errors.append(("not issued before use", t, kt))
            elif got[0] != it:
                errors.append(("wrong slot/phase", t, kt, got[0], it))
            elif got[1] > it:
                errors.append(("issued after use", t, kt))
            issue_ahead(t, kt, it, lead)
            it += 1
    used = {(t, kt) for t in range(cta, total_tiles, grid) for kt in range(k_tiles)}
    extra = set(issued) - used
    if extra:
        errors.append(("issued but never used", sorted(extra)[:3]))
    return errors


def tma_schedule_check():
    errors = []
    for k_tiles in (1, 2, 3, 8, 16):
        for total in (0, 1, 5, 17, 40):
            for grid in (1, 4, 7):
                for cta in range(grid):
                    errors += tma_schedule_errors(k_tiles, total, grid, cta)
    # A mutation the model must catch: stepping at most one tile ahead, wrong whenever the lead
    # spans more than one tile (k_tiles = 1, the forced forms' d = 64 case; or 4 stages, lead 3,
    # over 2-step tiles).
    for k_tiles, stages in ((1, 3), (2, 4)):
        if not tma_schedule_errors(k_tiles, 5, 1, 0, stages=stages, one_tile_ahead=True):
            errors.append(("one-tile-ahead mutation unnoticed", k_tiles, stages))
    return errors


def handoff_layout():
    """The hand-off layout the epilogue warps read: word -> (row, col of the word's first
    element) for register 4j + q of lane (g, t4) of each of the 8 consumer warps."""
    layout = {}
    for cw in range(8):
        tile_row = (cw // 4) * 64 + (cw % 4) * 16
        for lane in range(32):
            g, t4 = lane >> 2, lane & 3
            for j in range(32):
                for rr in range(2):
                    row = tile_row + g + 8 * rr
                    layout[(j >> 3) * SUB_WORDS + row * 32 + (((j & 7) ^ g) << 2) + t4] = \
                        (row, 8 * j + 2 * t4)
    return layout


def rows_store_errors(step_rows=3):
    errors, written = [], handoff_layout()
    stored = {}
    row0, out_ld, size, out = 1000, 4096 + 24, 2, 0x7F0000000000
    for ew in range(3):
        dst = out + (row0 + ew) * out_ld * size  # less the lane's column, common to every row
        for row in range(ew, K_BM, 3):
            if dst != out + (row0 + row) * out_ld * size:
                errors.append(("running address off its row", ew, row))
            dst += step_rows * out_ld * size
            for lane in range(32):
                group, chunk = lane >> 3, lane & 7
                base = group * SUB_WORDS + row * 32 + ((chunk ^ (row & 7)) << 2)
                for i in range(4):  # the uint4's words: column pairs 8 lane + 2 i
                    want = (row, 8 * lane + 2 * i)
                    if written.get(base + i) != want:
                        errors.append(("stored from the wrong word", ew, row, lane, i))
                    stored[want] = stored.get(want, 0) + 1
    if len(stored) != K_BM * 128 or any(n != 1 for n in stored.values()):
        errors.append(("pairs not stored exactly once", len(stored)))
    return errors


def stmatrix_writes(first_group, xor=True):
    """store_handoff's stmatrix.x4 writes of all 8 consumer warps: (word -> (row, col) of the
    word's first element, errors). Word 0 is the hand-off's first word (group first_group)."""
    errors, written = [], {}
    for cw in range(8):
        tile_row = (cw // 4) * 64 + (cw % 4) * 16
        for j in range(8 * first_group, 32, 2):
            addr = []  # lane -> the byte address it gives: row lane & 7 of matrix lane >> 3
            for lane in range(32):
                row = tile_row + (lane & 7) + 8 * ((lane >> 3) & 1)
                jj = j + (lane >> 4)
                chunk = ((jj & 7) ^ (row & 7)) if xor else (jj & 7)
                addr.append(((jj >> 3) - first_group) * 128 * 128 + row * 128 + (chunk << 4))
            for q in range(4):
                if len({(addr[8 * q + r] % 128) // 16 for r in range(8)}) != 8:
                    errors.append(("stmatrix bank conflict", cw, j, q))
                jj, rr = j + (q >> 1), q & 1
                for lane in range(32):  # register q of lane (g, t4): row g, columns 2 t4, +1
                    g, t4 = lane >> 2, lane & 3
                    word = (addr[8 * q + g] + 4 * t4) // 4
                    if word in written:
                        errors.append(("stmatrix word written twice", cw, j, q, lane))
                    written[word] = (tile_row + g + 8 * rr, 8 * jj + 2 * t4)
    return written, errors


def stmatrix_errors():
    reference = handoff_layout()
    errors = []
    for first_group in range(4):  # F1 and the warps form: 0; the split forms: 1, 2
        written, errs = stmatrix_writes(first_group)
        errors += errs
        want = {word - first_group * SUB_WORDS: rc for word, rc in reference.items()
                if word >= first_group * SUB_WORDS}
        if written != want:
            errors.append(("stmatrix layout differs from the readers'", first_group))
    written, errs = stmatrix_writes(0, xor=False)
    if not errs and written == reference:
        errors.append(("stmatrix without the chunk xor unnoticed",))
    return errors


if __name__ == "__main__":
    # 3 epilogue warps (warps 1-3, the kernel's form) and 4 (the whole first warpgroup).
    failed = False
    for warps in (3, 4, 8):
        errs = run(warps)
        print("b1 epilogue item loop index model, %d warps:" % warps,
              "PASS" if not errs else "FAIL %s" % errs[:5])
        failed = failed or bool(errs)
    errs = split_errors(2)
    if not split_errors(2, consumer_first_end=3):  # consumers overlapping the warps' groups
        errs.append(("split overlap unnoticed",))
    print("b1 two-group split's coverage (consumers + epilogue warps):",
          "PASS" if not errs else "FAIL %s" % errs[:5])
    failed = failed or bool(errs)
    errs = rows_store_errors()
    if not rows_store_errors(step_rows=1):  # the running address stepping one row, not three
        errs.append(("wrong row step unnoticed",))
    print("F2/B4 store-warps index model:", "PASS" if not errs else "FAIL %s" % errs[:5])
    failed = failed or bool(errs)
    errs = stmatrix_errors()
    print("hand-off stmatrix index model:", "PASS" if not errs else "FAIL %s" % errs[:5])
    failed = failed or bool(errs)
    errs = tma_schedule_check()
    print("b1 consumer-issued TMA schedule model:", "PASS" if not errs else "FAIL %s" % errs[:5])
    failed = failed or bool(errs)
    sys.exit(1 if failed else 0)
