# Randomised interleaving model of the barrier protocol of the Hopper kernels whose consumer
# warpgroups gather their own A rows (src/cuda/engines/sm90/f1_gemm.cu, rows_gemm.cu's B1, wgrad_gemm.cu's
# B2/B3), optionally with the epilogue warps and their hand-off buffer (F1's and B1's epilogue-warp
# forms), and with a producer share (the producer also gathers part of both halves after the
# slot's empty barrier; a variant the kernels do not use, kept as a checked alternative).
#
# Agents of one CTA:
#   - the producer (thread 0): for every k-step it of the CTA's sequence, waits empty[s] (parity
#     ((it / S) & 1) ^ 1), arrive.expect_tx, issues the B boxes (an asynchronous landing that
#     writes B of slot s with fill id `it`, then completes the bytes);
#   - consumer warpgroups 0 and 1: each gathers its own A half kS - 1 k-steps ahead (a cursor over
#     the same sequence; each issue is CP_GROUPS asynchronous cp.async groups that write the half
#     with fill id `it` and arrive on a_full[w][s] when they land); per k-step: wait full[s] and
#     a_full[w][s], issue the wgmma (reads B of s and its own A half until it completes),
#     wait_group 1 (the previous wgmma completes), release the previous slot (empty: one arrival
#     per warpgroup here, standing for its 4 warps), then refill that slot's A half with k-step
#     it + S - 1. A tile's last k-step: wait_group 0, release. With the hand-off: wait
#     handoff_empty (parity (n & 1) ^ 1), write its half of the hand-off (tile n), arrive on
#     handoff_full;
#   - with the hand-off, epilogue warps 0 and 1: per tile n, wait handoff_full (parity n & 1),
#     read both halves (must be tile n's), then arrive on handoff_empty;
#   - split (F1's split form, B1's two-group split): the consumers also store part of the tile
#     from the hand-off, reading both warpgroups' halves. They meet at named barrier 1 (bar.sync
#     over both warpgroups) before writing the hand-off and again after it, then read.
# The CTA's tiles each have k_steps in 0..6 (0: an empty expert's tile in B2/B3, which the gather
# cursor skips and whose consumer loop runs no k-step and releases nothing) or a constant (F1).
#
# Checked: no deadlock; every wgmma reads B and its A half of fill `it` for the whole time it runs;
# no B landing, A landing or hand-off write goes into memory a reader still reads; the epilogue
# reads tile n's hand-off; nothing is pending at the end.
#
#   python3 tools/models/consumer_gather_protocol_model.py [trials]   (prints PASS / the error)
# Mutations (each must FAIL): --lag-S (gather S k-steps ahead: overwrites a live slot), --no-a-wait
# (wgmma without waiting a_full), --no-handoff-wait (hand-off written without waiting
# handoff_empty), --handoff-empty-1 (handoff_empty counts 1 of the 2 epilogue warps),
# --share-no-empty-wait (the producer's share of A issued before the slot's empty barrier),
# --early-lag-S1 (the gather issued before wait_group 1 with lead S - 1: into the slot of k-step
# it - 1, whose wgmma may still run), --split-no-sync-before (split: the hand-off written without
# the named barrier: over the other warpgroup's read), --split-no-sync-after (split: the read
# without the named barrier after the write: the other half may be the previous tile's). "early": the 4-stage kernels issue the gather
# between the commit and wait_group 1 with lead S - 2 (the slot of k-step it - 2).
#   --self-test: the protocol must PASS and every mutation must FAIL (exit 0 only then); CTest
#   runs this (label tools: tools_consumer_gather_protocol_model).
import random
import sys

from mbarrier_model import Bar, Fail, interleave, main

CP_GROUPS = 4


def run(seed, S, handoff, mut, share=False, early=False, split=False):
    rnd = random.Random(seed)
    if rnd.random() < 0.5:
        tiles = [rnd.randint(1, 7)] * rnd.randint(0, 8)  # F1 / rows: one k-step count
    else:
        tiles = [rnd.choice([0, 1, 2, 3, 4, 5, 6]) for _ in range(rnd.randint(0, 8))]  # varlen K
    seq = [(n, kt) for n, k in enumerate(tiles) for kt in range(k)]  # the CTA's k-steps
    lag = S if mut.get("lag_S") else S - 1
    if early:  # the gather issued between the commit and wait_group 1: lead S - 2
        lag = S - 1 if mut.get("early_lag_S1") else S - 2
    full = [Bar(1, "full%d" % s) for s in range(S)]
    empty = [Bar(2, "empty%d" % s) for s in range(S)]
    # share: the producer also gathers part of both halves, after the slot's empty
    # barrier (as its B boxes), arriving on both a_full barriers: CP_GROUPS more arrivals each.
    a_count = 2 * CP_GROUPS if share else CP_GROUPS
    a_full = [[Bar(a_count, "a_full%d.%d" % (w, s)) for s in range(S)] for w in range(2)]
    h_full = Bar(2, "handoff_full")
    h_empty = Bar(1 if mut.get("handoff_empty_1") else 2, "handoff_empty")
    b_fill = [None] * S
    a_fill = [[None] * S for _ in range(2)]  # the consumers' rows of each half
    p_fill = [[None] * S for _ in range(2)]  # share: the producer's rows of each half
    readers_b = [set() for _ in range(S)]  # warpgroups whose wgmma reads B of slot s
    reading_a = [[False] * S for _ in range(2)]
    hand = [None, None]  # tile id in each half of the hand-off
    hand_readers = set()
    split_readers = set()  # split: consumer warpgroups reading the hand-off
    named = {"gen": 0, "arrived": 0}  # named barrier 1 over the two consumer warpgroups
    events = []

    def check(cond, *what):
        if not cond:
            raise Fail(what)

    # ---- producer
    def producer():
        def share_a(s, it):
            for w in range(2):
                def a_land(w=w, s=s, it=it):
                    check(not reading_a[w][s], "producer's A landed in a half being read", w, s, it)
                    p_fill[w][s] = it
                    a_full[w][s].arrive()
                for _ in range(CP_GROUPS):
                    events.append(a_land)

        for it in range(len(seq)):
            s = it % S
            early = share and mut.get("share_no_empty_wait")
            if early:  # mutation: the producer's A share before the slot is free
                share_a(s, it)
            while not empty[s].passed(((it // S) & 1) ^ 1):
                yield
            full[s].expect_tx(1)

            def land(s=s, it=it):
                check(not readers_b[s], "B landed in a slot being read", s, it)
                b_fill[s] = it
                full[s].complete_tx(1)
            events.append(land)
            if share and not early:
                share_a(s, it)
            yield

    def named_sync():  # bar.sync 1, 256: both consumer warpgroups arrive, then both go on
        gen = named["gen"]
        named["arrived"] += 1
        if named["arrived"] == 2:
            named["arrived"], named["gen"] = 0, gen + 1
        while named["gen"] == gen:
            yield

    # ---- consumer warpgroup w
    def consumer(w):
        cursor = [0]

        def gather():  # issue the cursor's k-step (its slot was checked free by the caller)
            it = cursor[0]
            if it >= len(seq):
                return
            s = it % S
            check(not reading_a[w][s], "A gather into a half being read", w, s, it)

            def land(s=s, it=it):  # one of the CP_GROUPS cp.async groups lands and arrives
                check(not reading_a[w][s], "A landed in a half being read", w, s, it)
                a_fill[w][s] = it
                a_full[w][s].arrive()
            for _ in range(CP_GROUPS):
                events.append(land)
            cursor[0] += 1

        for _ in range(lag):
            gather()
        it = 0
        pending = []  # the wgmma in flight: (it, s)

        def complete(entry):
            pit, ps = entry
            check(b_fill[ps] == pit and a_fill[w][ps] == pit and (not share or p_fill[w][ps] == pit),
                  "wgmma saw another fill", w, pit)
            readers_b[ps].discard(w)
            reading_a[w][ps] = False

        for n, k in enumerate(tiles):
            prev = None
            for kt in range(k):
                s = it % S
                par = (it // S) & 1
                while not full[s].passed(par) or (
                        not mut.get("no_a_wait") and not a_full[w][s].passed(par)):
                    yield
                check(b_fill[s] == it, "B of another fill at wgmma issue", w, it)
                check(a_fill[w][s] == it, "A of another fill at wgmma issue", w, it)
                check(not share or p_fill[w][s] == it, "producer's A of another fill", w, it)
                readers_b[s].add(w)
                reading_a[w][s] = True
                pending.append((it, s))
                yield  # the wgmma runs while others move
                if early:  # before wait_group 1: the slot of k-step it - 2 (completed before)
                    check(cursor[0] >= len(seq) or cursor[0] == it + lag, "cursor out of step", w)
                    gather()
                    yield
                while len(pending) > 1:  # wait_group 1
                    complete(pending.pop(0))
                if prev is not None:
                    empty[prev].arrive()
                if not early:
                    # Every k-step refills the slot of the previous one (its wgmma has completed)
                    # with this warpgroup's A of k-step it + lag, the cursor's next.
                    check(cursor[0] >= len(seq) or cursor[0] == it + lag, "cursor out of step", w)
                    gather()
                prev = s
                it += 1
                yield
            while pending:  # wait_group 0
                complete(pending.pop(0))
            if prev is not None:
                empty[prev].arrive()
            if handoff:
                if split and not mut.get("split_no_sync_before"):
                    yield from named_sync()
                while not mut.get("no_handoff_wait") and not h_empty.passed((n & 1) ^ 1):
                    yield
                check(w not in hand_readers and not hand_readers,
                      "hand-off written while the epilogue reads it", w, n)
                check(not split_readers, "hand-off written while a consumer reads it", w, n)
                hand[w] = n
                h_full.arrive()
                yield
                if split:
                    if not mut.get("split_no_sync_after"):
                        yield from named_sync()
                    check(hand[0] == n and hand[1] == n, "consumer read another tile's hand-off",
                          w, n, hand)
                    split_readers.add(w)
                    yield  # reading
                    check(hand[0] == n and hand[1] == n,
                          "hand-off overwritten during the consumers' read", w, n)
                    split_readers.discard(w)

    # ---- epilogue warp e (hand-off only)
    def epilogue(e):
        for n in range(len(tiles)):
            while not h_full.passed(n & 1):
                yield
            check(hand[0] == n and hand[1] == n, "epilogue read another tile's hand-off", e, n,
                  hand)
            hand_readers.add(e)
            yield  # reading
            check(hand[0] == n and hand[1] == n, "hand-off overwritten during the read", e, n)
            hand_readers.discard(e)
            h_empty.arrive()

    agents = [producer(), consumer(0), consumer(1)]
    if handoff:
        agents += [epilogue(0), epilogue(1)]
    interleave(rnd, agents, events, ("tiles", tiles))


MUTATIONS = ("lag_S", "no_a_wait", "no_handoff_wait", "handoff_empty_1", "share_no_empty_wait",
             "early_lag_S1", "split_no_sync_before", "split_no_sync_after")


def check_all(trials, mut, quiet=False):
    for t in range(trials):
        for S in (3, 4):
            for handoff in (False, True):
                if (mut.get("no_handoff_wait") or mut.get("handoff_empty_1")) and not handoff:
                    continue
                for share in (False, True):
                    # early: the gather between commit and wait_group 1, as the 4-stage kernels
                    for early in ((False, True) if S >= 4 else (False,)):
                        if mut.get("early_lag_S1") and not early:
                            continue
                        for split in ((False, True) if handoff else (False,)):
                            if (mut.get("split_no_sync_before") or
                                    mut.get("split_no_sync_after")) and not split:
                                continue
                            try:
                                run(t * 7919 + S * 31 + handoff * 2 + share + 4 * early +
                                    8 * split, S, handoff, mut, share, early, split)
                            except Fail as f:
                                if not quiet:
                                    print("FAIL seed %d S %d handoff %s share %s early %s split "
                                          "%s: %s" % (t, S, handoff, share, early, split,
                                                      f.args[0]))
                                return False
    return True


if __name__ == "__main__":
    sys.exit(main(check_all, MUTATIONS, "3/4 stages x hand-off off/on x producer share off/on x "
                  "gather before/after wait_group 1 x split epilogue off/on"))
