"""YAML at the edge: load a preset or a file into a validated `UNetSpec`."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml
from pydantic import BaseModel, ValidationError

from shared_configs.spec import SpecError, UNetSpec
from shared_configs.vocabulary import resolve_plan

PRESET_DIR = Path(__file__).resolve().parent
M = TypeVar("M", bound=BaseModel)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-5`` as a float (YAML 1.2), not a string the strict spec would refuse."""


_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789"))


def preset_names() -> list[str]:
    """Names of the bundled presets (``shared_configs/<name>.yaml``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_spec(name_or_path: str | Path) -> UNetSpec:
    """Load a spec from a preset name (``"tiny"``) or a YAML file path."""
    path = _resolve(name_or_path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path.name}: expected a mapping of spec fields, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    return spec_from_dict(data)


def read_yaml(path: Path) -> Any:
    """``path``'s YAML (1.2 floats); malformed YAML is a one-line `SpecError`."""
    try:
        return yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SpecError(f"{path.name}: malformed YAML{where}: {getattr(err, 'problem', err)}") from None


def validated(model: type[M], data: Any) -> M:
    """``model`` of ``data``; any problem is a one-line `SpecError` naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise SpecError(_one_line(err, model)) from None


def spec_from_dict(data: dict[str, Any]) -> UNetSpec:
    """Validate a plain dict (the ``checkpoint`` policy too); any problem is a one-line `SpecError` naming the field."""
    spec = validated(UNetSpec, data)
    if spec.checkpoint is not None:
        try:
            resolve_plan(spec, spec.checkpoint)
        except SpecError as err:
            raise SpecError(f"checkpoint: {str(err).removeprefix('policy: ')}") from None
    return spec


def _one_line(err: ValidationError, root: type[BaseModel]) -> str:
    """The first problem in one line; an unknown field first, with its nearest name and any missing field beside it."""
    errors = err.errors()
    if unknown := [e for e in errors if e["type"] == "extra_forbidden"]:
        missing = [_where(e) for e in errors if e["type"] == "missing"]
        return _unknown(unknown[0], root) + (f"; missing: {', '.join(missing)}" if missing else "")
    first = errors[0]
    msg, loc = first["msg"].removeprefix("Value error, "), _where(first)
    if loc and re.match(r"^\w+: ", msg):  # a nested model's own check names its field: join the paths
        return f"{loc}.{msg}"
    return f"{loc}: {msg}" if loc else msg


def _where(error: Any) -> str:
    # pydantic names the member of a union it tried (``int``, ``tuple[int, ...]``) in an error's location
    tags = {"int", "float", "bool", "str", "none"}
    return ".".join(str(p) for p in error["loc"] if not (isinstance(p, str) and (p in tags or "[" in p)))


def _unknown(error: Any, root: type[BaseModel]) -> str:
    """``colour: unknown field 'colour' (did you mean 'color'?; allowed: ...)``."""
    fields = sorted(_model_at(root, error["loc"][:-1]).model_fields)
    name = str(error["loc"][-1])
    near = difflib.get_close_matches(name, fields, n=1)
    hint = f"did you mean {near[0]!r}?; " if near else ""
    return f"{_where(error)}: unknown field {name!r} ({hint}allowed: {', '.join(fields)})"


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel]:
    """The (nested) model class under ``model`` that owns the fields at ``loc``."""
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        for candidate in (annotation, *get_args(annotation)):  # `Spec | None` too
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
    return model


def _resolve(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix in {".yaml", ".yml"} or path.exists():
        if not path.is_file():
            raise SpecError(f"config: file not found: {path}")
        return path
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if not preset.is_file():
        raise SpecError(f"config: unknown preset {str(name_or_path)!r} (allowed: {', '.join(preset_names())})")
    return preset
