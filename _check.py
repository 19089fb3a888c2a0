import jax
from experiments.configs import qwen3_1p7b_1gpu as m
from rstar2jax.train import runner, config as config_lib
from rstar2jax.train.steps import make_rl_step, state_shardings, batch_sharding
c = m.get_config(); c.workdir="/tmp/l17"
mc = runner.model_config_from(c)
mesh = runner.mesh_from_config(c, allow_emulated=True)
opt = config_lib.build_optimizer(c)
sh = state_shardings(mc, opt, mesh)
st = runner.abstract_state(mc, opt, sh, 0)
b = runner._abstract_batch(256, 10239, batch_sharding(mesh), rl=True)
for opts in (None, {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}):
    step = make_rl_step(mc, opt, config_lib.build_loss_config(c), num_microbatches=64, mesh=mesh, shardings=sh, compiler_options=opts)
    ma = step.lower(st, b).compile().memory_analysis()
    print(opts, "temp %.2f arg %.2f" % (ma.temp_size_in_bytes/2**30, ma.argument_size_in_bytes/2**30), flush=True)
