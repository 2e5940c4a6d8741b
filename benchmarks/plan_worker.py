"""Profile or measure in one framework: ``python -m benchmarks.plan_worker REQUEST_JSON OUT_PATH``.

Started by `shared_configs.planning.planner` with the environment already set (``XLA_FLAGS`` before jax is
imported); imports exactly one framework's profiler and writes its JSON result to ``OUT_PATH``.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.report import write_json
from shared_configs import spec_from_dict
from shared_configs.defaults import jax_cache_dir
from shared_configs.training.regime import Regime


def run(request: dict[str, Any]) -> dict[str, Any]:
    framework = request["framework"]
    backend = importlib.import_module(f"benchmarks.profile_{framework}")
    if framework == "torch":
        backend.single_threaded()  # JAX: by XLA_FLAGS, set before the import (shared_configs.planning.planner)
    if framework == "jax" and request["kind"] != "profile" and jax_cache_dir() is not None:
        # measured and checked steps persist (a profile reads XLA's dumps: a cache hit would dump nothing)
        import jax

        jax.config.update("jax_compilation_cache_dir", jax_cache_dir())
    spec = spec_from_dict(request["spec"])
    extra: dict[str, Any] = {"regime": Regime(**request["regime"])}
    if framework == "jax":
        extra["attention_chunk"] = request["attention_chunk"]
    if request["kind"] == "profile":
        return backend.profile(
            spec, request["batch_size"], request["context_length"], request["shapes"], request["repeats"], **extra
        )
    if request["kind"] == "peaks":  # nothing allocated: JAX compiled, torch on fake tensors
        return backend.peaks(spec, request["batch_size"], request["policies"], request["context_length"], **extra)
    if request.get("race_to"):  # benchmarks.stepclock.race among the policies that fit
        extra["race_to"] = request["race_to"]
    out = backend.measure(spec, request["batch_size"], request["policies"], request["context_length"],
                          request["steps"], **extra)  # fmt: skip
    if request.get("ratios"):  # torch.compile's activation_memory_budget, in the same process (same `none`)
        compiled = backend.measure_compiled(spec, request["batch_size"], request["ratios"], request["context_length"],
                                            request["steps"])  # fmt: skip
        out["rows"] |= compiled["rows"]
        out["compiled_method"] = compiled["method"]
    return out


def _plain(value: Any) -> Any:
    """JSON-ready: dataclasses (the profile's `Cost`) as dicts."""
    return json.loads(json.dumps(value, default=asdict))


def main(argv: list[str]) -> int:
    write_json(Path(argv[1]), _plain(run(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
