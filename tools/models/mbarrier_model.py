# The pieces the randomised mbarrier protocol models share (consumer_gather_protocol_model.py,
# rows_pingpong_protocol_model.py, cluster_multicast_protocol_model.py): an mbarrier, the failure
# a check raises, the interleaving scheduler and the self-test driver.
import sys


class Fail(Exception):
    pass


class Bar:
    """An mbarrier: `count` arrivals and the expected transaction bytes complete a phase."""

    def __init__(self, count, name):
        self.count, self.pending, self.tx, self.phase, self.name = count, count, 0, 0, name

    def _maybe(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def arrive(self, n=1):
        self.pending -= n
        if self.pending < 0:
            raise Fail(("too many arrivals", self.name))
        self._maybe()

    def expect_tx(self, b):  # arrive.expect_tx
        self.tx += b
        self.arrive()

    def complete_tx(self, b):
        self.tx -= b
        if self.tx < 0 and self.pending == 0:
            raise Fail(("bytes before expect_tx completed", self.name))
        self._maybe()

    def passed(self, parity):  # try_wait.parity
        return (self.phase & 1) != parity


def interleave(rnd, agents, events, what):
    """Runs the agents (generators that yield where another agent may move) and the asynchronous
    events (callables, e.g. a TMA landing) in a random order until all are done; an agent that can
    make no progress for a long time while nothing else can is a deadlock."""
    live = list(agents)
    stuck = 0
    while live or events:
        if events and (not live or rnd.random() < 0.4):
            events.pop(rnd.randrange(len(events)))()
            stuck = 0
            continue
        agent = rnd.choice(live)
        try:
            next(agent)
        except StopIteration:
            live.remove(agent)
            stuck = 0
            continue
        stuck += 1
        if stuck > 20000:
            raise Fail(("deadlock",) + tuple(what))
    if events:
        raise Fail(("events pending at the end",))


def over_stages(run, stages):
    """check_all for a model whose run(seed, S, mut) raises Fail: every trial at each stage count S
    of `stages`, stopping at the first failure (printed unless quiet)."""
    def check_all(trials, mut, quiet=False):
        for t in range(trials):
            for S in stages:
                try:
                    run(t * 7919 + S, S, mut)
                except Fail as f:
                    if not quiet:
                        print("FAIL seed %d S %d: %s" % (t, S, f.args[0]))
                    return False
        return True
    return check_all


def main(check_all, mutations, describe, default_trials=2000):
    """The command line of a protocol model: [trials] [--mutation ...] runs the model (with those
    mutations) and prints PASS or the failure; --self-test requires the protocol to PASS and every
    mutation to FAIL. check_all(trials, mut, quiet) returns whether every trial passed."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    trials = int(args[0]) if args else default_trials
    flags = [a[2:].replace("-", "_") for a in sys.argv[1:] if a.startswith("--")]
    if "self_test" in flags:
        ok = check_all(trials, {})
        print("protocol (%d trials x %s): %s" % (trials, describe, "PASS" if ok else "FAIL"))
        for m in mutations:
            caught = not check_all(trials, {m: True}, quiet=True)
            print("mutation %-20s %s" % (m, "caught (FAIL), as it must" if caught else "NOT CAUGHT"))
            ok = ok and caught
        return 0 if ok else 1
    mut = {m: True for m in flags}
    unknown = set(mut) - set(mutations)
    if unknown:
        print("unknown option(s): %s" % ", ".join(sorted(unknown)))
        return 2
    if not check_all(trials, mut):
        return 1
    print("PASS: %d trials x %s%s" %
          (trials, describe, (" with mutations " + ",".join(mut)) if mut else ""))
    return 0
