"""The feature registry (``features.toml``): every switch of the train scripts, once.

One entry per switch: its env var, type, default (per setup group), allowed values, the Hydra / vLLM engine
keys it sets and how, the setups it applies to, what it requires or excludes, its patches, modules, tests
and doc. Everything that validates a switch or turns it into overrides goes through this module:

* ``python -m qwen3_rl features overrides --setup SCRIPT [--context NAME=VALUE ...]``: the feature overrides
  of one train script, NUL-separated (``internal/lib/train_common.sh`` reads them into ``overrides``); a bad
  value or a broken rule stops with ONE line on stderr, e.g. ``error: SAM_ENABLE='yes': expected one of
  True, False``, exit 2.
* :func:`check_command` (preflight): the requires / excludes rules on a final command's override map.
* ``qwen3_rl.tools.readme``: the switch table and feature index of docs/features.md.

Values: a bool is ``True`` or ``False`` exactly (every bool, one rule); an empty or unset variable takes
the registry default.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FEATURES_FILE = REPO_ROOT / "features.toml"
TYPES = ("bool", "int", "float", "enum", "str", "list")
_TEMPLATE_RE = re.compile(r"\{([A-Za-z_][A-Za-z_0-9]*)\}")


class FeatureError(ValueError):
    """A bad value, a broken rule or a malformed registry (one-line message)."""


@dataclass(frozen=True)
class Setting:
    """One key a feature sets: ``key=value`` (value: a template), emitted when every ``when`` condition holds."""

    key: str
    value: str
    when: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Rule:
    """``requires``: when the feature has one of ``when``, every ``conds`` must hold.
    ``excludes``: when the feature has one of ``when``, ``conds`` must not all hold."""

    feature: str
    kind: str
    when: tuple[str, ...]
    conds: dict[str, tuple[str, ...]]
    why: str
    pin_sets: tuple[str, ...] = ()  # the pin sets the rule holds on (empty: every set)

    def describe(self) -> str:
        parts = [_cond_text(n, specs) for n, specs in self.conds.items()]
        return " and ".join(parts) + (f" (pin set {'/'.join(self.pin_sets)})" if self.pin_sets else "")

    def applies(self, pin_set: str) -> bool:
        return not self.pin_sets or pin_set in self.pin_sets


@dataclass(frozen=True)
class ContextVar:
    """A value the shell passes (sizes): its type, and the Hydra key preflight reads it from (``also``: keys read
    in order when ``key`` is absent or null, e.g. where another rollout mode carries the same size)."""

    name: str
    type: str
    key: str = ""
    default: str | None = None
    product: tuple[str, ...] = ()
    doc: str = ""
    also: tuple[str, ...] = ()


#: what a feature does on the current pin set (``current = { status, note }`` in features.toml):
#: runs = built and run on the current set's upstream code; config = verl's own key there, composed and accepted by
#: verl 0.9.1's start-up checks in the dry run (tests/trainer/test_verl091_dry_run.py), not run in a training yet;
#: upstream = the current set's upstream does it itself (the switch is not rendered there, with a note); dropped = its
#: mode is gone upstream; pending = not ported yet. A feature in use there (:func:`in_use_on_set`) that is dropped or
#: pending stops ``features overrides`` on that set; only runs / config features are rendered there.
PIN_STATUSES = ("runs", "config", "upstream", "dropped", "pending")
#: the statuses whose keys a non-seed set's command carries
RENDERED_STATUSES = ("runs", "config")
#: resolved values that mean "off" (the feature is not in use)
OFF_VALUES = frozenset({"", "False", "0", "off", "disable", "none"})


@dataclass(frozen=True)
class PinStatus:
    """A feature on one pin set: ``status`` (one of :data:`PIN_STATUSES`), a one-line ``note`` (where / why), and
    optionally ``sets`` (its keys there; None = the seed set's), ``default`` (its default there, replacing
    ``default`` / ``default_for``), ``allowed`` (the only values that set takes; () = all) and ``off`` (the value that
    is that set's upstream's own behaviour: not in use there)."""

    status: str
    note: str
    sets: tuple[Setting, ...] | None = None
    default: str | None = None
    allowed: tuple[str, ...] = ()
    off: str | None = None


@dataclass(frozen=True)
class Feature:
    env: str
    name: str
    type: str
    default: str  # canonical; "" = unset
    default_context: str = ""  # default taken from this context value instead
    default_for: dict[str, str] = field(default_factory=dict)
    allowed: tuple[str, ...] = ()
    min: int | None = None
    setups: tuple[str, ...] = ("all",)
    sets: tuple[Setting, ...] = ()
    requires: tuple[Rule, ...] = ()
    excludes: tuple[Rule, ...] = ()
    patches: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    doc: str = ""
    current: PinStatus | None = None  # the current pin set (the seed set is the registry itself)

    def expected(self) -> str:
        """What a valid value looks like (the second half of the one-line error)."""
        if self.type == "bool":
            return "expected one of True, False"
        if self.type == "enum":
            return "expected one of " + ", ".join(self.allowed)
        if self.type == "int":
            return "expected an integer" + (f" >= {self.min}" if self.min is not None else "") + (
                " or empty" if self.default == "" else "")
        if self.type == "float":
            return "expected a number"
        if self.type == "list":
            return "expected a Hydra list like [8,16,32]"
        return "expected a string"

    def parse(self, raw: str) -> str:
        """The canonical value of ``raw``; :class:`FeatureError` (one line) when it is not valid."""
        bad = FeatureError(f"{self.env}={raw!r}: {self.expected()}")
        if self.type == "bool":
            if raw not in ("True", "False"):
                raise bad
            return raw
        if self.type == "enum":
            if raw not in self.allowed:
                raise bad
            return raw
        if self.type == "int":
            if raw == "" and self.default == "":
                return ""
            if not re.fullmatch(r"-?[0-9]{1,18}", raw):
                raise bad
            if self.min is not None and int(raw) < self.min:
                raise bad
            return str(int(raw))
        if self.type == "float":
            try:
                float(raw)
            except ValueError:
                raise bad from None
            return raw
        if self.type == "list":
            if not re.fullmatch(r"\[[^\[\]]*\]", raw):
                raise bad
            return raw
        return raw


@dataclass(frozen=True)
class Registry:
    groups: dict[str, tuple[str, ...]]
    context: dict[str, ContextVar]
    features: dict[str, Feature]
    non_feature_patches: dict[str, str]

    def setups(self) -> list[str]:
        """Every train script the registry knows (the union of the groups)."""
        return sorted({s for scripts in self.groups.values() for s in scripts})

    def scripts_of(self, feature: Feature) -> list[str]:
        out: set[str] = set()
        for g in feature.setups:
            if g == "all":
                out.update(self.setups())
            elif g in self.groups:
                out.update(self.groups[g])
            else:
                out.add(g)
        return sorted(out)

    def applies(self, feature: Feature, setup: str | None) -> bool:
        """Whether ``feature`` is a switch of ``setup`` (None = an unknown script: every feature applies)."""
        if setup is None or setup not in self.setups():
            return True
        return setup in self.scripts_of(feature)

    def groups_of(self, setup: str) -> list[str]:
        return [g for g, scripts in self.groups.items() if setup in scripts]

    def default(self, feature: Feature, setup: str | None, ctx: Mapping[str, str]) -> str:
        if setup is not None:
            for g in self.groups_of(setup):
                if g in feature.default_for:
                    return feature.default_for[g]
        if feature.default_context:
            return ctx.get(feature.default_context, "")
        return feature.default


def _canon(value: object) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)


def _tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, list):
        return tuple(_canon(v) for v in value)
    return (_canon(value),)


def _conds(raw: object, where: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, dict):
        raise FeatureError(f"{where}: expected a table of conditions")
    return {str(k): _tuple(v) for k, v in raw.items()}


def _rules(env: str, kind: str, raw: object) -> tuple[Rule, ...]:
    out = []
    for i, item in enumerate(raw or []):  # type: ignore[union-attr]
        where = f"feature.{env}.{kind}[{i}]"
        conds = item.get("need" if kind == "requires" else "with")
        if conds is None or "when" not in item:
            raise FeatureError(f"{where}: needs 'when' and '{'need' if kind == 'requires' else 'with'}'")
        pin_sets = _tuple(item["pin_sets"]) if "pin_sets" in item else ()
        if bad := [p for p in pin_sets if p not in _PIN_SET_NAMES]:
            raise FeatureError(f"{where}: pin_sets {bad}: expected names of {', '.join(_PIN_SET_NAMES)}")
        out.append(Rule(env, kind, _tuple(item["when"]), _conds(conds, where), str(item.get("why", "")), pin_sets))
    return tuple(out)


def _seam_key(env: str, sets: tuple[Setting, ...]) -> str | None:
    """The ``qwen3_rl.<feature>.<key>`` a switch sets with its own value (the verl seam's config group), if any:
    ``key={value}``, or, for a switch whose one setting is ``qwen3_rl.<feature>.enable=True`` only while the
    switch is True (the key stays out of the command while off), that ``enable`` key."""
    for s in sets:
        key = s.key.lstrip("+")
        if key.startswith("qwen3_rl.") and s.value == "{value}":
            return key
    if len(sets) == 1:
        s = sets[0]
        key = s.key.lstrip("+")
        if key.startswith("qwen3_rl.") and key.endswith(".enable") and s.value == "True" and s.when == {env: ("True",)}:
            return key
    return None


def _seam_default(env: str, key: str) -> object:
    """The default of a seam key: the field default of its dataclass in :mod:`qwen3_rl.trainer.seam`."""
    from qwen3_rl.trainer.seam import feature_defaults

    defaults = feature_defaults()
    if key not in defaults:
        raise FeatureError(f"feature.{env}: {key} is not a key of the qwen3_rl config group "
                           f"(qwen3_rl.trainer.seam.FEATURES)")
    return defaults[key][0]


_PIN_SET_NAMES = ("seed", "current")  # the sets a feature declares: its own keys (seed), its `current` table
_FEATURE_KEYS = {"name", "type", "default", "default_for", "allowed", "min", "setups", "sets", "requires", "excludes",
                 "patches", "modules", "tests", "doc", "current"}


_PIN_KEYS = {"status", "note", "sets", "default", "allowed", "off"}


def _pin_status(env: str, raw: object) -> PinStatus:
    if not isinstance(raw, dict) or not {"status", "note"} <= set(raw) <= _PIN_KEYS:
        raise FeatureError(f"feature.{env}: current must be {{ status = ..., note = ... }} (optional: sets, default, "
                           f"allowed, off), got {raw!r}")
    if raw["status"] not in PIN_STATUSES:
        raise FeatureError(f"feature.{env}: current.status must be one of {', '.join(PIN_STATUSES)}, "
                           f"got {raw['status']!r}")
    note = str(raw["note"]).strip()
    if not note or "\n" in note:
        raise FeatureError(f"feature.{env}: current.note must be one non-empty line")
    sets = None
    if "sets" in raw:
        sets = tuple(Setting(str(s["key"]), _canon(s["value"]), _conds(s.get("when", {}), f"feature.{env}.current.sets"))
                     for s in raw["sets"])
    return PinStatus(str(raw["status"]), note, sets, _canon(raw["default"]) if "default" in raw else None,
                     tuple(_canon(a) for a in raw.get("allowed", [])), _canon(raw["off"]) if "off" in raw else None)


def _feature(env: str, raw: dict) -> Feature:
    unknown = set(raw) - _FEATURE_KEYS
    if unknown:
        raise FeatureError(f"feature.{env}: unknown field(s) {sorted(unknown)}")
    typ = raw.get("type")
    if typ not in TYPES:
        raise FeatureError(f"feature.{env}: type must be one of {', '.join(TYPES)}, got {typ!r}")
    sets = tuple(Setting(str(s["key"]), _canon(s["value"]), _conds(s.get("when", {}), f"feature.{env}.sets"))
                 for s in raw.get("sets", []))
    seam_key = _seam_key(env, sets)
    if seam_key is not None and "default" in raw:
        raise FeatureError(f"feature.{env}: sets {seam_key}, whose default is declared in qwen3_rl.trainer.seam; "
                           "drop 'default' here")
    default = raw.get("default", "") if seam_key is None else _seam_default(env, seam_key)
    default_context = ""
    if isinstance(default, dict):
        default_context, default = str(default["context"]), ""
    f = Feature(env=env, name=str(raw.get("name", env)), type=typ, default=_canon(default),
                default_context=default_context,
                default_for={str(k): _canon(v) for k, v in raw.get("default_for", {}).items()},
                allowed=tuple(str(a) for a in raw.get("allowed", [])), min=raw.get("min"),
                setups=tuple(raw.get("setups", ["all"])), sets=sets,
                requires=_rules(env, "requires", raw.get("requires")),
                excludes=_rules(env, "excludes", raw.get("excludes")),
                patches=tuple(raw.get("patches", [])), modules=tuple(raw.get("modules", [])),
                tests=tuple(raw.get("tests", [])), doc=str(raw.get("doc", "")),
                current=_pin_status(env, raw["current"]) if "current" in raw else None)
    if typ == "enum" and not f.allowed:
        raise FeatureError(f"feature.{env}: an enum needs 'allowed'")
    for value in (f.default, *f.default_for.values()):  # defaults pass the same validation as the env (""= unset)
        if value != "":
            f.parse(value)
    cur = f.current
    if cur is not None:
        for value in (v for v in (cur.default, cur.off, *cur.allowed) if v is not None):
            f.parse(value)
        if cur.allowed and cur.default is not None and cur.default not in cur.allowed:
            raise FeatureError(f"feature.{env}: current.default {cur.default!r} is not in current.allowed")
    return f


def load_registry(path: str | os.PathLike[str] | None = None) -> Registry:
    """Read and check ``features.toml``: types, defaults, and that every name a condition, rule or template
    uses is a feature or a context value."""
    p = Path(path) if path is not None else FEATURES_FILE
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise FeatureError(f"{p.name}: {exc}") from exc
    if data.get("schema") != 1:
        raise FeatureError(f"{p.name}: schema must be 1")
    groups = {str(g): tuple(v) for g, v in data.get("groups", {}).items()}
    context = {n: ContextVar(n, str(c.get("type", "str")), str(c.get("key", "")),
                             None if "default" not in c else _canon(c["default"]), tuple(c.get("product", [])),
                             str(c.get("doc", "")), tuple(c.get("also", [])))
               for n, c in data.get("context", {}).items()}
    features = {env: _feature(env, raw) for env, raw in data.get("feature", {}).items()}
    reg = Registry(groups, context, features, {str(k): str(v) for k, v in data.get("non_feature_patches", {}).items()})
    names = set(features) | set(context)
    for f in features.values():
        for g in f.setups:
            if g != "all" and g not in groups and not g.endswith(".sh"):
                raise FeatureError(f"feature.{f.env}: unknown setup group {g!r}")
        for g in f.default_for:
            if g not in groups:
                raise FeatureError(f"feature.{f.env}: default_for names unknown group {g!r}")
        refs = [n for s in (*f.sets, *((f.current.sets or ()) if f.current else ()))
                for n in (*s.when, *_TEMPLATE_RE.findall(s.value))]
        refs += [n for r in (*f.requires, *f.excludes) for n in r.conds]
        refs += [spec[1:] for r in (*f.requires, *f.excludes) for specs in r.conds.values() for spec in specs
                 if spec.startswith("=")]
        if f.default_context:
            refs.append(f.default_context)
        for n in refs:
            if n != "value" and n not in names:
                raise FeatureError(f"feature.{f.env}: unknown name {n!r} (not a feature or context value)")
    return reg


# ---- conditions ---------------------------------------------------------------------------------------
def _cond_text(name: str, specs: tuple[str, ...]) -> str:
    def one(spec: str) -> str:
        if spec.startswith("!"):
            return f"{name} not {spec[1:] or 'empty'}"
        if spec.startswith(">"):
            return f"{name} > {spec[1:]}"
        if spec.startswith("="):
            return f"{name} == {spec[1:]}"
        return f"{name}={spec}"
    return " or ".join(one(s) for s in specs)


def _holds(spec: str, actual: str | None, lookup: Callable[[str], str | None]) -> bool:
    if actual is None:
        return False
    if spec.startswith("!"):
        return actual != spec[1:]
    if spec.startswith(">"):
        return bool(re.fullmatch(r"-?[0-9]+", actual)) and int(actual) > int(spec[1:])
    if spec.startswith("="):
        other = lookup(spec[1:])
        return other is not None and actual == other
    return actual == spec


def _all_hold(conds: Mapping[str, tuple[str, ...]], lookup: Callable[[str], str | None]) -> bool:
    return all(any(_holds(s, lookup(n), lookup) for s in specs) for n, specs in conds.items())


def rule_violations(reg: Registry, values: Mapping[str, str | None], pin_set: str = "seed") -> list[str]:
    """One line per broken requires / excludes rule of ``pin_set``, in registry order (``values``: features and
    context; None = the feature does not apply or is unknown)."""
    out = []
    for f in reg.features.values():
        mine = values.get(f.env)
        if mine is None:
            continue
        for r in (*f.requires, *f.excludes):
            if not r.applies(pin_set) or not any(_holds(w, mine, values.get) for w in r.when):
                continue
            held = _all_hold(r.conds, values.get)
            if r.kind == "requires" and not held:
                names = list(dict.fromkeys([*r.conds, *(s[1:] for v in r.conds.values() for s in v
                                                       if s.startswith("="))]))
                got = ", ".join(f"{n}={values.get(n) if values.get(n) is not None else '(n/a)'}" for n in names)
                out.append(f"{f.env}={mine} requires {r.describe()} (got {got}): {r.why}")
            elif r.kind == "excludes" and held:
                out.append(f"{f.env}={mine} excludes {r.describe()}: {r.why}")
    return out


# ---- resolving a setup's features ---------------------------------------------------------------------
def parse_context(reg: Registry, pairs: list[str]) -> dict[str, str]:
    ctx: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in reg.context:
            raise FeatureError(f"--context {pair!r}: expected NAME=VALUE with NAME one of {', '.join(reg.context)}")
        cv = reg.context[name]
        if cv.type == "int" and not re.fullmatch(r"[0-9]{1,12}", value):
            raise FeatureError(f"{name}={value!r}: expected a non-negative integer")
        ctx[name] = str(int(value)) if cv.type == "int" else value
    return _derive_context(reg, ctx)


def _derive_context(reg: Registry, ctx: dict[str, str]) -> dict[str, str]:
    for name, cv in reg.context.items():
        if cv.product and all(ctx.get(p) not in (None, "") for p in cv.product):
            prod = 1
            for p in cv.product:
                prod *= int(ctx[p])
            ctx[name] = str(prod)
        elif name not in ctx and cv.default is not None:
            ctx[name] = cv.default
    return ctx


def resolve(reg: Registry, setup: str, env: Mapping[str, str], ctx: Mapping[str, str],
            notes: list[str] | None = None, pin_set: str = "seed") -> dict[str, str | None]:
    """Every feature's value for ``setup``: the env var (empty or unset = default; on a non-seed set its
    ``current.default`` when declared), validated; None where the feature does not apply to the setup. Raises
    :class:`FeatureError` at the first bad value, or at a value the set does not take (``current.allowed``)."""
    values: dict[str, str | None] = dict(ctx)
    for f in reg.features.values():
        raw = env.get(f.env, "")
        if not reg.applies(f, setup):
            values[f.env] = None
            if raw and notes is not None:
                notes.append(f"note: {f.env}={raw} does not apply to {setup} (setups: {', '.join(f.setups)}); "
                             "ignored")
            continue
        cur = f.current if pin_set != "seed" else None
        if raw != "":
            values[f.env] = f.parse(raw)
            if cur is not None and cur.allowed and values[f.env] not in cur.allowed:
                raise FeatureError(f"{f.env}={values[f.env]} on pin set {pin_set}: it takes only "
                                   f"{', '.join(cur.allowed)}: {cur.note}")
        elif cur is not None and cur.default is not None:
            values[f.env] = cur.default
        else:
            values[f.env] = reg.default(f, setup, ctx)
    return values


def _render_sets(f: Feature, sets: tuple[Setting, ...], values: Mapping[str, str | None]) -> list[str]:
    out = []
    for s in sets:
        if not _all_hold(s.when, values.get):
            continue
        val = _TEMPLATE_RE.sub(lambda m, f=f: str(values.get(f.env) if m.group(1) == "value"
                                                  else values.get(m.group(1), "")), s.value)
        out.append(f"{s.key}={val}")
    return out


def render(reg: Registry, values: Mapping[str, str | None], pin_set: str = "seed") -> list[str]:
    """The Hydra overrides of the resolved features, in registry order. On a non-seed set only the features whose
    status there is in :data:`RENDERED_STATUSES`, with their keys there (``current.sets``, else the seed's)."""
    out = []
    for f in reg.features.values():
        if values.get(f.env) is None:
            continue
        if pin_set == "seed":
            out += _render_sets(f, f.sets, values)
        elif f.current is not None and f.current.status in RENDERED_STATUSES:
            if f.current.sets is not None:
                out += _render_sets(f, f.current.sets, values)
            else:  # the seed keys, but not the seed set's verl seam (patch verl/0013: seed set only)
                out += [o for o in _render_sets(f, f.sets, values) if not _is_seam_key(o)]
    return out


def _is_seam_key(override: str) -> bool:
    """Whether an override sets a key of the seed set's verl seam config group (``qwen3_rl.*``)."""
    return override.lstrip("+").startswith("qwen3_rl.")


def in_use(value: str | None) -> bool:
    """Whether a resolved feature value switches its feature on (None: the feature does not apply)."""
    return value is not None and value not in OFF_VALUES


def _seam_enables(reg: Registry, values: Mapping[str, str | None]) -> dict[str, str]:
    """``qwen3_rl.<group>.enable`` -> its value in the seed set's rendering of ``values``."""
    out = {}
    for o in render(reg, values):
        key, _, val = o.lstrip("+").partition("=")
        if key.startswith("qwen3_rl.") and key.endswith(".enable"):
            out[key] = val
    return out


def in_use_on_set(f: Feature, values: Mapping[str, str | None], enables: Mapping[str, str]) -> bool:
    """Whether ``f`` is in use on a non-seed set: its value is on (:func:`in_use`, and not the set's ``current.off``)
    and it emits at least one of its seed keys (their ``when`` hold), not counting a key ``qwen3_rl.<group>.<x>``
    whose group's ``enable`` (``enables``: :func:`_seam_enables`) is not True: a parameter of a feature that is off."""
    value = values.get(f.env)
    if not in_use(value) or (f.current is not None and f.current.off == value):
        return False
    for s in f.sets:
        parts = s.key.lstrip("+").split(".")
        param_of_off = (len(parts) == 3 and parts[0] == "qwen3_rl" and parts[2] != "enable"
                        and enables.get(f"qwen3_rl.{parts[1]}.enable", "True") != "True")
        if _all_hold(s.when, values.get) and not param_of_off:
            return True
    return False


def pin_set_problems(reg: Registry, values: Mapping[str, str | None], pin_set: str) -> tuple[list[str], list[str]]:
    """The features in use (:func:`in_use_on_set`) that ``pin_set`` cannot run (errors: dropped or pending there, or
    no status; or runs / config there without ``current.sets`` while their seed keys are the verl seam's, which is
    not on that set) and those its upstream does itself (notes: not rendered there). The seed set: none."""
    errors: list[str] = []
    notes: list[str] = []
    if pin_set == "seed":
        return errors, notes
    enables = _seam_enables(reg, values)
    for f in reg.features.values():
        st = f.current or PinStatus("pending", "no status declared")
        if not in_use_on_set(f, values, enables):
            continue
        if st.status in RENDERED_STATUSES:
            if st.sets is None and any(_is_seam_key(o) for o in _render_sets(f, f.sets, values)):
                errors.append(f"{f.env}={values[f.env]} on pin set {pin_set}: {st.status}, but not in the train "
                              f"scripts there (no current.sets; its keys are the seed set's verl seam): {st.note}")
            continue
        line = f"{f.env}={values[f.env]} on pin set {pin_set}: {st.status}: {st.note}"
        (notes if st.status == "upstream" else errors).append(line)
    return errors, notes


def setup_overrides(setup: str, env: Mapping[str, str], context: list[str],
                    reg: Registry | None = None, notes: list[str] | None = None) -> list[str]:
    """Validate the features of ``setup`` (a train script name) from ``env`` and return their overrides; on the
    current pin set (``PIN_SET`` in ``env``) a feature in use that the set cannot run stops it (one line)."""
    from qwen3_rl.tools.pins import PinError, resolve_pin_set

    reg = reg or load_registry()
    if setup not in reg.setups():
        raise FeatureError(f"--setup {setup!r}: not a setup of features.toml (one of {', '.join(reg.setups())}); "
                           "a copied train script passes the setup it is based on: train_add_feature_overrides SETUP")
    try:
        pin_set = resolve_pin_set(env=env)
    except PinError as exc:
        raise FeatureError(str(exc)) from exc
    ctx = parse_context(reg, context)
    values = resolve(reg, setup, env, ctx, notes, pin_set)
    broken = rule_violations(reg, values, pin_set)
    if broken:
        raise FeatureError(broken[0])
    errors, upstream = pin_set_problems(reg, values, pin_set)
    if errors:
        raise FeatureError(errors[0] + (f" (and {len(errors) - 1} more: python -m qwen3_rl features status "
                                        f"--pin-set {pin_set})" if len(errors) > 1 else ""))
    if notes is not None:
        notes += [f"note: {n}; not rendered" for n in upstream]
    return render(reg, values, pin_set)


# ---- preflight: the rules on a final command ----------------------------------------------------------
def _normal(f: Feature, raw: str) -> str:
    raw = raw.strip().strip("'\"")
    if f.type == "bool":
        return "True" if raw.lower() in ("true", "1", "yes") else "False" if raw.lower() in ("false", "0", "no") else raw
    if f.type == "int" and re.fullmatch(r"-?[0-9]+", raw):
        return str(int(raw))
    return raw


def values_from_overrides(reg: Registry, vals: Mapping[str, str], setup: str | None,
                          pin_set: str = "seed") -> dict[str, str | None]:
    """The features' values a final command implies (override map without ``+``; hand-written Hydra arguments
    included): a key set to ``{value}`` gives the value; a key a feature sets to a fixed value only for one value
    of its own gives that value; otherwise the setup's default. Context values from their keys. On a non-seed
    ``pin_set`` a feature's keys are its ``current.sets`` when declared (the keys :func:`render` writes there; the
    seed's may mean something else there) and its default the set's ``current.default`` when declared."""
    ctx: dict[str, str] = {}
    for name, cv in reg.context.items():
        for key in (cv.key, *cv.also) if cv.key else ():
            raw = vals[key].strip().strip("'\"") if key in vals else ""
            if raw not in ("", "null", "None", "~"):
                ctx[name] = raw
                break
    ctx = _derive_context(reg, ctx)
    values: dict[str, str | None] = dict(ctx)

    def keys_of(f: Feature) -> tuple[Setting, ...]:
        cur = f.current if pin_set != "seed" else None
        return cur.sets if cur is not None and cur.sets is not None else f.sets

    # a fixed-value key that several switches set (the current set's worker_cls: SAM and gc control) implies none
    setters: dict[str, set[str]] = {}
    for f in reg.features.values():
        for s in keys_of(f):
            if s.value != "{value}":
                setters.setdefault(s.key.lstrip("+"), set()).add(f.env)
    shared = {k for k, envs in setters.items() if len(envs) > 1} if pin_set != "seed" else set()
    for f in reg.features.values():
        if not reg.applies(f, setup):
            values[f.env] = None
            continue
        cur = f.current if pin_set != "seed" else None
        found: str | None = None
        for s in keys_of(f):
            key = s.key.lstrip("+")
            if key not in vals or (key in shared and s.value != "{value}"):
                continue
            if s.value == "{value}":
                found = _normal(f, vals[key])
                break
            own = s.when.get(f.env)  # a fixed value set only for one value of the feature's own
            if own and len(own) == 1 and own[0][:1] not in ("!", ">", "=") and not _TEMPLATE_RE.search(s.value) \
                    and _normal(f, vals[key]) == _normal(f, s.value):
                found = own[0]
                break
        if found is None:
            found = cur.default if cur is not None and cur.default is not None else reg.default(f, setup, ctx)
        values[f.env] = found
    return values


def check_command(vals: Mapping[str, str], setup: str | None = None, reg: Registry | None = None,
                  pin_set: str = "seed") -> list[str]:
    """The requires / excludes rules on a final command's override map (one message per broken rule), its
    switches read back from the keys of ``pin_set``."""
    reg = reg or load_registry()
    return rule_violations(reg, values_from_overrides(reg, vals, setup, pin_set), pin_set)


# ---- CLI ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen3_rl features", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("overrides", help="the feature overrides of a train script, NUL-separated")
    o.add_argument("--setup", required=True, help="train script name (internal/train_*.sh)")
    o.add_argument("--context", action="append", default=[], metavar="NAME=VALUE",
                   help="a size the shell knows (VLLM_DP, ROLLOUT_TP, TRAIN_BATCH_SIZE, ...)")
    sub.add_parser("list", help="every feature: env var, type, default, setups")
    st = sub.add_parser("status", help="every feature on a pin set: runs, config, upstream, dropped or pending, and why")
    st.add_argument("--pin-set", default="current", choices=["current"], help="the pin set (default: current)")
    a = ap.parse_args(argv)
    try:
        reg = load_registry()
        if a.cmd == "list":
            for f in reg.features.values():
                print(f"{f.env}\t{f.type}\t{f.default or f.default_context}\t{','.join(f.setups)}")
            return 0
        if a.cmd == "status":
            for f in reg.features.values():
                cur = f.current or PinStatus("pending", "no status declared")
                print(f"{f.env}\t{cur.status}\t{cur.note}")
            return 0
        notes: list[str] = []
        out = setup_overrides(a.setup, os.environ, a.context, reg, notes)
    except FeatureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for n in notes:
        print(n, file=sys.stderr)
    sys.stdout.write("".join(f"{o}\0" for o in out))
    return 0
