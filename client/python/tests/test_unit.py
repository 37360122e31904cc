#!/usr/bin/env python3
"""Unit tests of odyssey_client's pure parts, without an odyssey server: Datum building and
shifting, request conversion, and the Session's sequence stamping / ordering / error mapping
against a fake TrainingService served in-process by grpcio.

Run: python client/python/tests/test_unit.py  (generates the stubs into a scratch copy of the
package when odyssey_client is not importable; --installed uses whatever `import` finds)."""
import atexit
import concurrent.futures
import os
import shutil
import sys
import tempfile
import threading
import time
import unittest


def _import_client():
    """Imports odyssey_client: the installed one if any, else a scratch copy of the source tree
    with freshly generated stubs (the stubs are never committed)."""
    if "--installed" not in sys.argv:
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        tmp = tempfile.mkdtemp(prefix="odyssey_client_unit_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        shutil.copytree(os.path.join(src, "odyssey_client"), os.path.join(tmp, "odyssey_client"),
                        ignore=shutil.ignore_patterns("_pb", "__pycache__"))
        sys.path.insert(0, os.path.abspath(src))
        import _build_stubs

        _build_stubs.generate(os.path.join(tmp, "odyssey_client"))
        sys.path.insert(0, tmp)
    else:
        sys.argv.remove("--installed")
    import odyssey_client

    return odyssey_client


oc = _import_client()
import grpc  # noqa: E402

pb, pb_grpc = oc.pb, oc.pb_grpc


class DatumTest(unittest.TestCase):
    def test_from_sequence_shifts_by_one(self):
        d = oc.Datum.from_sequence([10, 11, 12, 13])
        self.assertEqual(d.tokens, [10, 11, 12])
        self.assertEqual(d.target_tokens, [11, 12, 13])
        self.assertIsNone(d.weights)

    def test_from_sequence_needs_two_tokens(self):
        with self.assertRaisesRegex(ValueError, "at least 2"):
            oc.Datum.from_sequence([5])

    def test_from_completion_masks_the_prompt(self):
        d = oc.Datum.from_completion(prompt=[1, 2, 3], completion=[7, 8], sampler_logprobs=[-0.1, -0.2], advantage=0.5)
        # The sequence 1 2 3 7 8 shifted: the last prompt position (3) predicts the first
        # completion token (7); prompt targets (2, 3) carry no weight.
        self.assertEqual(d.tokens, [1, 2, 3, 7])
        self.assertEqual(d.target_tokens, [2, 3, 7, 8])
        self.assertEqual(d.weights, [0.0, 0.0, 1.0, 1.0])
        self.assertEqual(d.sampler_logprobs, [0.0, 0.0, -0.1, -0.2])
        self.assertEqual(d.advantages, [0.0, 0.0, 0.5, 0.5])
        d.validate()

    def test_from_completion_one_token_prompt_and_per_token_advantages(self):
        d = oc.Datum.from_completion([65], [66, 67, 68], advantage=[1.0, -1.0, 0.0])
        self.assertEqual(d.tokens, [65, 66, 67])
        self.assertEqual(d.target_tokens, [66, 67, 68])
        self.assertEqual(d.weights, [1.0, 1.0, 1.0])
        self.assertEqual(d.advantages, [1.0, -1.0, 0.0])
        self.assertIsNone(d.sampler_logprobs)

    def test_from_completion_rejects_mismatched_lengths(self):
        with self.assertRaisesRegex(ValueError, "sampler_logprobs has 1 entries, completion 2"):
            oc.Datum.from_completion([1, 2], [3, 4], sampler_logprobs=[-1.0])
        with self.assertRaisesRegex(ValueError, "advantage has 3 entries, completion 2"):
            oc.Datum.from_completion([1, 2], [3, 4], advantage=[1.0, 2.0, 3.0])
        with self.assertRaisesRegex(ValueError, "prompt is empty"):
            oc.Datum.from_completion([], [3])
        with self.assertRaisesRegex(ValueError, "completion is empty"):
            oc.Datum.from_completion([3], [])

    def test_numpy_inputs(self):
        import numpy as np

        d = oc.Datum.from_completion(np.array([1, 2], dtype=np.int64), np.array([3, 4, 5], dtype=np.int32),
                                     sampler_logprobs=np.array([-1.0, -2.0, -3.0], dtype=np.float32),
                                     advantage=np.float32(2.0))
        p = d.to_proto()
        self.assertEqual(list(p.tokens), [1, 2, 3, 4])
        self.assertEqual(list(p.target_tokens), [2, 3, 4, 5])
        self.assertEqual(list(p.weights), [0.0, 1.0, 1.0, 1.0])
        self.assertEqual(list(p.sampler_logprobs), [0.0, -1.0, -2.0, -3.0])
        self.assertEqual(list(p.advantages), [0.0, 2.0, 2.0, 2.0])
        d2 = oc.Datum(tokens=np.arange(4), target_tokens=np.arange(1, 5), weights=np.ones(4))
        self.assertEqual(list(d2.to_proto().target_tokens), [1, 2, 3, 4])

    def test_non_integer_tokens_are_refused(self):
        with self.assertRaisesRegex(TypeError, r"tokens\[1\] \(2.5\)"):
            oc.Datum(tokens=[1, 2.5], target_tokens=[2, 3]).to_proto()

    def test_absent_arrays_go_out_empty(self):
        p = oc.Datum.from_sequence([1, 2, 3]).to_proto()
        self.assertEqual(len(p.weights), 0)
        self.assertEqual(len(p.sampler_logprobs), 0)
        self.assertEqual(len(p.advantages), 0)
        back = oc.Datum.from_proto(p)
        self.assertEqual(back.tokens, [1, 2])
        self.assertIsNone(back.weights)

    def test_batch_validation_names_the_datum(self):
        good = oc.Datum.from_sequence([1, 2, 3])
        bad = oc.Datum(tokens=[1, 2, 3], target_tokens=[2, 3], weights=[1, 1, 1])
        with self.assertRaisesRegex(ValueError, r"batch\[1\]: target_tokens has 2 entries, tokens 3"):
            oc.batch_to_proto([good, bad])
        with self.assertRaisesRegex(TypeError, "sequence of Datum"):
            oc.batch_to_proto(good)
        # Raw protos pass through untouched (the escape hatch for callers who build them).
        raw = pb.Datum(tokens=[1], target_tokens=[])
        self.assertIs(oc.batch_to_proto([raw])[0], raw)

    def test_loss_and_adam_conversion(self):
        self.assertEqual(oc.Loss.of("ppo").to_proto(), pb.LossConfig(kind="ppo"))
        self.assertEqual(oc.Loss("ppo", 0.1, 0.3).to_proto(), pb.LossConfig(kind="ppo", clip_low=0.1, clip_high=0.3))
        self.assertEqual(oc.AdamW.of(1e-3).to_proto(),
                         pb.AdamWParams(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0))
        self.assertEqual(oc.AdamW.of({"lr": 2e-3, "weight_decay": 0.1}).weight_decay, 0.1)
        with self.assertRaises(TypeError):
            oc.Loss.of(3)


class FakeTraining(pb_grpc.TrainingServiceServicer):
    """Records (sequence, tag, metadata) of every call in arrival order; a call's delay and
    failure come from its batch's first token / adam.lr so tests can shape the traffic."""

    def __init__(self):
        self.lock = threading.Lock()
        self.arrivals = []    # (method, sequence, tag) in arrival order
        self.executed = []    # tags in the order calls ran (arrival order here, no reordering)
        self.metadata = []
        self.stream_open = threading.Event()
        self.stream_closed_at = None

    def _record(self, method, seq, tag, context):
        with self.lock:
            self.arrivals.append((method, seq, tag, time.monotonic()))
            self.metadata.append(dict(context.invocation_metadata()))

    def ForwardBackward(self, request, context):
        tag = request.batch[0].tokens[0] if request.batch and request.batch[0].tokens else -1
        self._record("ForwardBackward", request.sequence, tag, context)
        if tag == 999:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "batch[0].tokens[0] (999) must be in [0, 256)")
        if tag == 998:  # as if the controller restarted under the call
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        # Delay early calls so a naive client's later calls would overtake them.
        time.sleep(0.05 if tag % 2 == 0 else 0.0)
        n = len(request.batch)
        return pb.ForwardBackwardResponse(logprobs=[pb.TokenLogprobs(values=[-1.0] * len(d.tokens)) for d in request.batch],
                                          loss=float(tag), weight_sum=float(n), mismatch_mean=0.01,
                                          mismatch_max=0.02, mismatch_tokens=n, tokens=n)

    def OptimStep(self, request, context):
        self._record("OptimStep", request.sequence, request.adam.lr, context)
        if request.adam.lr == 0.998:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return pb.OptimStepResponse(step=int(request.adam.lr * 1000), grad_norm=1.5, lr=request.adam.lr)

    def Forward(self, request, context):
        self._record("Forward", request.sequence, -2, context)
        return pb.ForwardResponse(logprobs=[pb.TokenLogprobs(values=[-0.5] * len(d.tokens)) for d in request.batch])

    def ExportWeights(self, request, context):
        self._record("ExportWeights", request.sequence, request.directory, context)
        return pb.ExportWeightsResponse(directory=request.directory)

    def Sample(self, request, context):
        self._record("Sample", request.sequence, request.params.max_tokens, context)
        n = request.num_samples
        return pb.SampleResponse(sequences=[pb.SampledSequence(prompt_index=i, tokens=list(p.tokens[-1:]) * request.params.max_tokens,
                                                               logprobs=[-0.25] * request.params.max_tokens,
                                                               stop_reason="length")
                                            for i, p in enumerate(request.prompts) for _ in range(n)],
                                 seed=request.params.seed if request.params.HasField("seed") else 42)

    def PushRollouts(self, request_iterator, context):
        self.stream_open.set()
        for i, r in enumerate(request_iterator):
            self._record("PushRollouts", 0, i, context)
            time.sleep(0.1)  # long enough that a call sent meanwhile would arrive before the end
            yield pb.RolloutResult(forward_backward=pb.ForwardBackwardResponse(loss=float(i)),
                                   optim_step=pb.OptimStepResponse(step=i + 1, lr=r.adam.lr))
        with self.lock:
            self.stream_closed_at = time.monotonic()


class FakeJobs(pb_grpc.JobServiceServicer):
    """Jobs whose GetJob walks through a scripted list of states."""

    def __init__(self):
        self.created = []
        self.script = {}
        self.unavailable = 0  # CreateJob calls to refuse UNAVAILABLE first
        self.attempts = []    # request ids of every CreateJob attempt
        self.get_unavailable = 0  # GetJob calls to refuse UNAVAILABLE first
        self.get_attempts = 0

    def CreateJob(self, request, context):
        if self.unavailable > 0:  # as if the controller were restarting
            self.unavailable -= 1
            self.attempts.append(request.request_id)
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        self.attempts.append(request.request_id)
        self.created.append(request)
        name = f"jobs/{len(self.created)}"
        return pb.Job(name=name, spec=request.spec, state=pb.Job.PENDING)

    def GetJob(self, request, context):
        self.get_attempts += 1
        if self.get_unavailable > 0:
            self.get_unavailable -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        states = self.script.get(request.name)
        if states is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"name: {request.name} not found")
        state, error = states.pop(0) if len(states) > 1 else states[0]
        spec = pb.JobSpec(kind=pb.RL_SESSION, data=pb.DataSpec(seq_len=16, batch_size=4))  # 64 positions a call
        return pb.Job(name=request.name, state=state, error=error, spec=spec)

    def CancelJob(self, request, context):
        return pb.Job(name=request.name, state=pb.Job.CANCELLED)


class SessionTest(unittest.TestCase):
    def setUp(self):
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16))
        self.training = FakeTraining()
        self.jobs = FakeJobs()
        pb_grpc.add_TrainingServiceServicer_to_server(self.training, self.server)
        pb_grpc.add_JobServiceServicer_to_server(self.jobs, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.client = oc.ServiceClient(f"127.0.0.1:{port}", token="s3cret", call_timeout=30)
        self.jobs.script["jobs/1"] = [(pb.Job.RUNNING, "")]

    def tearDown(self):
        self.client.close()
        self.server.stop(None)

    @staticmethod
    def batch(tag):
        return [oc.Datum.from_sequence([tag, 1, 2])]

    def test_sequence_numbers_follow_issue_order(self):
        s = self.client.session("jobs/1")
        futs = []
        for i in range(10):
            futs.append(s.forward_backward(self.batch(i)))
            futs.append(s.optim_step(lr=(i + 1) / 1000))
        results = [f.result(timeout=30) for f in futs]
        # Sequence n was stamped on the n-th call issued, whatever order they arrived in.
        by_seq = sorted(self.training.arrivals, key=lambda a: a[1])
        self.assertEqual([a[1] for a in by_seq], list(range(1, 21)))
        want = []
        for i in range(10):
            want += [("ForwardBackward", i), ("OptimStep", (i + 1) / 1000)]
        self.assertEqual([(a[0], a[2]) for a in by_seq], want)
        self.assertEqual(results[0].loss, 0.0)
        self.assertEqual(results[0].logprobs, [[-1.0, -1.0]])
        self.assertEqual(results[3].step, 2)
        self.assertEqual(s.next_sequence, 21)

    def test_sequence_numbers_are_unique_across_threads(self):
        s = self.client.session("jobs/1", first_sequence=5)
        futs, lock = [], threading.Lock()

        def issue(k):
            for i in range(8):
                f = s.optim_step(lr=0.001)
                with lock:
                    futs.append(f)

        threads = [threading.Thread(target=issue, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for f in futs:
            f.result(timeout=30)
        self.assertEqual(sorted(a[1] for a in self.training.arrivals), list(range(5, 37)))

    def test_asyncio_awaits_in_issue_order(self):
        """Awaitable futures and *_async twins: issue order is the order the coroutines issue,
        and the Tinker split (ServiceClient -> TrainingClient -> SamplingClient) shares it."""
        import asyncio

        s = self.client.session("jobs/1")
        self.assertIsInstance(s, oc.TrainingClient)
        self.assertIs(oc.Session, oc.TrainingClient)
        sampler = s.create_sampling_client()

        async def run():
            fb_fut = await s.forward_backward_async(self.batch(2))   # issued: sequence 1
            st_fut = await s.optim_step_async(lr=0.003)              # sequence 2
            lp = await sampler.compute_logprobs([5, 6, 7])           # sequence 3 (a Forward)
            res = await sampler.sample([9, 8], num_samples=2,
                                       sampling_params=oc.SamplingParams(max_tokens=3, seed=11))  # 4
            many = await asyncio.gather(*[s.optim_step(lr=0.001 * (i + 1)) for i in range(3)])   # 5..7
            return (await fb_fut), (await st_fut), lp, res, many

        fb, st, lp, res, many = asyncio.run(run())
        self.assertEqual((fb.loss, st.step), (2.0, 3))
        self.assertEqual(lp, [None, -0.5, -0.5])
        self.assertEqual([q.tokens for q in res.sequences], [[8, 8, 8], [8, 8, 8]])
        self.assertEqual((res.seed, res.sequences[0].logprobs, res.sequences[1].stop_reason), (11, [-0.25] * 3, "length"))
        self.assertEqual([m.step for m in many], [1, 2, 3])
        by_seq = sorted(self.training.arrivals, key=lambda a: a[1])
        self.assertEqual([(a[0], a[1]) for a in by_seq][:4],
                         [("ForwardBackward", 1), ("OptimStep", 2), ("Forward", 3), ("Sample", 4)])
        self.assertEqual(sorted(a[1] for a in by_seq), list(range(1, 8)))
        # A one-token prompt has nothing to score: no call, no sequence number spent.
        self.assertEqual(s.compute_logprobs([5]).result(timeout=30), [None])
        self.assertEqual(s.next_sequence, 8)
        with self.assertRaises(ValueError):
            sampler.sample(prompts=[])
        self.assertEqual(s.next_sequence, 8)

    def test_unsequenced_session_sends_zero(self):
        s = self.client.session("jobs/1", sequenced=False)
        s.forward(self.batch(1)).result(timeout=30)
        s.export_weights("/tmp/x").result(timeout=30)
        self.assertEqual([a[1] for a in self.training.arrivals], [0, 0])
        self.assertEqual(s.next_sequence, 0)

    def test_errors_carry_code_and_message(self):
        s = self.client.session("jobs/1")
        bad = s.forward_backward([oc.Datum.from_sequence([999, 1])])
        good = s.optim_step(lr=0.001)
        with self.assertRaises(oc.OdysseyError) as cm:
            bad.result(timeout=30)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(cm.exception.message, "batch[0].tokens[0] (999) must be in [0, 256)")
        self.assertEqual(cm.exception.method, "ForwardBackward")
        self.assertIn("jobs/1", str(cm.exception))
        self.assertEqual(good.result(timeout=30).step, 1)  # a failed call does not poison the next
        with self.assertRaises(oc.OdysseyError):
            s.wait_all()

    def test_bearer_token_is_sent(self):
        s = self.client.session("jobs/1")
        s.forward(self.batch(3)).result(timeout=30)
        self.assertEqual(self.training.metadata[0].get("authorization"), "Bearer s3cret")

    def test_deadline_surfaces_as_deadline_exceeded(self):
        s = self.client.session("jobs/1")
        f = s.forward_backward(self.batch(0), timeout=0.001)  # the fake sleeps 50 ms on even tags
        with self.assertRaises(oc.OdysseyError) as cm:
            f.result(timeout=30)
        self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)

    def test_push_rollouts_keeps_issue_order(self):
        s = self.client.session("jobs/1")
        first = s.forward_backward(self.batch(2))
        rollouts = [(self.batch(4), "ppo", 0.001), (self.batch(6), oc.Loss("ppo", 0.1, 0.2), oc.AdamW(0.002))]
        seen = []
        stream = s.push_rollouts(rollouts, on_result=seen.append)
        after = s.optim_step(lr=0.005)
        results = stream.result(timeout=30)
        after.result(timeout=30)
        self.assertTrue(first.done())
        self.assertEqual([r.optim_step.step for r in results], [1, 2])
        self.assertEqual(seen, results)
        self.assertEqual(results[1].optim_step.lr, 0.002)
        arrivals = {(a[0], a[2]): a[3] for a in self.training.arrivals}
        # The stream opened after the call before it finished; the call after it was sent once
        # the stream had ended (it still got the next sequence number: 2).
        self.assertLess(arrivals[("ForwardBackward", 2)], arrivals[("PushRollouts", 0)])
        self.assertGreater(arrivals[("OptimStep", 0.005)], self.training.stream_closed_at)
        self.assertEqual([a[1] for a in self.training.arrivals if a[0] == "OptimStep"], [2])

    def test_requests_the_controller_refuses_before_ordering_fail_at_once(self):
        # The controller checks these before a call takes its place in the sequence order, so a
        # stamped number would never be used and later calls would wait for it: the session
        # refuses them locally, without spending a number.
        s = self.client.session("jobs/1")
        self.assertEqual(s.max_positions, 64)
        cases = [
            (lambda: s.forward_backward(self.batch(1), loss="grpo"), "loss.kind"),
            (lambda: s.forward_backward(self.batch(1), loss="ppo", clip_low=1.5), "loss.clip_low"),
            (lambda: s.forward_backward(self.batch(1), loss="ppo", clip_high=float("inf")), "loss.clip_high"),
            (lambda: s.forward_backward([]), "batch is empty"),
            (lambda: s.forward([oc.Datum.from_sequence(list(range(40)))] * 2), "78 token positions exceed"),
            (lambda: s.optim_step(lr=float("nan")), "adam.lr"),
            (lambda: s.optim_step(lr=1e-3, beta1=1.0), "adam.beta1"),
            (lambda: s.optim_step(lr=1e-3, weight_decay=-1), "adam.weight_decay"),
            (lambda: s.save_checkpoint("relative/dir"), "absolute path"),
            (lambda: s.load_checkpoint(""), "directory is required"),
            (lambda: s.export_weights("/tmp/x", dtype="float16"), "dtype"),
            (lambda: s.export_weights("/tmp/a\0b"), "NUL"),
        ]
        for make, what in cases:
            with self.assertRaisesRegex(ValueError, what):
                make()
        self.assertEqual(s.next_sequence, 1)
        self.assertEqual(self.training.arrivals, [])
        self.assertEqual(s.optim_step(lr=1e-3).result(timeout=30).step, 1)
        self.assertEqual(self.training.arrivals[0][1], 1)

    def test_push_rollouts_reports_a_bad_rollout_itself(self):
        s = self.client.session("jobs/1")

        def rollouts():
            yield self.batch(4), "ppo", 1e-3
            yield self.batch(6), "ppo", -1.0  # refused by the client's check of adam.lr

        f = s.push_rollouts(rollouts())
        with self.assertRaisesRegex(ValueError, r"rollouts\[1\].adam.lr"):
            f.result(timeout=30)

    def test_create_session_waits_for_running(self):
        self.jobs.script["jobs/1"] = [(pb.Job.PENDING, ""), (pb.Job.PENDING, ""), (pb.Job.RUNNING, "")]
        s = self.client.create_session("tiny", seq_len=32, batch_size=4, idle_timeout_seconds=60, request_id="r1",
                                       dtype="float32", seed=3)
        self.assertEqual(s.name, "jobs/1")
        req = self.jobs.created[0]
        self.assertEqual(req.request_id, "r1")
        self.assertEqual(req.spec.kind, pb.RL_SESSION)
        self.assertEqual((req.spec.data.seq_len, req.spec.data.batch_size, req.spec.data.seed), (32, 4, 3))
        self.assertEqual(req.spec.rl.idle_timeout_seconds, 60)
        self.assertEqual(req.spec.model.name, "tiny")
        self.assertEqual(s.info().state, "RUNNING")

    def test_create_session_memory_fields_set_only_when_given(self):
        self.jobs.script["jobs/1"] = [(pb.Job.RUNNING, "")]
        self.jobs.script["jobs/2"] = [(pb.Job.RUNNING, "")]
        self.client.create_session("tiny", seq_len=8, batch_size=1)
        self.client.create_session("tiny", seq_len=8, batch_size=1, recompute="layer", offload="on",
                                   device_resident=0, attention_head_groups=2, keep_attention=False,
                                   optimizer_on_host=True, keep_selection=True, bf16_moments=True)
        unset, given = self.jobs.created[0].spec.memory, self.jobs.created[1].spec.memory
        for field in ("device_resident", "keep_attention", "optimizer_on_host", "keep_selection", "bf16_moments"):
            self.assertFalse(unset.HasField(field), field)  # left to the planner
            self.assertTrue(given.HasField(field), field)
        self.assertEqual((given.device_resident, given.attention_head_groups, given.keep_attention,
                          given.optimizer_on_host, given.keep_selection, given.bf16_moments),
                         (0, 2, False, True, True, True))

    def test_phase_times_reach_the_spec_and_the_results(self):
        self.jobs.script["jobs/1"] = [(pb.Job.RUNNING, "")]
        self.jobs.script["jobs/2"] = [(pb.Job.RUNNING, "")]
        self.client.create_session("tiny", seq_len=8, batch_size=1)
        self.client.create_session("tiny", seq_len=8, batch_size=1, phase_times=True)
        self.assertEqual([c.spec.profile.phase_times for c in self.jobs.created[:2]], [False, True])
        fb = pb.ForwardBackwardResponse(loss=1.5, phases=[pb.PhaseSeconds(phase="backward", count=1, seconds=0.5),
                                                          pb.PhaseSeconds(phase="layer # forward", count=4, seconds=0.25)])
        r = oc.ForwardBackwardResult.from_proto(fb)
        self.assertEqual(r.phases, {"backward": 0.5, "layer # forward": 0.25})
        self.assertEqual(list(r.phases), ["backward", "layer # forward"])  # the worker's order, longest first
        self.assertEqual(oc.OptimStepResult.from_proto(pb.OptimStepResponse(step=1)).phases, {})

    def test_lora_sessions_carry_the_lora_spec(self):
        self.jobs.script["jobs/1"] = [(pb.Job.RUNNING, "")]
        self.jobs.script["jobs/2"] = [(pb.Job.RUNNING, "")]
        self.client.create_session("tiny", seq_len=8, batch_size=1)
        self.client.create_lora_training_client("tiny", rank=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"],
                                                seq_len=8, batch_size=1)
        plain, lora = self.jobs.created[0].spec.lora, self.jobs.created[1].spec.lora
        self.assertEqual(plain.rank, 0)  # full fine-tuning
        self.assertEqual((lora.rank, lora.alpha, list(lora.target_modules), lora.merge),
                         (4, 8.0, ["q_proj", "v_proj"], False))

    def test_create_job_retries_unavailable_with_the_same_request_id(self):
        self.jobs.unavailable = 2
        self.jobs.script["jobs/1"] = [(pb.Job.RUNNING, "")]
        s = self.client.create_session("tiny", seq_len=8, batch_size=1)
        self.assertEqual(s.name, "jobs/1")
        self.assertEqual(len(self.jobs.attempts), 3)
        self.assertEqual(len(set(self.jobs.attempts)), 1)  # one request id: a retry cannot make a second job

    def test_job_calls_retry_unavailable_three_times(self):
        # Three retries (four attempts) are enough for a controller that comes back in time...
        self.jobs.get_unavailable = 3
        self.assertEqual(self.client.get_job(1).name, "jobs/1")
        self.assertEqual(self.jobs.get_attempts, 4)
        # ...and a fourth UNAVAILABLE is the caller's, after exactly four attempts.
        self.jobs.get_attempts = 0
        self.jobs.get_unavailable = 10
        with self.assertRaises(oc.OdysseyError) as cm:
            self.client.get_job(1)
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(self.jobs.get_attempts, 4)
        # CreateJob alike, one request id for every attempt.
        self.jobs.unavailable = 10
        with self.assertRaises(oc.OdysseyError) as cm:
            self.client.create_session("tiny", seq_len=8, batch_size=1)
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(len(self.jobs.attempts), 4)
        self.assertEqual(len(set(self.jobs.attempts)), 1)

    def test_training_calls_are_never_retried(self):
        # A TrainingService call that fails UNAVAILABLE may have run: the client reports it and
        # sends it once, and the session goes on with the next call.
        s = self.client.session("jobs/1")
        with self.assertRaises(oc.OdysseyError) as cm:
            s.forward_backward(self.batch(998)).result(timeout=30)
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        with self.assertRaises(oc.OdysseyError) as cm:
            s.optim_step(lr=0.998).result(timeout=30)
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(s.forward_backward(self.batch(1)).result(timeout=30).loss, 1.0)
        with self.training.lock:
            sent = [(m, tag) for m, _, tag, _ in self.training.arrivals]
        self.assertEqual(sent.count(("ForwardBackward", 998)), 1)
        self.assertEqual(sent.count(("OptimStep", 0.998)), 1)

    def test_training_call_to_a_gone_server_is_unavailable(self):
        self.jobs.unavailable = 0
        s = self.client.session("jobs/1")
        self.server.stop(None)
        with self.assertRaises(oc.OdysseyError) as cm:
            s.forward(self.batch(1), timeout=5).result(timeout=30)
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)

    def test_create_session_reports_failure(self):
        self.jobs.script["jobs/1"] = [(pb.Job.PENDING, ""), (pb.Job.FAILED, "spec.model.name: no such model")]
        with self.assertRaises(oc.JobFailedError) as cm:
            self.client.create_session("nope")
        self.assertEqual(cm.exception.state, "FAILED")
        self.assertIn("spec.model.name: no such model", str(cm.exception))

    def test_create_session_times_out(self):
        self.jobs.script["jobs/1"] = [(pb.Job.PENDING, "")]
        t0 = time.monotonic()
        with self.assertRaises(oc.SessionTimeoutError) as cm:
            self.client.create_session("tiny", wait_timeout=0.3)
        self.assertLess(time.monotonic() - t0, 5)
        self.assertIn("PENDING", str(cm.exception))

    def test_get_job_not_found_maps_the_status(self):
        with self.assertRaises(oc.OdysseyError) as cm:
            self.client.get_job(42)
        self.assertEqual(cm.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(cm.exception.message, "name: jobs/42 not found")


if __name__ == "__main__":
    unittest.main()
