"""Streamed samples through the buffer's socket-free core: SampleResults checked at the edge like results, the exit
rule cutting a round (and the Abort broadcast for it), abort reports counted as waste, foreign and late parts,
and producers' sample budgets (WorkRequest.max_samples)."""

import numpy as np

from pipeline import protocol as P
from pipeline.buffer.core import BufferCore
from pipeline.config import load_config

TRAIN = [(f"{i}+{i}=", str(2 * i)) for i in range(50)]
PROMPT = np.arange(1, 4, dtype=np.int32)


def make(tmp_path, *overrides):
    cfg = load_config(None, ["--run.dir", str(tmp_path), "--learner.batch_prompts", "4", "--learner.mini_batches",
                             "1", "--learner.eval_every", "0", "--sampling.max_new_tokens", "16", *overrides])
    return BufferCore(cfg, TRAIN, [], now=0.0)


def sample(reward, n=3):
    return P.Sample(np.arange(1, n + 1, dtype=np.int32), np.full(n, -0.5, np.float32), float(reward), 0, "stop")


def work(core, now, producer="p0", rounds=8, samples=0):
    outs = core.handle(producer.encode(), P.WorkRequest(producer, rounds, 0, samples), now)
    return [o.msg for o in outs if isinstance(o.msg, P.Assignments)][0].rounds


def part(a, indices, rewards, prompt=PROMPT, aborted=(0, 0)):
    return P.RoundSamples(a.round_id, a.prompt_id, prompt, list(indices), [sample(r) for r in rewards], *aborted)


def send(core, parts, now, producer="p0"):
    return core.handle(producer.encode(), P.SampleResults(producer, parts), now)


def test_streamed_samples_exit_early_and_abort_the_rest_of_the_round(tmp_path):
    core = make(tmp_path)
    (a, *_) = rounds = work(core, 0.0)
    assert all(r.stream and r.num_samples == 8 for r in rounds)  # exit_check "prefix": samples are streamed
    assert send(core, [part(a, [1, 0], [0, 1])], 0.1) == []
    outs = send(core, [P.RoundSamples(a.round_id, a.prompt_id, P.empty_array("int32"), [3, 2], [sample(1),
                                                                                           sample(0)])], 0.2)
    assert [(o.to, o.msg) for o in outs] == [(None, P.Abort([a.round_id], "prompt exited"))]
    m = core.scheduler.metrics()
    assert m["released"] == 1 and m["rounds_cut"] == 1 and m["samples_cut"] == 4 and m["samples_received"] == 4
    assert a.round_id not in core.leases  # the round is over: its lease too
    # what the producer then reports of the cut samples is counted as waste; a straggler is late
    assert send(core, [part(a, [5], [1], aborted=(3, 21))], 0.3) == []
    m = core.scheduler.metrics()
    assert (m["samples_aborted"], m["tokens_aborted"], m["samples_late"]) == (3, 21, 1)
    assert m["results_ignored"]["late"] == 1


def test_streamed_parts_are_checked_at_the_edge_and_tied_to_their_holder(tmp_path):
    core = make(tmp_path)
    a, b, *_ = work(core, 0.0)
    send(core, [part(a, [0], [1])], 0.1, producer="intruder")  # not its round: counted, never applied
    assert core.counters["results_foreign"] == 1 and core.scheduler.metrics()["samples_received"] == 0
    # a first part without its prompt tokens cannot be checked: rejected, the round re-issued
    send(core, [P.RoundSamples(b.round_id, b.prompt_id, P.empty_array("int32"), [0], [sample(1)])], 0.2)
    assert core.counters["rejected_values"] == 1 and b.round_id not in core.leases
    long = P.RoundSamples(a.round_id, a.prompt_id, PROMPT, [0], [sample(1, n=17)])  # > max_new_tokens
    send(core, [long], 0.3)
    assert core.counters["rejected_values"] == 2
    bad = P.SampleResults("p0", [P.RoundSamples(1, 1, PROMPT, [0, 0], [sample(1), sample(0)])])
    assert core.handle(b"p0", bad, 0.4) == [] and core.counters["invalid"] == 1  # duplicate index in a part
    assert core.scheduler.metrics()["rounds_reissued"] == 2


def test_producers_ask_in_samples(tmp_path):
    core = make(tmp_path, "--sampling.round_size", "4")
    assert [r.num_samples for r in work(core, 0.0, samples=9)] == [4, 4]  # a third round would not fit
    assert len(work(core, 0.1, producer="p1", samples=1)) == 1  # the first round is given whatever its size
    outs = core.handle(b"p2", P.WorkRequest("p2", 2, 0, -1), 0.2)
    assert outs == [] and core.counters["invalid"] == 1
    whole = core.handle(b"p3", P.WorkRequest("p3", 8, 0), 0.3)
    # an older producer asks in rounds only: its fair share of the admission bound, ceil(8 / 3 producers)
    assert len([o for o in whole if isinstance(o.msg, P.Assignments)][0].msg.rounds) == 3
