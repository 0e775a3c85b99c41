# Randomised interleaving model of the barrier protocol of the ping-pong rows kernel
# (src/cuda/engines/sm90/rows_pingpong_gemm.cu: F2 and B4 with MOEBLAZE_CUDA_ROWS_FORM=pingpong).
#
# Agents of one CTA:
#   - the producer (thread 0): for every k-step it of the CTA's sequence (its tiles in order, each
#     k_tiles k-steps), waits empty[s] (parity ((it / S) & 1) ^ 1), arrive.expect_tx, issues the
#     TMA loads (an asynchronous landing that writes slot s with fill id `it`, then completes the
#     bytes);
#   - consumer warpgroups 0 and 1: warpgroup w owns the CTA's tiles n with n % 2 == w and skips
#     the others by advancing its k-step counter by k_tiles. Before the main loop of tile n >= 1 it
#     waits on turn[w] (parity: its own count of such waits & 1) until the other warpgroup has
#     finished the main loop of tile n - 1 (all 128 threads arrive on turn[w] after it). Without
#     that order a warpgroup whose k-step counter jumped ahead would wait on a full barrier two
#     phases behind, whose parity already reads "passed". Per owned k-step: wait full[s]
#     (parity (it / S) & 1), issue the wgmma (reads slot s until it completes), wait_group 1 (the
#     previous wgmma completes), release the previous slot on empty (one arrival standing for the
#     warpgroup's 4 warps; empty counts one warpgroup). A tile's last k-step: wait_group 0,
#     release; then the epilogue from registers (no shared memory).
#
# Checked: no deadlock; every wgmma reads the fill of its own k-step for the whole time it runs; no
# landing goes into a slot a wgmma still reads; every tile is computed and stored exactly once, by
# its owner; nothing is pending at the end.
#
#   python3 tools/models/rows_pingpong_protocol_model.py [trials]   (prints PASS / the error)
# Mutations (each must FAIL): --no-order (no turn barriers), --no-skip (a warpgroup does not advance its counter over the other's
# tiles), --empty-both (empty counts both warpgroups, as if every stage were shared),
# --release-early (a slot released right after its wgmma is issued, before it completes),
# --no-ownership (both warpgroups take every tile).
#   --self-test: the protocol must PASS and every mutation must FAIL (exit 0 only then); CTest
#   runs this (label tools: tools_rows_pingpong_protocol_model).
import random
import sys

from mbarrier_model import Bar, Fail, interleave, main, over_stages


def run(seed, S, mut):
    rnd = random.Random(seed)
    k_tiles = rnd.randint(1, 8)
    tiles = rnd.randint(0, 9)
    seq = [(n, kt) for n in range(tiles) for kt in range(k_tiles)]
    full = [Bar(1, "full%d" % s) for s in range(S)]
    empty = [Bar(2 if mut.get("empty_both") else 1, "empty%d" % s) for s in range(S)]
    turn = [Bar(1, "turn%d" % w) for w in range(2)]  # 1 arrival standing for 128 threads
    fill = [None] * S
    readers = [set() for _ in range(S)]
    stored = {}
    events = []

    def check(cond, *what):
        if not cond:
            raise Fail(what)

    def producer():
        for it in range(len(seq)):
            s = it % S
            while not empty[s].passed(((it // S) & 1) ^ 1):
                yield
            full[s].expect_tx(1)

            def land(s=s, it=it):
                check(not readers[s], "a landing into a slot being read", s, it)
                fill[s] = it
                full[s].complete_tx(1)
            events.append(land)
            yield

    def consumer(w):
        it = 0
        pending = []  # wgmmas in flight: (it, s)

        def complete(entry):
            pit, ps = entry
            check(fill[ps] == pit, "a wgmma saw another fill", w, pit)
            readers[ps].discard(w)

        waits = 0
        for n in range(tiles):
            if n % 2 != w and not mut.get("no_ownership"):
                if not mut.get("no_skip"):
                    it += k_tiles
                continue
            if n >= 1 and not mut.get("no_order"):
                while not turn[w].passed(waits & 1):
                    yield
                waits += 1
            prev = None
            for kt in range(k_tiles):
                s = it % S
                while not full[s].passed((it // S) & 1):
                    yield
                check(fill[s] == it, "another fill at wgmma issue", w, n, kt)
                readers[s].add(w)
                pending.append((it, s))
                if mut.get("release_early"):
                    empty[s].arrive()
                yield  # the wgmma runs while the others move
                while len(pending) > 1:  # wait_group 1
                    complete(pending.pop(0))
                if prev is not None and not mut.get("release_early"):
                    empty[prev].arrive()
                prev = s
                it += 1
                yield
            if not mut.get("no_order"):
                turn[1 - w].arrive()  # the main loop's full waits are behind it
            while pending:  # wait_group 0
                complete(pending.pop(0))
            if prev is not None and not mut.get("release_early"):
                empty[prev].arrive()
            check(n not in stored, "a tile stored twice", n, w, stored.get(n))
            stored[n] = w
            yield  # the epilogue, from registers

    interleave(rnd, [producer(), consumer(0), consumer(1)], events,
               ("tiles", tiles, "k_tiles", k_tiles))
    check(sorted(stored) == list(range(tiles)), "tiles not stored", sorted(stored), tiles)
    check(all(stored[n] == n % 2 for n in stored), "a tile stored by the other warpgroup")


MUTATIONS = ("no_order", "no_skip", "empty_both", "release_early", "no_ownership")


# The kernel's stages: 5 (128 x 192 tiles) and 6 (128 x 128).
check_all = over_stages(run, (5, 6))


if __name__ == "__main__":
    sys.exit(main(check_all, MUTATIONS, "5/6 stages"))
