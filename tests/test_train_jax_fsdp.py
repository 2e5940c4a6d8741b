"""JAX ``--distributed fsdp``: sharding annotations over one mesh axis, one device's curve, about
1/N of the state per device, orbax checkpoints resumed onto the same mesh (exactly) or another.

Each test is a subprocess on 2 forced CPU devices (the resume test: after the CLI, stopped by
SIGINT), compiled with backend optimisation off (`tests.helpers.specs.FAST_COMPILE`: values unchanged, ~4x
faster), tiny spec, batch 4, dropout on.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.processes import finish, jax_on_two_devices, signal_at_first_checkpoint, start, two_devices_env
from tests.helpers.training import CFG, train_argv

JAX_MESHES = """
import json, sys, jax
from dataclasses import replace
from jax_impl import regime as jregime
from jax_impl import step as jstep
from jax_impl.parallel import make_mesh
from jax_impl.unet import UNet
from shared_configs import load_spec
from shared_configs.training.data import load_dataset
from tests.helpers.training import CFG, SCHEDULE, run_steps
policy, modes = sys.argv[1], sys.argv[2].split(",")
spec, mesh = load_spec("tiny"), make_mesh(CFG.batch_size)
model, tx = UNet(spec=spec, policy=policy), jregime.make_optimizer(CFG.lr, CFG.weight_decay)
state, data = jstep.init_state(model, tx, seed=0), load_dataset("digits", spec)
result = {"devices": len(jax.devices())}
def device_bytes(tree, device):  # the bytes of tree's shards on device
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)
for mode in modes:
    losses, cfg = [], replace(CFG, distributed=None if mode == "single" else mode)
    start = jax.tree.map(lambda a: a.copy(), state)  # each run donates the state it is given
    end = run_steps(start, losses, data, SCHEDULE, cfg, 2, model, tx, mesh=None if mode == "single" else mesh)
    parts = {"params": end.params, "opt_state": end.opt_state}
    bytes_ = {k: [device_bytes(v, d) for d in jax.devices()] for k, v in parts.items()}
    total = {k: sum(a.nbytes for a in jax.tree.leaves(v)) for k, v in parts.items()}
    whole = {k: sum(a.nbytes for a in jax.tree.leaves(v) if a.sharding.is_fully_replicated) for k, v in parts.items()}
    result[mode] = {"losses": losses, "device_bytes": bytes_, "total_bytes": total, "replicated_bytes": whole}
print(json.dumps(result))
"""


@pytest.mark.heavy
def test_jax_data_parallel_and_fsdp_match_one_device() -> None:
    """2 CPU devices, batch split: replicated (ddp) or sharded (fsdp) state gives one device's loss
    curve (dropout on, `balanced` remat), and under fsdp each device holds about half of the params
    and AdamW state. (A second run under `full` was dropped to keep CI short: the same remat path.)"""
    modes = "single,ddp,fsdp"
    result = jax_on_two_devices(JAX_MESHES, "balanced", modes)
    for mode in modes.split(",")[1:]:
        np.testing.assert_allclose(result[mode]["losses"], result["single"]["losses"], rtol=1e-5, err_msg=mode)
    fsdp = result["fsdp"]
    for part, total in fsdp["total_bytes"].items():  # after the steps: jit kept the shardings
        # Each device: half of every sharded leaf, all of the small replicated ones (biases, norm
        # scales, the step count: 5.5% of tiny's bytes, far less of a real model's). About 1/2.
        whole = fsdp["replicated_bytes"][part]
        assert fsdp["device_bytes"][part] == [(total - whole) // 2 + whole] * 2, (part, fsdp, total)
        assert whole <= 0.06 * total, (part, whole, total)
    # the control: replicated state, every device holds all of it
    assert result["ddp"]["device_bytes"]["params"] == [result["ddp"]["total_bytes"]["params"]] * 2


JAX_FSDP_RESUME = """
import json, shutil, sys
from dataclasses import replace
from pathlib import Path
import jax
from jax_impl import train as jtrain
from tests.helpers.training import CFG
out = Path(sys.argv[1])
cfg = replace(CFG, steps=3, checkpoint_every=1, distributed="fsdp")
whole = jtrain.train(replace(cfg, out=str(out / "whole")))
part = json.loads((out / "part" / "losses.json").read_text())  # the CLI's, stopped by SIGINT
shutil.copytree(out / "part", out / "one")
resumed = jtrain.train(replace(cfg, resume=True, out=str(out / "part")))
onto_one = jtrain.train(replace(cfg, resume=True, distributed=None, out=str(out / "one")))
print(json.dumps({"devices": len(jax.devices()), "whole": whole, "part": part, "resumed": resumed, "one": onto_one}))
"""


@pytest.mark.heavy
def test_jax_fsdp_stopped_by_sigint_resumes_on_the_same_mesh_exactly_and_on_one_device(tmp_path: Path) -> None:
    """The CLI stopped by SIGINT after step 1 or 2 writes the sharded state (orbax); restored onto the
    same mesh the curve goes on bit for bit, onto a single device (another sharding) within the
    data-parallel tolerance."""
    cfg = replace(CFG, steps=1000, checkpoint_every=1, distributed="fsdp", out=str(tmp_path / "part"))
    proc = start([sys.executable, "-m", "jax_impl.train", *train_argv(cfg)], two_devices_env())
    signal_at_first_checkpoint(proc, tmp_path / "part", signal.SIGINT)
    code, lines = finish(proc)
    assert (
        code == 130
        and len(lines) == 1
        and lines[0].startswith("python -m jax_impl.train: stopped by SIGINT after step ")
    ), lines
    result = jax_on_two_devices(JAX_FSDP_RESUME, str(tmp_path))
    stopped = len(result["part"])
    assert 1 <= stopped < 3 and f"after step {stopped} of 1000; checkpoint-{stopped:08d} and losses.json" in lines[0]
    assert result["part"] == result["whole"][:stopped]
    assert result["resumed"] == result["whole"]
    assert result["one"][:stopped] == result["part"]
    np.testing.assert_allclose(result["one"], result["whole"], rtol=1e-5)
