# Randomised interleaving model of the barrier protocol of sm90_wgrad_cluster.cu, version 3
# (CLUSTER = 2; CLUSTER = 1 is round 4's version 2 for comparison).
#
# Agents per CTA: the producer (thread 0's arrive / arrive.expect_tx + multicast issue, the 128
# producer threads' cp.async fills with their noinc arrivals, modelled as CP_GROUPS asynchronous
# groups), W consumer warps (wait full, read the slot until the release one stage later, release
# on the empty barrier of EVERY CTA of the cluster by remote arrive). Asynchronous events
# (TMA box landings with complete_tx, cp.async completions, remote arrivals) are delivered in a
# random order at random times. Both CTAs run the same unit sequence (same expert -> same k-stages,
# same `valid`, same c_boxes); a unit may be idle for rank 1 (the odd last tile: it gathers
# nothing but still issues its multicast share).
#
# Checked: no deadlock; every consumer read of iteration `it` sees, for every contiguous box and
# for the gathered operand, the data of fill `it` of its own CTA's slot, from its full wait to its
# release (no TMA / multicast / cp.async write lands in a slot a consumer of that CTA still reads);
# a full barrier never completes with bytes outstanding or over-delivered (tx must be 0 when the
# last arrival comes; more bytes than expected = assertion); at the cluster sync before exit no
# asynchronous event is pending (no remote arrive or multicast into an exited CTA).
#
#   /usr/bin/python3 dev/cuda/wgrad_cluster_protocol_model.py [trials]    (prints PASS / the error)
# Mutation switches (each must make the model FAIL): --single-empty (empty count 8 instead of
# 8 x 2, release only locally), --expect-half (each CTA expects only its own share of the bytes),
# --disagree (rank 0 multicasts its share of a partial stage, rank 1 loads it locally),
# --idle-skips (the idle CTA issues no multicast share).
import random
import sys

CP_GROUPS = 4  # the 128 cp.async arrivals as 4 asynchronous groups of 32


class Bar:
    def __init__(self, count, name):
        self.count, self.pending, self.tx, self.phase, self.name = count, count, 0, 0, name

    def _maybe(self):
        if self.pending == 0:
            assert self.tx >= 0, ("more bytes than expected", self.name, self.tx)
            if self.tx == 0:
                self.phase += 1
                self.pending = self.count

    def arrive(self, n=1):
        self.pending -= n
        assert self.pending >= 0, ("too many arrivals", self.name)
        self._maybe()

    def expect_tx(self, b):
        self.tx += b
        self.arrive()

    def complete_tx(self, b):
        self.tx -= b
        # tx may be transiently negative (peer's bytes before our expect_tx): legal while arrivals
        # are pending, which _maybe checks.
        self._maybe()

    def passed(self, parity):  # try_wait.parity: true once the phase with this parity completed
        return (self.phase & 1) != parity


def run(seed, CL, S, W, units, mut):
    rnd = random.Random(seed)
    ctas = []
    for r in range(CL):
        empty_count = W if mut.get("single_empty") else W * CL
        ctas.append(dict(
            full=[Bar(CP_GROUPS + 1, "full%d.%d" % (r, s)) for s in range(S)],
            empty=[Bar(empty_count, "empty%d.%d" % (r, s)) for s in range(S)],
            box=[[None] * 4 for _ in range(S)],  # fill id of each contiguous box in the slot
            gath=[None] * S,
            reading=[0] * S))
    events = []  # pending asynchronous events: (cta targeted, callable)

    def write(C, s, what, b, f):
        assert C["reading"][s] == 0, ("write into a slot being read", what, s, f)
        if what == "box":
            C["box"][s][b] = f
        else:
            C["gath"][s] = f

    def producer(r):
        C = ctas[r]
        it = 0
        for (k_stages, last_valid, c_boxes, idle1) in units:
            for kt in range(k_stages):
                s = it % S
                valid = last_valid if kt == k_stages - 1 else 64
                while not C["empty"][s].passed(((it // S) & 1) ^ 1):
                    yield False
                f = it
                # --disagree: rank 0 multicasts the partial stage, rank 1 loads it locally
                mcast = valid == 64 or (mut.get("disagree") and r == 0)
                if mcast:
                    if True:
                        mine = list(range(r, c_boxes, CL))
                        if mut.get("idle_skips") and idle1 and r == 1:
                            mine = []
                        C["full"][s].expect_tx(len(mine) if mut.get("expect_half") else c_boxes)
                    for b in mine:
                        for dst in range(CL):
                            def land(dst=dst, s=s, b=b, f=f):
                                D = ctas[dst]
                                write(D, s, "box", b, f)
                                D["full"][s].complete_tx(1)
                            events.append((dst, land))
                else:
                    C["full"][s].arrive()  # thread 0's plain arrive; boxes come by cp.async
                # the 128 producer threads: gathered rows (+ contiguous rows on a partial stage)
                for g in range(CP_GROUPS):
                    def cp(C=C, s=s, f=f, g=g, local_c=not mcast, c_boxes=c_boxes):
                        if g == 0:
                            write(C, s, "gath", 0, f)
                            if local_c:
                                for b in range(c_boxes):
                                    write(C, s, "box", b, f)
                        C["full"][s].arrive()
                    events.append((r, cp))
                it += 1
                yield True

    def consumer(r, w):
        C = ctas[r]
        it = 0
        for (k_stages, last_valid, c_boxes, idle1) in units:
            prev = None
            for kt in range(k_stages):
                s = it % S
                while not C["full"][s].passed((it // S) & 1):
                    yield False
                C["reading"][s] += 1
                got = (C["gath"][s], [C["box"][s][b] for b in range(c_boxes)])
                assert got == (it, [it] * c_boxes), ("stale data", r, w, it, s, got)
                C.setdefault("reads", []).append((w, s, it, c_boxes))
                yield True  # the wgmmas of this stage run; the previous stage's are done after this
                if prev is not None:
                    release(r, prev)
                prev = (s, it, c_boxes)
                it += 1
            if prev is not None:
                yield True
                release(r, prev)
        C.setdefault("done_cons", 0)
        C["done_cons"] += 1

    def release(r, prev):
        s, it, c_boxes = prev
        C = ctas[r]
        # the data must still be this fill's at the end of the read
        got = (C["gath"][s], [C["box"][s][b] for b in range(c_boxes)])
        assert got == (it, [it] * c_boxes), ("data changed during read", r, it, s, got)
        C["reading"][s] -= 1
        targets = [r] if mut.get("single_empty") else list(range(CL))
        for dst in targets:
            events.append((dst, lambda dst=dst, s=s: ctas[dst]["empty"][s].arrive()))

    agents = [producer(r) for r in range(CL)] + [consumer(r, w) for r in range(CL)
                                                   for w in range(W)]
    alive = list(agents)
    steps = 0
    blocked = set()  # agents whose last step was a failed wait, since the last state change
    while alive or events:
        steps += 1
        assert steps < 5000000, "runaway"
        if events and (not alive or rnd.random() < 0.45):
            _, ev = events.pop(rnd.randrange(len(events)))
            ev()
            blocked.clear()
            continue
        a = rnd.choice(alive)
        try:
            moved = next(a)
        except StopIteration:
            alive.remove(a)
            blocked.clear()
            continue
        if moved:
            blocked.clear()
        else:
            blocked.add(id(a))
            if not events and len(blocked) == len(alive):
                raise AssertionError("deadlock")
    # cluster sync before exit: everything delivered (checked by the loop) and every read done
    for C in ctas:
        assert all(x == 0 for x in C["reading"]), "slot still read at exit"
        assert C.get("done_cons", 0) == W
    total_reads = sum(len(C.get("reads", [])) for C in ctas)
    expect_reads = CL * W * sum(u[0] for u in units)
    assert total_reads == expect_reads, ("reads", total_reads, expect_reads)


def random_units(rnd):
    units = []
    for _ in range(rnd.randint(1, 6)):
        k = rnd.choice([0, 1, 1, 2, 3, 5, 7])  # 0: an empty expert
        last = rnd.choice([64, 64, 7, 33, 63]) if k else 64
        c_boxes = rnd.randint(1, 4)
        idle1 = rnd.random() < 0.3
        units.append((k, last, c_boxes, idle1))
    return units


def main():
    trials = 300
    mut = {}
    for a in sys.argv[1:]:
        if a.startswith("--"):
            mut[a[2:].replace("-", "_")] = True
        else:
            trials = int(a)
    fails = 0
    first = None
    for t in range(trials):
        rnd = random.Random(1000 + t)
        CL = 2 if t % 5 else 1
        S = rnd.choice([2, 3, 4])  # 1 deadlocks by design: a warp holds a slot into the next wait
        W = rnd.choice([1, 2, 8])
        units = random_units(rnd)
        try:
            run(t, CL, S, W, units, mut)
        except AssertionError as e:
            fails += 1
            if first is None:
                first = (t, CL, S, W, units, e)
    if fails:
        print("FAIL: %d of %d trials; first: trial %d CL %d S %d W %d units %s: %s" %
              ((fails, trials) + first))
        sys.exit(1)
    print("PASS: %d trials (CLUSTER 1 and 2, 2-4 stages, 1/2/8 consumer warps, partial last "
          "stages, empty experts, idle rank-1 CTAs, 1-4 contiguous boxes)" % trials)


if __name__ == "__main__":
    main()
