"""One process of a (possibly multi-process) RL iteration on CPU, for tests/train/test_distributed.py.

  python -m tests.train.distributed_worker --out=result.json [--num_processes=2 --process_id=0 --port=...]

Builds the tiny model on a data=2 x fsdp=2 mesh over all processes' devices; rolls out with the scripted
rollout (each process its slice of the problems, gathered to all); then places one RL batch (the same in
every process) on the global mesh and runs the sharded RL step. Writes what was gathered, the step's
metrics and a checksum of the updated parameters.
"""

import json

import ml_collections
from absl import app, flags

_OUT = flags.DEFINE_string("out", None, "where to write the result JSON", required=True)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "processes in the run")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "this process")
_PORT = flags.DEFINE_integer("port", 0, "coordinator port (multi-process)")


def main(argv):
    del argv
    from experiments.configs import tiny_cpu
    from rstar2jax import train

    config = tiny_cpu.get_config()
    config.mesh = ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=1))
    config.distributed = ml_collections.ConfigDict(
        dict(
            coordinator_address=f"127.0.0.1:{_PORT.value}",
            num_processes=_NUM_PROCESSES.value,
            process_id=_PROCESS_ID.value,
        )
    )
    options = train.parse(config)
    train.prepare_process(options)

    import jax
    import numpy as np

    from rstar2jax import models
    from rstar2jax.data.problems import Problem
    from rstar2jax.schedules.multihost import put_batch
    from rstar2jax.schedules.schedule import run_rollouts
    from rstar2jax.train.steps import batch_sharding
    from tests.train.conftest import random_sequences, tiny_model_config
    from tests.train.scripted import make_scripted_rollout

    mesh = train.mesh_from_config(options)
    model_config = tiny_model_config()
    optimizer = train.make_optimizer(1e-3, warmup_steps=1)
    shardings = train.state_shardings(model_config, optimizer, mesh)
    params = models.init_params(model_config, jax.random.PRNGKey(0), mesh=mesh)
    state = jax.jit(lambda p: train.init_train_state(p, optimizer, 1), out_shardings=shardings)(params)
    step = train.make_rl_step(model_config, optimizer, num_microbatches=2, mesh=mesh, shardings=shardings)
    problems = [Problem(id=f"p{i}", problem="q", answer="1") for i in range(8)]
    rollout = make_scripted_rollout(vocab_size=128)
    gathered = run_rollouts(
        rollout, state.params, problems, samples_per_problem=4, max_response_length=24, max_turns=3, seed=0,
        policy_version=0,
    )
    # Rollout seeds differ per process (seed + process index), so the update runs on one fixed batch.
    batch = train.build_batch(random_sequences(0, 16), seq_len=32, num_rows=16, with_rl_fields=True)
    state, metrics = step(state, put_batch(batch, batch_sharding(mesh)))
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    checksum = jax.jit(
        lambda p: sum(jax.numpy.sum(x * x) for x in jax.tree.leaves(p)),
        out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
    )(state.params)
    result = dict(metrics)
    result.update(
        gathered=[[(t.problem_id, len(t.response_ids), t.reward) for t in g] for g in gathered],
        param_checksum=float(np.asarray(checksum)),
        devices=jax.device_count(),
        processes=jax.process_count(),
    )
    with open(_OUT.value, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    app.run(main)
