"""The vocabulary of settings: strict pydantic types with one message each (``<key> must be <what>,
got <value>``), the :class:`Settings` base of every section's schema, and the reading of a composed
config into them. Strings are never numbers here, nor bools ints.
"""

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    create_model,
)
from pydantic_core import PydanticCustomError

SEED_MAX = 2**32 - 1  # numpy's (and Lightning's seed_everything's) bound
STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)


def must(what: str | Callable[[], str]) -> WrapValidator:
    """Any failure of the value's checks becomes one error, ``must be <what>`` (a callable: read late)."""

    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("must", "must be {what}", {"what": check.what()}) from None

    check.what = what if callable(what) else lambda: what
    return WrapValidator(check)


def nullable(alias: Any) -> Any:
    """``alias`` (a type made with :func:`must`) or null."""
    return Annotated[alias | None, must(lambda: f"{alias.__metadata__[-1].func.what()} or null")]


def one_of(options: Iterable[str] | Callable[[], Iterable[str]]) -> Any:
    """One of the names; a callable is read at check time (a registry plug-ins may add to)."""
    listed = options if callable(options) else lambda: tuple(options)

    def known(value: str) -> str:
        if value not in listed():
            raise ValueError(value)
        return value

    return Annotated[str, AfterValidator(known), must(lambda: "one of " + ", ".join(map(repr, listed())))]


def non_empty(what: str) -> AfterValidator:
    """A list with at least one item (each item checked first, by its own key)."""

    def check(value: list) -> list:
        if not value:
            raise PydanticCustomError("must", "must be {what}", {"what": what})
        return value

    return AfterValidator(check)


def at_least(low: int) -> Any:
    """An int (not a bool, not a float such as 2.0) >= ``low``."""
    return Annotated[int, Field(ge=low), must(f"an int >= {low}")]


def as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # YAML gives lists


def listed(item: Any) -> Any:
    """A non-empty list of ``item``, kept as a tuple (hashable, and equal from YAML or Python)."""
    return Annotated[tuple[item, ...], BeforeValidator(as_tuple), Field(min_length=1)]


@dataclass(frozen=True)
class Bound:
    other: str
    or_equal: bool


def below(alias: Any, other: str, or_equal: bool = False) -> Any:
    """``alias`` bounded above by a sibling setting or a run config key (:func:`bound_problems`)."""
    return Annotated[alias, Bound(other, or_equal)]


TAG = "kind:"


def kind(pick: Callable[[Any], str], **kinds: Any) -> Any:
    """A value of the kind ``pick(value)`` names: only its checks apply, so a message names its own key."""
    members = [Annotated[t, Tag(TAG + name)] for name, t in kinds.items()]
    return Annotated[Union[tuple(members)], Discriminator(lambda v: TAG + pick(v))]  # noqa: UP007


Finite = Annotated[float, Field(allow_inf_nan=False)]
Number = Annotated[Finite, must("a number")]
NonNegative = Annotated[Finite, Field(ge=0), must("a number >= 0")]
Positive = Annotated[Finite, Field(gt=0), must("a positive number")]
Fraction = Annotated[Finite, Field(gt=0, le=1), must("a number in (0, 1]")]
PositiveInt = at_least(1)
Count = at_least(0)
Seed = Annotated[int, Field(ge=0, le=SEED_MAX), must(f"an int in [0, {SEED_MAX}]")]
Flag = Annotated[bool, must("true or false")]
Text = Annotated[str, must("a string")]
NonEmpty = Annotated[str, Field(pattern=r"\S")]
Beta = Annotated[Finite, Field(ge=0, lt=1)]
Layer = Annotated[int, Field(ge=1)]  # 1-based
# What select_layers takes: the last N layers, "half", "all", or a list of 1-based layers.
Layers = Annotated[
    Layer | Annotated[str, Field(pattern=r"(?i)^\s*(half|all|\d+)\s*$")] | listed(Layer),
    must("an int >= 1, 'half', 'all' or a list of 1-based layers"),
]


class Settings(BaseModel):
    """A section the code owns: strict types, no unknown key; a field's docstring is its help."""

    model_config = STRICT


class Open(Settings):
    """A section Hydra instantiates: the keys named here are checked, the others are the class's."""

    model_config = ConfigDict(extra="allow")


def parse(cls: type[BaseModel], values: Any, section: str) -> Any:
    """``values`` (a mapping, an instance or None) as ``cls``; one ``ValueError`` names each bad key."""
    if isinstance(values, cls):
        return values
    try:
        if isinstance(values, DictConfig):  # strict: OmegaConf's lists are not lists
            values = OmegaConf.to_container(values, resolve=True)
        return cls.model_validate(dict(values or {}))
    except ValidationError as err:
        raise ValueError("; ".join(message(cls, e, section, "") for e in err.errors())) from None


def _dotted(*parts: Any) -> str:
    return ".".join(str(p) for p in parts if p != "")


def _fields(schema: Any) -> dict[str, Any]:
    return {name: f.annotation for name, f in schema.model_fields.items()}


def inner_model(hint: Any) -> tuple[type | None, str]:
    """``(the model inside an annotation, how it is held: "" one, "[]" a list, ".<name>" a mapping)``."""
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        return hint, ""
    origin = get_origin(hint)
    for arg in get_args(hint):
        model, held = inner_model(arg)
        if model is not None:
            return model, "[]" if origin is list else ".<name>" if origin is dict else held
    return None, ""


def _section_at(schema: Any, path: tuple) -> Any:
    """The section at ``path`` under ``schema``."""
    for part in path:
        if not isinstance(part, int):
            schema = inner_model(_fields(schema)[part])[0]
    return schema


def message(schema: Any, error: dict, prefix: str, owner: str) -> str:
    loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p.startswith(TAG)))  # kind(): no key
    key = _dotted(prefix, *loc)
    if error["type"] == "problems":  # a validator's own messages, keys included
        return error["msg"]
    if error["type"] == "must":
        return f"{key} {error['msg']}, got {error['input']!r}"
    if error["type"] == "extra_forbidden":
        section = _section_at(schema, loc[:-1])
        if new := getattr(section, "moved", {}).get(loc[-1]):  # a key of before, and its place now
            return f"{key} was moved to {_dotted(prefix, *loc[:-1], new)}"
        known = ", ".join(sorted(_fields(section)))
        return f"{key} is not a setting of {_dotted(owner or prefix, *loc[:-1])} (known: {known})"
    if error["type"] == "missing":
        return f"{key} must be set"
    return f"{key}: {error['msg']}, got {error['input']!r}"


def raise_problems(found: list[str]) -> None:
    """From a validator: its messages, each naming its key, as they are (:func:`message`)."""
    if found:
        raise ValidationError.from_exception_data("problems", [
            {"type": PydanticCustomError("problems", "{text}", {"text": f}), "loc": (), "input": None} for f in found])


def problems(schema: Any, values: Any, prefix: str = "", owner: str = "") -> list[str]:
    """Every value ``schema`` refuses, named by its dotted key under ``prefix``."""
    try:
        TypeAdapter(schema).validate_python(values, strict=True)
    except ValidationError as err:
        return [message(schema, e, prefix, owner) for e in err.errors()]
    return []


def plain(node: Any, missing: list[str], key: str = "") -> Any:
    """``node`` as plain dicts and lists, resolved; ``???`` (key added to ``missing``) and ``${hydra:}`` left out."""
    if not isinstance(node, (DictConfig, ListConfig)):
        return node
    is_dict = isinstance(node, DictConfig)
    out = {}
    for part in node.keys() if is_dict else range(len(node)):
        where = _dotted(key, part)
        if OmegaConf.is_missing(node, part):
            missing.append(where)
            continue
        try:
            out[part] = plain(node[part], missing, where)
        except OmegaConfBaseException:  # not resolvable outside the run: not a value checked here
            continue
    return out if is_dict else list(out.values())


def lookup(values: Any, key: str) -> Any:
    """The value at a dotted key of plain ``values`` or of a parsed config, or None."""
    for part in key.split("."):
        if isinstance(values, list) and part.isdigit():
            values = values[int(part)] if int(part) < len(values) else None
        elif isinstance(values, BaseModel):
            values = getattr(values, part, None)
        else:
            values = values.get(part) if isinstance(values, dict) else None
    return values


def settings_model(target: Callable, skip: Iterable[str] = ()) -> type[BaseModel]:
    """A class's ``__init__`` settings (or a function's keyword arguments) as a :class:`Settings` model."""
    fn = target.__init__ if isinstance(target, type) else target
    params = list(inspect.signature(fn).parameters.values())
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    # a function's options: its keyword-only arguments and those with a default
    params = params[1:] if isinstance(target, type) else [
        p for p in params if p.kind is p.KEYWORD_ONLY or p.default is not p.empty]
    try:
        hints = get_type_hints(fn, include_extras=True)
    except NameError:  # an annotation only a type checker resolves: those settings go unchecked
        hints = {}
    fields = {p.name: (hints.get(p.name, Any), ... if p.default is p.empty else p.default)
              for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in skip}
    # **kwargs: what it does not name is its own to check
    model = create_model(getattr(target, "__name__", "Options"), __base__=Open if takes_any else Settings, **fields)
    model.moved = getattr(target, "moved", {})  # {a key of before: where it is now}: message() names it
    return model


def help_of(field: Any) -> str:
    """A setting's help: its docstring, else the ``Doc("...")`` (PEP 727) of its annotation."""
    doc = next((m.documentation for m in field.metadata if hasattr(m, "documentation")), "")
    return " ".join((field.description or doc).split())


def bound_problems(settings: BaseModel, prefix: str, run: dict) -> list[str]:
    """The bounds (:func:`below`) one setting takes from another value."""
    found = []
    for name, field in type(settings).model_fields.items():
        for bound in (m for m in field.metadata if isinstance(m, Bound)):
            sibling = "." not in bound.other
            limit = getattr(settings, bound.other) if sibling else lookup(run, bound.other)
            value, other = getattr(settings, name), _dotted(prefix if sibling else "", bound.other)
            if isinstance(limit, (int, float)) and (value > limit or (value == limit and not bound.or_equal)):
                found.append(f"{prefix}.{name} must be {'<=' if bound.or_equal else 'less than'} "
                             f"{other} ({limit!r}), got {value!r}")
    return found

