"""The rollout end to end: a tiny Qwen3 on the real engine, a real sandbox server, the real verifier.

A random model checks that a batch finishes (no hang) with a consistent record; the same model taught to call
the tool (a few Adam steps on one scripted conversation) runs real code through the sandbox and decodes
after the appended tool response. Sampler log-probs are checked against a full forward pass of
prompt + response, which holds only if the engine's cache saw exactly the recorded tokens (token in / token
out across tool turns). The trainer-facing ``PolicyRollout`` takes new parameters without recompiling.
"""

import asyncio
import pickle
import signal
import threading

import jax
import numpy as np
import pytest
from jax._src import monitoring

from rstar2jax import models
from rstar2jax.agent import (
    FAILED_OUTCOMES,
    PYTHON_TOOL_NAME,
    OutagePolicy,
    PartialRollout,
    PolicyRollout,
    PromptConfig,
    RolloutConfig,
    SandboxClient,
    rollout_async,
)
from rstar2jax.agent.testing import answer_turn, teach_tool_use, tiny_policy, tool_code_output
from rstar2jax.data.problems import Problem
from rstar2jax.data.synthetic import make_task
from rstar2jax.engine import Engine, EngineConfig, SamplingParams
from rstar2jax.reward import AnswerVerifier
from rstar2jax.schedules.placement import engine_copy
from sandbox_server import start_local

# A short prompt keeps the tiny model's sequences (and the teaching) cheap; the tool keeps the paper's name.
PROMPT = PromptConfig(system_prompt="", user_prefix="",
                      tools=({"type": "function", "function": {"name": PYTHON_TOOL_NAME}},))
BUDGET = 128
MAX_PROMPT = 160
ENGINE = EngineConfig(num_slots=8, max_len=MAX_PROMPT + BUDGET)


@pytest.fixture(scope="module")
def problems():
    """Two synthetic problems whose gold answer is what the taught tool call prints."""
    output = tool_code_output().strip()
    return [Problem(p.id, p.problem, output) for p in make_task(2, 0, seed=3).train]


@pytest.fixture(scope="module")
def policy(problems, tmp_path_factory):
    return tiny_policy(problems, str(tmp_path_factory.mktemp("tok")), vocab_size=512, prompt=PROMPT)


@pytest.fixture(scope="module")
def server():
    with start_local(workers=1) as s:
        yield s


@pytest.fixture(scope="module")
def verifier():
    with AnswerVerifier(num_workers=1) as v:
        yield v


def check_record(t, params, model_config, budget=BUDGET):
    """Shapes, budget, and sampler log-probs equal to the model's log-probs of the recorded stream."""
    assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs) <= budget
    assert t.loss_mask[0] == 1 and set(t.loss_mask) <= {0, 1}
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if not m)
    assert set(t.tool_outcomes) <= FAILED_OUTCOMES | {"ok"}
    assert t.reward in (0.0, 1.0) and not (t.truncated and t.reward)
    stream = t.prompt_ids + t.response_ids
    # Padded to the engine's length: one compiled forward for every record (the model is causal, so the
    # padding changes no logit of the stream).
    tokens = np.zeros((1, ENGINE.max_len), np.int32)
    tokens[0, :len(stream)] = stream
    logits, _ = models.forward(params, model_config, tokens)
    logits, tokens = logits[:, :len(stream)], tokens[:, :len(stream)]
    recomputed = np.asarray(models.token_logprobs(logits[:, :-1], tokens[:, 1:]))[0, len(t.prompt_ids) - 1:]
    sampled = np.array(t.loss_mask, bool)
    np.testing.assert_allclose(np.array(t.logprobs)[sampled], recomputed[sampled], atol=2e-4)
    # Entropies: the raw policy distribution's at each sampled token, 0 on inserted tokens.
    step_logits = np.asarray(logits[0, len(t.prompt_ids) - 1:-1], np.float64)
    top = step_logits.max(axis=-1, keepdims=True)
    logp = step_logits - top - np.log(np.exp(step_logits - top).sum(axis=-1, keepdims=True))
    expected = -np.sum(np.exp(logp) * logp, axis=-1)
    entropies = np.array(t.entropies)
    assert entropies.shape == sampled.shape and (entropies[~sampled] == 0.0).all()
    np.testing.assert_allclose(entropies[sampled], expected[sampled], atol=2e-4)


# A minute or more on 2 cores (the random model's tool calls run in the sandbox, and its 8 records' dense
# references): the default run keeps the taught policy's real-sandbox rollout below, with the same checks.
@pytest.mark.slow
def test_random_model_batch_with_real_sandbox_finishes(problems, policy, server, verifier):
    budget = BUDGET // 2  # the engine holds more: a session's budget is data, not a shape
    config = RolloutConfig(max_response_length=budget, seed=0, prompt=PROMPT)

    async def run():
        engine = Engine(policy.params, policy.model_config, ENGINE)
        async with engine, SandboxClient(server.url) as sandbox:
            return await asyncio.wait_for(rollout_async(
                problems, 4, engine=engine, sandbox=sandbox, tokenizer=policy.tokenizer, verifier=verifier,
                config=config), timeout=300)

    trajectories = asyncio.run(run())
    assert [t.problem_id for t in trajectories] == [problems[0].id] * 4 + [problems[1].id] * 4
    for t in trajectories:
        check_record(t, policy.params, policy.model_config, budget)
        # Finished means the model ended its turn; anything else (budget, turn limit) is a truncation.
        assert t.truncated == (t.response_ids[-1] not in policy.model_config.eos_token_ids)
    assert len({tuple(t.response_ids) for t in trajectories}) > 1  # siblings sample independently


@pytest.fixture(scope="module")
def taught(problems, policy):
    return teach_tool_use(policy, problems, steps=80, learning_rate=1e-2, prompt=PROMPT)


def policy_rollout(policy, server, verifier):
    return PolicyRollout(policy.model_config, policy.tokenizer, SandboxClient(server.url),
                         engine_config=ENGINE, max_prompt_length=MAX_PROMPT, verifier=verifier,
                         config=RolloutConfig(prompt=PROMPT, sampling=SamplingParams(temperature=0.0)))


def test_taught_policy_runs_real_code_and_reads_the_result(problems, policy, taught, server, verifier):
    rollout_fn = policy_rollout(policy, server, verifier)
    try:
        trajectories = rollout_fn(taught, problems, samples_per_problem=2, max_response_length=BUDGET,
                                  max_turns=3, seed=1)
    finally:
        rollout_fn.close()
    assert [t.problem_id for t in trajectories] == [problems[0].id] * 2 + [problems[1].id] * 2
    for t in trajectories:
        check_record(t, taught, policy.model_config)
    answered = [t for t in trajectories if t.tool_outcomes == ["ok"]]
    assert answered, [t.tool_outcomes for t in trajectories]
    for t in answered:
        text = policy.tokenizer.decode(t.response_ids)
        assert f"<tool_response>\n{tool_code_output()}\n</tool_response>" in text
        assert t.num_turns == 2 and 0 in t.loss_mask
    assert any(t.reward == 1.0 and answer_turn(t.answer) in policy.tokenizer.decode(t.response_ids)
               for t in answered)


def test_policy_rollout_takes_new_params_without_recompiling(problems, policy, taught, server, verifier):
    """One greedy session: every program shape follows from its token stream, so with the same stream a
    compilation in the second call could only come from the parameters."""
    nudged = jax.tree.map(lambda x: x * (1 + 1e-3), taught)  # new arrays and values, same greedy choices
    rollout_fn = policy_rollout(policy, server, verifier)
    call = dict(samples_per_problem=1, max_response_length=BUDGET, max_turns=3, seed=1)
    compiles = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    try:
        (first,) = rollout_fn(taught, problems[:1], **call)
        monitoring.register_event_duration_secs_listener(count)
        try:
            (second,) = rollout_fn(nudged, problems[:1], **call)
        finally:
            monitoring.unregister_event_duration_listener(count)
        assert compiles == []
    finally:
        rollout_fn.close()
    assert second.response_ids == first.response_ids and second.tool_outcomes == first.tool_outcomes
    assert second.logprobs != first.logprobs  # decoded with the new parameters


def _by_problem(trajectories):
    return sorted((t.problem_id, t.response_ids, t.loss_mask, t.tool_outcomes, t.reward)
                  for t in trajectories)


def test_partial_rollouts_resume_to_the_uninterrupted_tokens(problems, policy, taught, server, verifier):
    """Greedy decoding: rollouts stopped by a small token budget (mid-turn and around tool turns) and
    resumed (each resume with a new policy version but the same parameters) end with exactly the tokens of
    one uninterrupted call; the tokens keep the version that sampled them (-1 on tool output) and their
    log-probs stay the policy's."""
    rollout_fn = policy_rollout(policy, server, verifier)
    rollout_fn.partial_segment_tokens = 8
    call = dict(samples_per_problem=1, max_response_length=BUDGET, max_turns=3, seed=1)
    try:
        reference = rollout_fn(taught, problems, **call)  # no budget: whole turns, nothing stops
        assert len(reference) == 2
        finished, unfinished = rollout_fn.partial(taught, problems, **call, token_budget=24)
        assert unfinished and all(isinstance(u, PartialRollout) for u in unfinished)
        version = 0
        while unfinished:
            version += 1
            done, unfinished = rollout_fn.partial(taught, [], **call, token_budget=24, resume=unfinished,
                                          policy_version=version)
            finished += done
    finally:
        rollout_fn.close()
    assert version > 1
    assert _by_problem(finished) == _by_problem(reference)
    assert any(t.tool_outcomes == ["ok"] for t in finished)  # interrupted around a real tool turn too
    resumed = 0
    for t in finished:
        check_record(t, taught, policy.model_config)
        versions = np.array(t.policy_versions)
        mask = np.array(t.loss_mask, bool)
        assert (versions[~mask] == -1).all() and (versions[mask] >= 0).all()
        assert (np.diff(versions[mask]) >= 0).all()  # resumed tokens carry later versions, in order
        resumed += len(set(versions[mask])) > 1
    assert resumed


def test_partial_rollout_resumed_after_an_update_keeps_old_tokens(problems, policy, taught, server, verifier):
    """Resumed with new parameters: the tokens sampled before keep version 0 and the old policy's log-probs;
    the new ones carry version 1 and the new policy's log-probs."""
    nudged = jax.tree.map(lambda x: x * (1 + 1e-2), taught)
    rollout_fn = policy_rollout(policy, server, verifier)
    rollout_fn.partial_segment_tokens = 4
    call = dict(samples_per_problem=1, max_response_length=BUDGET, max_turns=3, seed=1)
    try:
        finished, unfinished = rollout_fn.partial(taught, problems[:1], **call, token_budget=6)
        assert finished == [] and len(unfinished) == 1
        before = unfinished[0].num_tokens
        unfinished = pickle.loads(pickle.dumps(unfinished))  # as a checkpoint keeps it
        finished, unfinished = rollout_fn.partial(nudged, [], **call, token_budget=10**9, resume=unfinished,
                                          policy_version=1)
    finally:
        rollout_fn.close()
    (t,) = finished
    assert unfinished == [] and 0 < before < len(t.response_ids)
    versions = np.array(t.policy_versions)
    mask = np.array(t.loss_mask, bool)
    assert (versions[:before][mask[:before]] == 0).all() and (versions[before:][mask[before:]] == 1).all()
    tokens = np.array([t.prompt_ids + t.response_ids], np.int32)
    for params, part in ((taught, versions == 0), (nudged, versions == 1)):
        logits, _ = models.forward(params, policy.model_config, tokens)
        recomputed = np.asarray(models.token_logprobs(logits[:, :-1], tokens[:, 1:]))[0]
        recomputed = recomputed[len(t.prompt_ids) - 1:]
        np.testing.assert_allclose(np.array(t.logprobs)[part], recomputed[part], atol=2e-4)


def test_a_sandbox_outage_mid_rollout_keeps_every_session_and_its_tokens(problems, policy, taught, server,
                                                                         verifier):
    """Issue 33: the sandbox killed at the first tool call of a greedy rollout and started again on its port
    a moment later: every session waits in the engine with its tokens and KV pages and goes on when the
    calls get through; the trajectories are token for token those of a rollout without the outage."""

    class KilledAtFirstCall:
        def __init__(self, client):
            self.client, self.urls, self.killed = client, client.urls, False

        async def run(self, code, stdin="", timeout=None):
            if not self.killed:
                self.killed = True
                server.process.send_signal(signal.SIGKILL)
                server.process.wait()
                threading.Timer(0.5, server.restart_if_dead).start()
            return await self.client.run(code, stdin=stdin, timeout=timeout)

        async def close(self):
            await self.client.close()

    call = dict(samples_per_problem=2, max_response_length=BUDGET, max_turns=3, seed=1)
    reference_fn = policy_rollout(policy, server, verifier)
    outage_fn = policy_rollout(policy, server, verifier)
    outage_fn.sandbox = KilledAtFirstCall(outage_fn.sandbox)
    outage_fn.outage = OutagePolicy(budget_s=120, backoff=(0.05, 0.5))
    try:
        reference = reference_fn(taught, problems, **call)
        survived = outage_fn(taught, problems, **call)
    finally:
        reference_fn.close()
        outage_fn.close()
    assert outage_fn.sandbox.killed and any(t.tool_outcomes == ["ok"] for t in survived)
    assert _by_problem(survived) == _by_problem(reference)
    for t in survived:
        check_record(t, taught, policy.model_config)
    stats = outage_fn.last_stats
    assert stats["sandbox_outage_s"] > 0.4 and stats["sandbox_retried_calls"] >= 1
    assert stats["trajectories_dropped_for_sandbox_failures"] == 0


def _head_only(params):
    """Weights that sample differently but write the same keys/values (a new final norm and last layer's MLP
    output), so tokens decoded on old keys/values after an update have the new weights' teacher-forced
    log-probs."""
    layers = params["layers"]
    return {**params, "final_norm": params["final_norm"] * 1.5,
            "layers": {**layers, "down_proj": layers["down_proj"].at[-1].multiply(-2.0)}}


def test_stream_takes_new_weights_while_a_session_waits_on_its_tool(problems, policy, taught, server,
                                                                   verifier):
    """The asynchronous producer's stream: the update arrives while both sessions wait on their tool call;
    they survive it, every sampled token carries the version that sampled it and that version's
    teacher-forced log-prob, and the group submitted after the update is all new. The engine runs on
    another device than the trainer's, with weights copied there (split placement). (That an update
    compiles nothing: ``tests/engine/test_weights.py``.)"""

    class HeldTool:  # the tool call waits until the test has updated the weights
        def __init__(self, client):
            self.client, self.calling, self.release = client, threading.Event(), threading.Event()

        async def run(self, code, stdin="", timeout=None):
            self.calling.set()
            await asyncio.to_thread(self.release.wait, 120)
            return await self.client.run(code, stdin=stdin, timeout=timeout)

        async def close(self):
            await self.client.close()

    new = _head_only(taught)
    device = jax.devices()[-1]
    rollout_fn = policy_rollout(policy, server, verifier)
    rollout_fn.sandbox = HeldTool(rollout_fn.sandbox)
    stream = rollout_fn.stream(engine_copy(taught, device), policy_version=0, samples_per_problem=2,
                               max_response_length=BUDGET, max_turns=3, device=device)
    finished = {}
    try:
        stream.submit("before", problems[0], seed=1, index=0)
        assert rollout_fn.sandbox.calling.wait(120)
        stream.update_weights(engine_copy(new, device), 1)
        rollout_fn.sandbox.release.set()
        stream.submit("after", problems[1], seed=1, index=1)
        while len(finished) < 2:
            finished.update(stream.wait(timeout=120))
        stats = stream.stats()
        assert {a.devices().pop() for a in jax.tree.leaves(stream.core.runner.params)} == {device}
    finally:
        stream.close()
        rollout_fn.close()
    assert stats["generated_tokens"] == sum(sum(t.loss_mask) for g in finished.values() for t in g)
    assert stats["busy_s"] > 0
    params_of = {0: taught, 1: new}
    for key, group in finished.items():
        assert len(group) == 2
        for t in group:
            versions = np.asarray(t.policy_versions)
            sampled = np.asarray(t.loss_mask, bool)
            assert set(versions[sampled]) == ({0, 1} if key == "before" else {1}), (key, t.policy_versions)
            assert (versions[~sampled] == -1).all()
            tokens = np.array([t.prompt_ids + t.response_ids], np.int32)
            for version, params in params_of.items():
                logits, _ = models.forward(params, policy.model_config, tokens)
                expected = np.asarray(models.token_logprobs(logits[:, :-1], tokens[:, 1:]))[
                    0, len(t.prompt_ids) - 1:]
                rows = sampled & (versions == version)
                np.testing.assert_allclose(np.asarray(t.logprobs)[rows], expected[rows], atol=2e-4)
    assert any(t.tool_outcomes == ["ok"] for t in finished["before"])
