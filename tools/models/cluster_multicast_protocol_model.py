# Randomised interleaving model of the barrier protocol of the Hopper kernels' 2-CTA clusters
# (src/cuda/engines/sm90: F1 with MOEBLAZE_CUDA_F1_CLUSTER=2; the rows kernels with
# MOEBLAZE_CUDA_ROWS_CLUSTER=2; the ping-pong rows kernel with MOEBLAZE_CUDA_ROWS_FORM=pingpong2cta):
# two CTAs on adjacent m-tiles of one expert share each stage's B tile, each loading part of it
# into both CTAs' shared memory by TMA multicast.
#
# Agents, per CTA r (0 and 1) of the cluster:
#   - the producer: for every k-step it (both CTAs walk the same tiles, each k_tiles k-steps), waits
#     its own empty[s] (parity ((it / S) & 1) ^ 1), arrive.expect_tx of its A part (none where the
#     CTA has no rows: past its expert's end) plus ALL of B, then issues its A load (landing in its
#     own slot) and its B part, which lands in BOTH CTAs' slot s and credits each CTA's full[s];
#   - the consumers (the warpgroups reading the stage, as one agent): per k-step, wait full[s]
#     (parity (it / S) & 1), read slot s (A, where the CTA has rows, and both B parts) until the
#     wgmma completes (wait_group 1 at the next k-step), then release the slot on the empty[s] of
#     EVERY CTA of the cluster (empty counts one arrival per CTA);
#   - after its last k-step each CTA arrives on the cluster barrier and waits there, so no CTA exits
#     while the other may still arrive on its barriers or land data in its shared memory.
#
# Checked: no deadlock; every read sees the fill of its own k-step in both parts of B and in A;
# nothing lands in a slot a CTA is still reading; no arrival or landing reaches an exited CTA;
# nothing is pending at the end.
#
#   python3 tools/models/cluster_multicast_protocol_model.py [trials]   (prints PASS / the error)
# Mutations (each must FAIL): --local-release (consumers release only their own CTA's empty, which
# then counts one arrival), --expect-own-part (a CTA expects only the B part it loads itself),
# --idle-skips-b (a CTA without rows loads no B part), --no-exit-sync (no cluster barrier before
# exit).
#   --self-test: the protocol must PASS and every mutation must FAIL (exit 0 only then); CTest
#   runs this (label tools: tools_cluster_multicast_protocol_model).
import random
import sys

from mbarrier_model import Bar, Fail, interleave, main, over_stages


def run(seed, S, mut):
    rnd = random.Random(seed)
    k_tiles = rnd.randint(1, 6)
    tiles = rnd.randint(0, 6)
    # Per tile, whether CTA 1 has rows (CTA 0 always has): an expert's odd last m-tile leaves the
    # second CTA without rows.
    has_rows = [[True, rnd.random() < 0.7] for _ in range(tiles)]
    steps = [(n, kt) for n in range(tiles) for kt in range(k_tiles)]
    full = [[Bar(1, "full%d.%d" % (r, s)) for s in range(S)] for r in range(2)]
    empty_count = 1 if mut.get("local_release") else 2
    empty = [[Bar(empty_count, "empty%d.%d" % (r, s)) for s in range(S)] for r in range(2)]
    # fill[r][s][part]: the k-step whose data that part of CTA r's slot s holds; parts "a", "b0",
    # "b1" (B's part loaded by CTA 0 / CTA 1).
    fill = [[{"a": None, "b0": None, "b1": None} for _ in range(S)] for _ in range(2)]
    reading = [[False] * S for _ in range(2)]
    exited = [False, False]
    at_barrier = [0]
    events = []

    def check(cond, *what):
        if not cond:
            raise Fail(what)

    def land(r, s, part, it):
        def event():
            check(not exited[r], "a landing into an exited CTA", r, s, part, it)
            check(not reading[r][s], "a landing into a slot being read", r, s, part, it)
            fill[r][s][part] = it
            full[r][s].complete_tx(1)
        return event

    def producer(r):
        for it, (n, _) in enumerate(steps):
            s = it % S
            while not empty[r][s].passed(((it // S) & 1) ^ 1):
                yield
            rows = has_rows[n][r]
            b_parts = 1 if mut.get("expect_own_part") else 2
            if mut.get("idle_skips_b") and not has_rows[n][1 - r]:
                b_parts -= 1  # expects no part from a peer that skips its own
            full[r][s].expect_tx((1 if rows else 0) + b_parts)
            if rows:
                events.append(land(r, s, "a", it))
            if rows or not mut.get("idle_skips_b"):
                for dst in (0, 1):  # multicast: the part lands in both CTAs
                    events.append(land(dst, s, "b%d" % r, it))
            yield

    def consumer(r):
        pending = []  # reads in flight: (it, s)

        def complete(entry):
            pit, ps = entry
            f = fill[r][ps]
            check(f["b0"] == pit and f["b1"] == pit, "a read saw another B fill", r, pit, f)
            if has_rows[steps[pit][0]][r]:
                check(f["a"] == pit, "a read saw another A fill", r, pit, f)
            reading[r][ps] = False

        def release(s):
            for dst in ((r,) if mut.get("local_release") else (0, 1)):
                check(not exited[dst], "an arrival on an exited CTA", r, dst)
                empty[dst][s].arrive()

        prev = None
        for it, (n, kt) in enumerate(steps):
            s = it % S
            while not full[r][s].passed((it // S) & 1):
                yield
            reading[r][s] = True
            pending.append((it, s))
            yield  # the wgmma runs while the others move
            while len(pending) > 1:  # wait_group 1
                complete(pending.pop(0))
            if prev is not None and kt > 0:
                release(prev)
            prev = s
            if kt == k_tiles - 1:  # the tile's end: wait_group 0, release
                while pending:
                    complete(pending.pop(0))
                release(s)
                prev = None
            yield

    def cta(r):
        # The CTA's agents run as one interleaved sequence; it exits after the cluster barrier.
        agents = [producer(r), consumer(r)]
        while agents:
            agent = rnd.choice(agents)
            try:
                next(agent)
            except StopIteration:
                agents.remove(agent)
            yield
        if not mut.get("no_exit_sync"):
            at_barrier[0] += 1
            while at_barrier[0] < 2:
                yield
        exited[r] = True

    interleave(rnd, [cta(0), cta(1)], events, ("tiles", tiles, "k_tiles", k_tiles))


MUTATIONS = ("local_release", "expect_own_part", "idle_skips_b", "no_exit_sync")


# The kernels' stages: 3 (epilogue-warp forms), 4, 5 (ping-pong).
check_all = over_stages(run, (3, 4, 5))


if __name__ == "__main__":
    sys.exit(main(check_all, MUTATIONS, "3/4/5 stages"))
