"""``experiments.ablate_roc --modes``: an arm is a base arm plus run-config fields (``paper+loss.mode=cispo``,
``paper+rl.ppo_epochs=2``), checked before any run; a bad arm is one line. (A subprocess: the launcher module
defines its absl flags on import.)"""

import json
import subprocess
import sys

_ARMS = """
import json
from experiments import ablate_roc
from experiments.configs import demo
from rstar2jax.train import ConfigError, parse

config, paths = demo.get_config(), demo.DemoPaths("runs/x")
arm = "paper+rl.ppo_epochs=2+loss.mode=cispo+loss.eps_high=0.3"
options = parse(demo.before_files(ablate_roc.arm_run_config(config, paths, arm, seed=1), config),
                check_data=False)
errors = []
for bad in ("nope", "paper+loss.mode", "paper+ppo_epochs=2", "paper+nosection.x=1", "paper+loss.mode=nope"):
    try:
        parse(demo.before_files(ablate_roc.arm_run_config(config, paths, bad, seed=1), config),
              check_data=False)
    except ConfigError as error:
        errors.append(str(error))
print(json.dumps(dict(
    arm=list(ablate_roc.parse_arm(arm)),
    options=[options.rl.loss.mode, options.rl.loss.eps_high, options.rl.ppo_epochs,
             options.rl.iterations[0].roc_mode, options.seed],
    errors=errors)))
"""


def test_arms_differ_by_loss_mode_and_ppo_epochs_and_bad_arms_are_one_line():
    done = subprocess.run([sys.executable, "-c", _ARMS], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["arm"] == ["paper", {"rl.ppo_epochs": 2, "loss.mode": "cispo", "loss.eps_high": 0.3}]
    assert result["options"] == ["cispo", 0.3, 2, "paper", 1]
    assert result["errors"] == [
        "--modes: 'nope': 'nope' is not an arm; expected any of ('paper', 'uniform', 'lora', 'fp8', "
        "'async'), each optionally followed by +section.field=value",
        "--modes: 'paper+loss.mode': 'loss.mode' is not section.field=value",
        "--modes: 'paper+ppo_epochs=2': 'ppo_epochs=2' is not section.field=value",
        "--modes: 'paper+nosection.x=1': config.nosection is no section of the RL run config",
        "config.loss.mode='nope': must name a registered policy loss (algo.POLICY_LOSSES) or be "
        "'module:function'",
    ]
