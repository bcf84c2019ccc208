"""Producer tests: the worker's logic against a scripted engine and client (fast), then the real thing (slow):
one in-process vLLM engine for engine-level checks and one producer process behind a scripted buffer."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline import protocol as P
from pipeline.config import EngineConfig, SamplingConfig, load_config
from pipeline.producer.engine import RoundAborted, _sampled_logprobs, engine_kwargs, round_seed
from pipeline.producer.worker import Producer
from pipeline.testing.doubles import FakeClient, FakeEngine, FakePool, ProducerBuffer, until
from pipeline.testing.models import save_sharpened_tiny
from pipeline.weights.uris import file_uri_problem, local_path

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- fast: pure helpers


def test_round_seed_is_reproducible_and_spread():
    assert round_seed(0, 5) == round_seed(0, 5)
    seeds = {round_seed(0, r) for r in range(1000)} | {round_seed(1, r) for r in range(1000)}
    assert len(seeds) == 2000 and all(0 <= s < 2**31 - 4096 for s in seeds)


def test_weights_path():
    assert local_path("/dev/shm/w/v3.safetensors") == "/dev/shm/w/v3.safetensors"
    assert local_path("file:///dev/shm/v3.safetensors") == "/dev/shm/v3.safetensors"
    assert "local safetensors" in file_uri_problem("tcp://10.0.0.1:5557", "/dev/shm/w")


class _Flat:
    """The fields of vllm.logprobs.FlatLogprobs that the engine reads (importing vLLM takes seconds)."""

    def __init__(self, positions):
        self.start_indices, self.token_ids, self.logprobs = [], [], []
        for pos in positions:
            self.start_indices.append(len(self.token_ids))
            self.token_ids += list(pos)
            self.logprobs += list(pos.values())

    def __len__(self):
        return len(self.start_indices)


class _Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


def test_sampled_logprobs_flat_and_dict():
    flat = _Flat([{7: -0.5}, {3: -1.25, 9: -0.1}])  # per position: the sampled token first, then top-k ones
    np.testing.assert_array_equal(_sampled_logprobs(flat, np.array([7, 3], np.int32)),
                                  np.array([-0.5, -1.25], np.float32))
    assert _sampled_logprobs(_Flat([]), np.zeros(0, np.int32)).dtype == np.float32
    dicts = [{7: _Logprob(-0.5)}, {3: _Logprob(-1.25), 9: _Logprob(-0.1)}]
    np.testing.assert_array_equal(_sampled_logprobs(dicts, np.array([7, 3], np.int32)), [-0.5, -1.25])
    with pytest.raises(RuntimeError, match="not the sampled token"):
        _sampled_logprobs(flat, np.array([7, 9], np.int32))
    with pytest.raises(RuntimeError, match="positions"):
        _sampled_logprobs(flat, np.array([7], np.int32))


def test_engine_kwargs(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 128}')
    kw = engine_kwargs(str(tmp_path), "bfloat16", EngineConfig(extra={"enable_prefix_caching": False}), 3)
    assert kw["max_model_len"] == 128  # clamped to the model's
    assert kw["dtype"] == "bfloat16" and kw["seed"] == 3 and kw["enable_prefix_caching"] is False
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["worker_extension_cls"] == "pipeline.producer.worker_ext.WeightReloadExtension"
    assert engine_kwargs(str(tmp_path), "float32", EngineConfig(dtype="float16"), 0)["dtype"] == "float16"
    (tmp_path / "config.json").write_text(
        '{"max_position_embeddings": 128, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}')
    assert engine_kwargs(str(tmp_path), "float32", EngineConfig(), 0)["max_model_len"] == 4096  # vLLM decides


def test_a_one_rank_cpu_engine_runs_in_process_with_the_cores_a_worker_would_have(monkeypatch):
    from pipeline.producer.engine import UNIPROC_EXECUTOR, configure_cpu_env

    cpu = engine_kwargs("m", "float32", EngineConfig(), 0, cpu=True)
    assert cpu["distributed_executor_backend"] == UNIPROC_EXECUTOR
    assert "distributed_executor_backend" not in engine_kwargs("m", "float32", EngineConfig(), 0)  # GPUs: vLLM's
    assert "distributed_executor_backend" not in engine_kwargs("m", "float32", EngineConfig(tensor_parallel_size=2),
                                                               0, cpu=True)
    mp = EngineConfig(extra={"distributed_executor_backend": "mp"})
    assert engine_kwargs("m", "float32", mp, 0, cpu=True)["distributed_executor_backend"] == "mp"  # extra wins
    for key in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    configure_cpu_env(EngineConfig())
    assert os.environ["OMP_NUM_THREADS"] == "3"  # one core left to the engine core's loop, as vLLM's worker has
    configure_cpu_env(EngineConfig(cpu_threads=2))
    assert os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's own setting stays
    configure_cpu_env(EngineConfig())
    assert os.environ["OMP_NUM_THREADS"] == "5"


@pytest.mark.parametrize("argv, message", [
    (["--connect", "127.0.0.1:5555", "--sampling.round_sise", "4"], "did you mean"),
    (["--connect", "nohost", "--model", "/x"], "HOST:PORT"),
    (["--connect", "127.0.0.1:5555", "--model", "/does/not/exist"], "config.json"),
])
def test_main_rejects_bad_arguments(argv, message, capsys):
    from pipeline.producer.main import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- fast: the worker against fakes


def _assign(rid, answer="7", n=2, prompt="1+6="):
    return P.RoundAssignment(rid, rid * 10, prompt, answer, n, 60.0)


def _producer(engine, client, **kw):
    cfg = load_config(None, ["--producers.max_rounds", "3", "--weights.dir", "/dev/shm/w"])
    return Producer(cfg, client, engine, FakePool(), "p0", heartbeat_s=0.05, **kw)


def test_worker_requests_generates_scores_and_stops():
    async def scenario():
        engine, client = FakeEngine(), FakeClient()
        prod = _producer(engine, client)
        task = asyncio.create_task(prod.run())
        await until(lambda: client.of(P.WorkRequest))
        req = client.of(P.WorkRequest)[0]
        assert (req.producer_id, req.max_rounds, req.version) == ("p0", 3, 0)  # min(free 4, max_rounds 3)
        assert req.max_samples == 4
        eval_round = P.RoundAssignment(2, 20, "2+2", "4", 2, 60.0, "eval", extras={"tests": ["assert 1"]})
        await client.replies.put(P.Assignments([_assign(1), eval_round], 0))
        await until(lambda: len(client.of(P.RoundResult)) == 2)
        res = {r.round_id: r for r in client.of(P.RoundResult)}
        assert [s.reward for s in res[1].samples] == [1.0, 0.0] and res[2].prompt_id == 20
        assert (res[1].kind, res[2].kind) == ("train", "eval")  # the kind is echoed
        # every sample is scored with its round's extras (data.extra_keys: reward.fn's keyword arguments)
        assert sorted(map(str, prod.scorer.extras)) == ["{'tests': ['assert 1']}"] * 2 + ["{}"] * 2
        assert all(s.version == 0 and s.token_ids.dtype == np.int32 for s in res[1].samples)
        # at most one request outstanding: nothing new was asked before the reply; the next one counts the
        # two rounds started by the reply (4 slots - 2)
        assert len(client.of(P.WorkRequest)) == 2 and client.of(P.WorkRequest)[1].max_rounds == 2
        await until(lambda: any(h.stats["rounds_done"] == 2 for h in client.of(P.Heartbeat)))
        assert "reward_errors" in client.of(P.Heartbeat)[-1].stats  # the reward pool's failure counters
        await client.control.put(P.Shutdown("done"))
        assert await asyncio.wait_for(task, 5) == 0

    asyncio.run(scenario())


def test_worker_abort_sends_nothing_even_when_it_overtakes_the_assignment():
    async def scenario():
        engine, client = FakeEngine(delay_s=5.0), FakeClient()
        prod = _producer(engine, client)
        task = asyncio.create_task(prod.run())
        await until(lambda: client.of(P.WorkRequest))
        await client.control.put(P.Abort([2], "exited"))  # before round 2 is even assigned
        await asyncio.sleep(0.05)
        await client.replies.put(P.Assignments([_assign(1), _assign(2)], 0))
        await until(lambda: 1 in engine.running)
        await client.control.put(P.Abort([1], "stale"))
        await until(lambda: prod.counts["rounds_aborted"] == 2)
        prod.stop("test", grace_s=0.0)
        assert await asyncio.wait_for(task, 5) == 0
        assert not client.of(P.RoundResult)

    asyncio.run(scenario())


def test_worker_resends_an_unanswered_request_and_loads_announced_weights_first():
    async def scenario():
        engine, client = FakeEngine(), FakeClient()
        prod = _producer(engine, client, request_timeout_s=0.2)
        task = asyncio.create_task(prod.run())
        await until(lambda: len(client.of(P.WorkRequest)) >= 2)  # the first got no reply: asked again
        weights = P.WeightAnnouncement(3, "file:///dev/shm/w/v000003.safetensors", 10)
        await client.replies.put(P.Assignments([_assign(1)], 3, weights))
        await until(lambda: client.of(P.RoundResult))
        assert engine.loads == [("/dev/shm/w/v000003.safetensors", 3)]
        assert all(s.version == 3 for s in client.of(P.RoundResult)[0].samples)
        await until(lambda: client.of(P.WorkRequest)[-1].version == 3)
        # an older or equal announcement on the control channel is ignored
        await client.control.put(P.VersionUpdate(3, weights))
        await client.control.put(P.VersionUpdate(5, P.WeightAnnouncement(5, "/dev/shm/w/v000005.safetensors", 10)))
        await until(lambda: engine.version == 5)
        assert engine.loads[1:] == [("/dev/shm/w/v000005.safetensors", 5)]
        prod.stop("test")
        assert await asyncio.wait_for(task, 5) == 0
        beat = client.of(P.Heartbeat)[-1]
        assert beat.version == 5 and beat.stats["weight_loads"] == 2 and beat.stats["request_timeouts"] >= 1

    asyncio.run(scenario())


def test_worker_grace_lets_running_rounds_finish():
    async def scenario():
        engine, client = FakeEngine(delay_s=0.3), FakeClient()
        prod = _producer(engine, client, grace_s=5.0)
        task = asyncio.create_task(prod.run())
        await until(lambda: client.of(P.WorkRequest))
        await client.replies.put(P.Assignments([_assign(1)], 0))
        await until(lambda: engine.running)
        prod.stop("SIGTERM")
        assert await asyncio.wait_for(task, 5) == 0
        assert [r.round_id for r in client.of(P.RoundResult)] == [1]

    asyncio.run(scenario())


def test_worker_reports_a_rejected_prompt_and_exits_1_when_the_engine_dies():
    class BrokenEngine(FakeEngine):
        async def generate_round(self, a, on_sample=None):
            if a.prompt == "too long":
                raise ValueError("vLLM rejected it")
            self.is_dead = True
            raise RuntimeError("EngineDeadError")

    async def scenario():
        engine, client = BrokenEngine(), FakeClient()
        prod = _producer(engine, client)
        task = asyncio.create_task(prod.run())
        await until(lambda: client.of(P.WorkRequest))
        await client.replies.put(P.Assignments([_assign(1, prompt="too long")], 0))
        await until(lambda: client.of(P.RoundResult))
        assert client.of(P.RoundResult)[0].samples == [] and not task.done()
        await client.replies.put(P.Assignments([_assign(2)], 0))
        assert await asyncio.wait_for(task, 5) == 1
        assert client.of(P.Heartbeat)[-1].stats["engine_errors"] == 1

    asyncio.run(scenario())


def test_worker_streams_samples_as_they_finish_batched_per_flush():
    async def scenario():
        engine, client = FakeEngine(delay_s=0.2), FakeClient()
        prod = _producer(engine, client)
        task = asyncio.create_task(prod.run())
        await until(lambda: client.of(P.WorkRequest))
        streamed = P.RoundAssignment(1, 10, "1+6=", "7", 4, 60.0, stream=True)
        await client.replies.put(P.Assignments([streamed, _assign(2)], 0))
        await until(lambda: sum(len(p.samples) for m in client.of(P.SampleResults) for p in m.rounds) == 4)
        parts = [p for m in client.of(P.SampleResults) for p in m.rounds]
        assert len(client.of(P.SampleResults)) >= 2  # sent as they finished, not at the end
        assert all(p.round_id == 1 and p.prompt_id == 10 and p.num_aborted == 0 for p in parts)
        assert all(p.prompt_token_ids.tolist() == [1, 5] for p in parts)  # each part can be checked on its own
        assert [i for p in parts for i in p.indices] == [0, 1, 2, 3]
        assert [s.reward for p in parts for s in p.samples] == [1.0, 0.0, 0.0, 0.0]
        await until(lambda: client.of(P.RoundResult))
        assert [r.round_id for r in client.of(P.RoundResult)] == [2]  # a round that does not stream: whole
        await until(lambda: any(h.stats["rounds_done"] == 2 for h in client.of(P.Heartbeat)))
        prod.stop("test")
        assert await asyncio.wait_for(task, 5) == 0

    asyncio.run(scenario())


def test_worker_reports_what_an_abort_cut_of_a_streamed_round():
    async def scenario():
        engine, client = FakeEngine(delay_s=0.4), FakeClient()
        prod = _producer(engine, client)
        task = asyncio.create_task(prod.run())
        await until(lambda: client.of(P.WorkRequest))
        await client.replies.put(P.Assignments([P.RoundAssignment(1, 10, "1+6=", "7", 4, 60.0, stream=True)], 0))
        await until(lambda: client.of(P.SampleResults))  # sample 0 is out
        await client.control.put(P.Abort([1], "prompt exited"))
        await until(lambda: prod.counts["rounds_aborted"] == 1)
        await until(lambda: any(p.num_aborted for m in client.of(P.SampleResults) for p in m.rounds))
        parts = [p for m in client.of(P.SampleResults) for p in m.rounds]
        sent = [i for p in parts for i in p.indices]
        cut = sum(p.num_aborted for p in parts)
        assert sent[0] == 0 and len(sent) + cut == 4 and cut >= 2  # every sample sent once or counted as cut
        assert sum(p.aborted_tokens for p in parts) == sum(k + 1 for k in range(4) if k not in sent)
        prod.stop("test")
        assert await asyncio.wait_for(task, 5) == 0

    asyncio.run(scenario())


# ---------------------------------------------------------------- slow: real vLLM on tiny random Llamas

SHARPEN = 10.0  # lm_head x10: peaked but not degenerate distributions (top-1 ~0.4), clear greedy choices
PROMPT = "12+34="
PROMPT_IDS = [1, 21, 22, 15, 23, 24, 33]  # <s> + one token per character


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas of the same shape with different weights (seeds 0 and 1), and their HF twins."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("models")
    paths = [save_sharpened_tiny(root / f"m{seed}", seed, SHARPEN) for seed in (0, 1)]
    for p in paths:  # engines load weights only from private folders (pipeline/weights/private.py)
        p.chmod(0o700)
    hf = [AutoModelForCausalLM.from_pretrained(p, dtype="float32").eval() for p in paths]
    return paths, hf, AutoTokenizer.from_pretrained(paths[0])


def _hf_logprobs(model, prompt_ids, token_ids, temperature):
    import torch

    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float() / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(token_ids, dtype=torch.long)[:, None])[:, 0]
    return lp.numpy()


def _hf_greedy(model, prompt_ids, max_new):
    import torch

    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == 2:  # </s>
                break
    return ids[len(prompt_ids):]


class LoopThread:
    """One asyncio loop in a thread for the whole module: the engine lives on it between tests."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _engine_env() -> dict[str, str]:
    # VLLM_CPU_CI_ENV skips the engine's warm-up pass (a few seconds per start on a small CPU)
    return {"VLLM_CPU_CI_ENV": "1"}


@pytest.fixture(scope="module")
def producer_proc(models):
    """A producer process (`python -m pipeline.producer.main`) connected to a scripted buffer."""
    buf = ProducerBuffer()
    log = open(models[0][0].parent / "producer.log", "w")
    cmd = [sys.executable, "-m", "pipeline.producer.main", "--connect", f"127.0.0.1:{buf.port}",
           "--control-port", str(buf.control_port), "--id", "p-test", "--model", str(models[0][0]),
           "--sampling.round_size", "4", "--sampling.max_new_tokens", "48", "--sampling.temperature", "1.0",
           "--producers.engine.max_num_seqs", "16", "--producers.engine.enforce_eager", "true",
           "--producers.reward_workers", "1", "--run.seed", "3", "--grace", "20",
           "--weights.dir", str(models[0][0].parent / "weights")]  # the only place it loads weight files from
    # its own process group, so teardown can also reach the vLLM processes a killed producer would orphan
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **_engine_env(), "PYTHONPATH": str(REPO)})
    yield proc, buf
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group
    except ProcessLookupError:
        pass
    proc.wait(10)
    buf.close()
    log.close()


@pytest.fixture(scope="module")
def engine(models):
    """One in-process engine on model 0 for the module. It does not ask for `producer_proc`: booting the producer
    meanwhile saves wall time only on an idle machine, and `make test`'s workers may split this module, when the
    worker running only engine tests would boot (~30 s of CPU) and kill a producer it never uses."""
    from pipeline.producer.engine import Engine

    old = {k: os.environ.get(k) for k in _engine_env()}
    os.environ.update(_engine_env())
    lt = LoopThread()
    eng = lt.run(Engine.start(models[0][0], "float32", EngineConfig(max_num_seqs=16, enforce_eager=True),
                              SamplingConfig(round_size=4, max_new_tokens=32), seed=0))
    yield lt, eng
    lt.run(eng.shutdown())
    lt.close()
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _sampling(**kw) -> SamplingConfig:
    return SamplingConfig(**{"round_size": 4, "max_new_tokens": 32, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_engine_logprobs_match_transformers(engine, models, temperature):
    lt, eng = engine
    eng.sampling_cfg = _sampling(temperature=temperature)
    out = lt.run(eng.generate_round(P.RoundAssignment(100 + int(temperature * 10), 0, PROMPT, "46", 4, 60.0)))
    assert out.prompt_token_ids.tolist() == PROMPT_IDS
    for c in out.completions:
        assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
        assert len(c.token_ids) == len(c.logprobs) > 0 and c.version == eng.version
        ref = _hf_logprobs(models[1][0], PROMPT_IDS, c.token_ids.tolist(), temperature)
        assert np.abs(ref - c.logprobs).max() <= 1e-3


@pytest.mark.slow
def test_the_engine_core_runs_the_model_itself(engine):
    """No worker process beside the engine core (engine_kwargs' in-process executor on the CPU)."""
    import psutil

    def named(procs, part):  # by name only: another test's zombie child has no command line to read
        found = []
        for p in procs:
            try:
                if part in p.name():
                    found.append(p)
            except psutil.Error:
                pass
        return found

    cores = named(psutil.Process().children(), "EngineCor")  # the name is cut to 15 characters
    assert len(cores) == 1, named(psutil.Process().children(), "")
    assert named(cores[0].children(recursive=True), "Worker") == []


@pytest.mark.slow
def test_engine_honours_a_rounds_own_max_new_tokens(engine):
    lt, eng = engine
    eng.sampling_cfg = _sampling(max_new_tokens=32)
    short = lt.run(eng.generate_round(P.RoundAssignment(150, 0, PROMPT, "46", 4, 60.0, "eval", 2)))
    assert all(len(c.token_ids) <= 2 for c in short.completions)
    assert any(c.finish_reason == "length" for c in short.completions)


@pytest.mark.slow
def test_engine_abort_stops_the_round_early(engine, monkeypatch):
    lt, eng = engine
    eng.sampling_cfg = _sampling(max_new_tokens=120)
    make_params = eng._sampling_params

    def no_eos(*args):  # every sample runs to max_new_tokens unless aborted
        params = make_params(*args)
        params.ignore_eos = True
        return params

    monkeypatch.setattr(eng, "_sampling_params", no_eos)
    full = eng.free_samples()
    assert full == 16 + 4  # max_num_seqs 16, plus a queue of max(round size 4, 16 / 4) sequences

    async def scenario():
        start = time.monotonic()
        task = asyncio.create_task(eng.generate_round(P.RoundAssignment(200, 0, "1", "1", 4, 60.0)))
        await asyncio.sleep(0.05)
        assert eng.free_samples() == full - 4 and eng.live_samples == 4
        assert await eng.abort(200) and not await eng.abort(999)
        with pytest.raises(RoundAborted) as cut:
            await task
        aborted_after = time.monotonic() - start
        assert cut.value.num_aborted == 4 and 0 <= cut.value.aborted_tokens < 4 * 120  # what the abort wasted
        assert eng.live_samples == 0 and eng.free_samples() == full
        assert eng.llm.get_num_unfinished_requests() == 0
        # the same round run to the end takes longer than the aborted one did
        start = time.monotonic()
        streamed = []  # each sample handed over as it finishes, before the round returns
        out = await eng.generate_round(P.RoundAssignment(201, 0, "1", "1", 4, 60.0),
                                       lambda i, c, prompt: streamed.append((i, c.token_ids.tolist(), prompt)))
        return aborted_after, time.monotonic() - start, out, streamed

    aborted_after, full_s, out, streamed = lt.run(scenario())
    assert all(len(c.token_ids) == 120 for c in out.completions)
    assert aborted_after < full_s / 2
    assert sorted(i for i, _, _ in streamed) == [0, 1, 2, 3]
    assert all(ids == out.completions[i].token_ids.tolist() and np.array_equal(prompt, out.prompt_token_ids)
               for i, ids, prompt in streamed)


@pytest.mark.slow
def test_engine_rejects_a_prompt_longer_than_the_model_and_goes_on(engine):
    lt, eng = engine
    eng.sampling_cfg = _sampling()
    with pytest.raises(ValueError, match="rejected"):
        lt.run(eng.generate_round(P.RoundAssignment(400, 0, "1" * 300, "1", 4, 60.0)))
    assert not eng.is_dead and eng.live_samples == 0
    assert len(lt.run(eng.generate_round(P.RoundAssignment(401, 0, PROMPT, "46", 4, 60.0))).completions) == 4


@pytest.mark.slow
def test_engine_loads_weights_in_place(engine, models, tmp_path):
    lt, eng = engine
    (m0, m1), (hf0, hf1), _ = models
    eng.sampling_cfg = _sampling(temperature=1e-3, max_new_tokens=24)  # greedy in all but name
    greedy0, greedy1 = _hf_greedy(hf0, PROMPT_IDS, 24), _hf_greedy(hf1, PROMPT_IDS, 24)
    assert greedy0 != greedy1
    a = P.RoundAssignment(300, 0, PROMPT, "46", 2, 60.0)

    async def scenario():
        before = await eng.generate_round(a)  # also fills the prefix cache with model-0 KV of PROMPT
        v0 = eng.version
        eng.sampling_cfg = _sampling(temperature=1e-3, max_new_tokens=96)
        in_flight = asyncio.create_task(eng.generate_round(P.RoundAssignment(301, 0, "7", "7", 4, 60.0)))
        await asyncio.sleep(0.05)
        assert not in_flight.done()
        seconds = await eng.load_weights(m1 / "model.safetensors", v0 + 1)
        eng.sampling_cfg = _sampling(temperature=1e-3, max_new_tokens=24)
        after = await eng.generate_round(P.RoundAssignment(302, 0, PROMPT, "46", 2, 60.0))
        spanning = await in_flight
        await eng.load_weights(m0 / "model.safetensors", v0 + 2)  # back to model 0 for the other tests
        back = await eng.generate_round(P.RoundAssignment(303, 0, PROMPT, "46", 2, 60.0))
        return v0, seconds, before, after, spanning, back

    v0, seconds, before, after, spanning, back = lt.run(scenario())
    assert seconds < 5.0
    assert all(c.token_ids.tolist() == greedy0 and c.version == v0 for c in before.completions)
    # the new weights generate, and the cached KV of the old weights was not reused for the same prompt
    assert all(c.token_ids.tolist() == greedy1 and c.version == v0 + 1 for c in after.completions)
    # a sample whose tokens span the update carries the version it was submitted under
    assert all(c.version == v0 for c in spanning.completions)
    assert all(c.token_ids.tolist() == greedy0 and c.version == v0 + 2 for c in back.completions)
    assert eng.version == v0 + 2


@pytest.mark.slow
def test_producer_process_end_to_end(producer_proc, models):
    from pipeline.rewards import math_reward

    proc, buf = producer_proc
    (m0, m1), (hf0, hf1), tok = models
    buf.wait(lambda: buf.requests or proc.poll() is not None, 300, "the producer's first WorkRequest")
    assert proc.poll() is None, "the producer process exited during start-up"
    first = buf.requests[0]
    # capacity in samples: 16 sequences plus a queue of max(4, 16 / 4); as many rounds (each has >= 1 sample)
    assert (first.producer_id, first.max_rounds, first.max_samples, first.version) == ("p-test", 20, 20, 0)

    # two rounds; round 2 is aborted at once and must never come back
    buf.todo = [P.RoundAssignment(1, 10, PROMPT, "46", 4, 60.0), P.RoundAssignment(2, 20, "9", "9", 4, 60.0)]
    buf.wait(lambda: not buf.todo, 30, "the assignments to go out")
    buf.publish(P.Abort([2], "test"))
    buf.wait(lambda: 1 in buf.results, 60, "round 1's result")
    buf.wait(lambda: buf.beats and buf.beats[-1].stats["rounds_aborted"] >= 1, 10, "the abort to register")
    buf.pump(0.5)
    assert 2 not in buf.results

    (res,) = buf.results[1]
    assert res.prompt_id == 10 and res.prompt_token_ids.tolist() == PROMPT_IDS and len(res.samples) == 4
    assert res.gen_seconds > 0
    for s in res.samples:
        assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
        assert len(s.token_ids) == len(s.logprobs) > 0 and s.version == 0
        assert s.finish_reason in ("stop", "length")
        text = tok.decode(s.token_ids.tolist(), skip_special_tokens=True)
        assert s.reward in (0.0, 1.0) and s.reward == math_reward(text, "46")
        ref = _hf_logprobs(hf0, PROMPT_IDS, s.token_ids.tolist(), 1.0)
        assert np.abs(ref - s.logprobs).max() <= 1e-3

    # the same round id again draws the same samples (seed = f(run seed, round id))
    buf.todo = [P.RoundAssignment(1, 10, PROMPT, "46", 4, 60.0)]
    buf.wait(lambda: len(buf.results[1]) == 2, 60, "round 1 again")
    assert [s.token_ids.tolist() for s in buf.results[1][1].samples] == [s.token_ids.tolist() for s in res.samples]

    # new weights: later rounds carry version 1 and their log-probs are those of model 1
    weights = m1.parent / "weights" / "v000001.safetensors"
    weights.parent.mkdir(mode=0o700, exist_ok=True)
    shutil.copy(m1 / "model.safetensors", weights)
    buf.publish(P.VersionUpdate(1, P.WeightAnnouncement(1, str(weights), weights.stat().st_size)))
    buf.wait(lambda: buf.beats and buf.beats[-1].version == 1, 30, "the weights to load")
    assert buf.beats[-1].stats["last_weight_load_s"] > 0 and buf.requests[-1].version in (0, 1)
    buf.todo = [P.RoundAssignment(3, 30, PROMPT, "46", 4, 60.0)]
    buf.wait(lambda: 3 in buf.results, 60, "round 3's result")
    for s in buf.results[3][0].samples:
        assert s.version == 1
        ids = s.token_ids.tolist()
        assert np.abs(_hf_logprobs(hf1, PROMPT_IDS, ids, 1.0) - s.logprobs).max() <= 1e-3
        assert np.abs(_hf_logprobs(hf0, PROMPT_IDS, ids, 1.0) - s.logprobs).max() > 0.05

    buf.wait(lambda: buf.beats[-1].stats["rounds_done"] >= 3, 10, "a heartbeat counting round 3")
    beat = buf.beats[-1]
    assert beat.role == "producer" and beat.stats["weight_version"] == 1 and beat.stats["tokens_done"] > 0
    assert {"tokens_per_s", "busy_fraction", "running_rounds"} <= set(beat.stats)

    # a prompt vLLM cannot take (longer than max_model_len) comes back as a round without samples
    buf.todo = [P.RoundAssignment(5, 50, "1" * 300, "1", 4, 60.0)]
    buf.wait(lambda: 5 in buf.results, 30, "round 5's result")
    assert buf.results[5][0].samples == [] and proc.poll() is None

    # SIGTERM with a round running: it finishes within the grace period, is sent, and the process exits 0
    buf.todo = [P.RoundAssignment(4, 40, PROMPT, "46", 4, 60.0)]
    buf.wait(lambda: not buf.todo, 30, "round 4 to go out")
    proc.send_signal(signal.SIGTERM)
    buf.wait(lambda: proc.poll() is not None, 60, "the producer to exit")
    buf.pump(0.5)
    assert proc.returncode == 0
    assert 4 in buf.results


def test_worker_timeline_records_requests_assignments_and_weight_loads():
    """`producer --timeline`: what bench.pipeline's timeline reads (wall-clock spans, an assignment from its rounds'
    start to the last one's end)."""
    async def scenario():
        engine, client = FakeEngine(delay_s=0.1), FakeClient()
        prod = _producer(engine, client, timeline=True)
        task = asyncio.create_task(prod.run())
        await until(lambda: client.of(P.WorkRequest))
        weights = P.WeightAnnouncement(3, "file:///dev/shm/w/v000003.safetensors", 10)
        await client.replies.put(P.Assignments([_assign(1), _assign(2)], 3, weights))
        await until(lambda: len(client.of(P.RoundResult)) == 2)
        prod.stop("test", grace_s=0.0)
        assert await asyncio.wait_for(task, 5) == 0
        return prod.timeline

    events = asyncio.run(scenario())
    kinds = [e["kind"] for e in events]
    assert kinds[:3] == ["request", "weights", "generate"], kinds
    req, load, gen = events[:3]
    assert req["rounds"] == 2 and load["version"] == 3 and req["start"] <= load["start"] <= load["end"]
    assert gen["rounds"] == 2 and gen["version"] == 3 and gen["end"] - gen["start"] >= 0.1  # both rounds ran
    assert _producer(FakeEngine(), FakeClient()).timeline is None  # off unless asked for
