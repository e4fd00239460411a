"""Composing and checking the Hydra configuration of the app, from the command line or from code.

The configs ship inside the package: ``conf/`` as ``lightning_stale.conf`` (the primary config
``train`` and its groups) and ``recipes/`` as ``lightning_stale.recipes`` (ready-made runs whose
defaults list starts from ``train``). ``compose_config`` finds either kind by name, and
``validate_config`` rejects bad combinations before any data is loaded or any process started.

A config is either one run (``race=none``: ``variant`` on ``engine``) or a race (the default,
``race.contestants`` non-empty): several runs in one launch that differ only in variant, K and
engine (and any per-contestant ``overrides``). `contestant_configs` expands a race into the
single-run config of each contestant, which is validated like any single run.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any, cast

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from lightning_stale.method.variants import VARIANT_NAMES, Variant

CONF_PACKAGE = "lightning_stale.conf"
RECIPES_PACKAGE = "lightning_stale.recipes"
ENGINE_NAMES = ("server", "simulated", "ddp")
# How each engine is named in errors; the ones not listed are called by their config name.
_NO_DELAY_TARGETS = ("lightning_stale.delays.NoDelay",)
# The engines a race contestant may name, by the run's engine: every contestant of one launch
# must run in the same processes (server and ddp both use Lightning's launcher with P processes;
# the simulated engine is one process).
RACE_ENGINES = {"server": ("server", "ddp"), "ddp": ("server", "ddp"), "simulated": ("simulated",)}
CONTESTANT_KEYS = ("variant", "k", "engine", "label", "overrides")
# "VARIANT", "VARIANT:K", "VARIANT@ENGINE", "VARIANT:K@ENGINE"
_CONTESTANT_PATTERN = re.compile(r"^\s*(?P<variant>[a-z_]+)\s*(?::\s*(?P<k>\d+))?\s*"
                                 r"(?:@\s*(?P<engine>[a-z_]+))?\s*$")


class ConfigError(ValueError):
    """A configuration that cannot run, reported before anything is started."""


def recipes_dir() -> str:
    """The folder holding the recipe configs, as Hydra's ``--config-dir`` wants it."""
    return str(files(RECIPES_PACKAGE))


def is_recipe(config_name: str) -> bool:
    return files(RECIPES_PACKAGE).joinpath(f"{config_name}.yaml").is_file()


def compose_config(config_name: str = "train", overrides: Sequence[str] = (),
                   validate: bool = True) -> DictConfig:
    """Compose ``train`` or a recipe with command-line style ``overrides``, as the app would.

    Recipes are composed with the recipes package as the primary source and ``conf`` on the
    search path: Hydra looks the primary config up (and caches a miss) before it applies a
    ``hydra.searchpath`` override, so the primary config must live in the primary source.
    With ``validate`` the result is checked by ``validate_config``.
    """
    overrides = list(overrides)
    if is_recipe(config_name):
        module = RECIPES_PACKAGE
        overrides.append(f"hydra.searchpath=[pkg://{CONF_PACKAGE}]")
    else:
        module = CONF_PACKAGE
    # compose() needs an initialised GlobalHydra of its own; a leftover one (an earlier failed
    # compose in the same interpreter) would make initialize_config_module refuse to start.
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module(config_module=module, version_base=None):
        cfg = compose(config_name=config_name, overrides=overrides)
    if validate:
        check_race_overrides(cfg, overrides)
        validate_config(cfg)
    return cfg


def validate_config(cfg: DictConfig) -> int | None:
    """Check the variant, K, engine and delay against each other; return P when it is known.

    P (the number of learners) is ``trainer.devices x trainer.num_nodes`` for the process
    engines, ``engine.strategy.num_learners`` for the simulated one; None when devices is left
    to Lightning ("auto" on GPUs), in which case the strategy checks K itself at setup.
    A race is checked contestant by contestant (`validate_race`).
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing values (???) for {', '.join(missing)}; set them on the command "
                          f"line, e.g. {missing[0]}=...")
    _check_logger(cfg.get("logger"))
    if is_race(cfg):
        return validate_race(cfg)
    return _validate_run(cfg)


def _check_logger(logger: Any) -> None:
    # Lightning would only fail when the logger is built, in every process; say it now.
    if not logger or not str(logger.get("_target_", "")).endswith("TensorBoardLogger"):
        return
    if not any(importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX")):
        raise ConfigError('logger=tensorboard needs the tensorboard package: pip install '
                          '"lightning-stale[tensorboard]" (or pip install tensorboard), or use '
                          'logger=csv')


def _validate_run(cfg: DictConfig) -> int | None:
    engine = cfg.engine.get("name")
    if engine not in ENGINE_NAMES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINE_NAMES)}")
    variant, k = cfg.variant.get("name"), cfg.variant.get("k")
    if variant not in VARIANT_NAMES:
        raise ConfigError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANT_NAMES)}")

    # engine=ddp takes delays too: its InjectedDelay callback sleeps them on every rank.
    if engine == "ddp" and variant != "sync":
        raise ConfigError(
            f"engine=ddp runs only variant=sync (its all-reduce waits for every learner), got "
            f"variant={variant}; use engine=server for "
            f"{', '.join(name for name in VARIANT_NAMES if name != 'sync')}")

    strategy_class(cfg)
    _check_local_updates(cfg, engine)
    if engine == "server":
        _check_server_path(cfg, variant)
    learners = learner_count(cfg)
    if engine == "simulated" and process_count(cfg) not in (None, 1):
        raise ConfigError(
            f"engine=simulated runs its {learners} learners in one process, got trainer.devices="
            f"{cfg.trainer.devices} and trainer.num_nodes={cfg.trainer.get('num_nodes', 1)}; "
            "set the number of learners with engine.strategy.num_learners")
    if learners is not None:
        try:
            Variant.create(variant, learners, k)
        except ValueError as error:
            raise ConfigError(f"variant={variant} variant.k={k} does not fit P={learners} learners "
                              f"(P = {_learners_source(engine)}): {error}") from None
        if not is_no_delay(cfg.get("delay")):
            _check_delay_learners(cfg.delay, learners)
    return learners


def _check_local_updates(cfg: DictConfig, engine: str) -> None:
    """``variant.local_steps``, ``variant.outer_optimizer`` and ``engine.strategy.adaptive_h``
    (docs/how-to/local-updates.md):
    checked as the strategy checks them, and refused where the engine does not take them (ddp;
    the server engine's sharded path; its collective path serves the sync family, which
    `_check_server_path` checks) before any process starts."""
    from lightning_stale.method.adaptive import AdaptiveH
    from lightning_stale.strategies.local_updates import check_local_steps, outer_optimizer_factory

    local_steps, outer = cfg.variant.get("local_steps", 1), cfg.variant.get("outer_optimizer")
    try:
        check_local_steps(local_steps)
        outer_optimizer_factory(outer)
    except ValueError as error:
        raise ConfigError(f"variant.local_steps / variant.outer_optimizer: {error}") from None
    local = local_steps != 1 or outer is not None
    if local and engine == "ddp":
        raise ConfigError(f"variant.local_steps={local_steps} with variant.outer_optimizer="
                          f"{'null' if outer is None else 'set'}: local updates run on "
                          "engine=simulated or engine=server, not engine=ddp; use one of those, "
                          "or variant.local_steps=1 and variant.outer_optimizer=null")
    path = cfg.engine.get("strategy", {}).get("server", "auto")
    if local and engine == "server" and path not in ("auto", "central", "collective"):
        raise ConfigError(f"engine.strategy.server={path} with variant.local_steps={local_steps}: "
                          "local updates run on the central path (and the collective one, for the sync "
                          "family); use engine.strategy.server=central (or auto, or collective)")
    adaptive_h = cfg.engine.get("strategy", {}).get("adaptive_h")
    if adaptive_h is not None and (engine not in ("simulated", "server")
                                   or (engine == "server" and path not in ("auto", "central"))):
        where = f"engine={engine}" + (f" with engine.strategy.server={path}" if engine == "server" else "")
        raise ConfigError(f"engine.strategy.adaptive_h: AdaComm's adaptive H runs on engine=simulated and "
                          f"on engine=server's central path, not {where}; use one of those or drop adaptive_h")
    try:
        AdaptiveH.create(adaptive_h, h0=local_steps)
    except ValueError as error:
        raise ConfigError(f"engine.strategy.adaptive_h: {error}") from None


def _check_server_path(cfg: DictConfig, variant: str) -> None:
    # The strategy refuses these too, but only once it is built in every process.
    from lightning_stale.engine.distributed.paths.registry import SERVER_PATHS, path_problem

    options = cfg.engine.strategy
    path = options.get("server", "auto")
    if path not in SERVER_PATHS:
        raise ConfigError(f"engine.strategy.server={path!r} is not a server path; choose one of "
                          f"{', '.join(SERVER_PATHS)}")
    clips = cfg.get("trainer", {}).get("gradient_clip_val") not in (None, 0)
    problem = path_problem(path, variant, options.get("on_learner_failure", "stop"), None, clips)
    if problem:
        raise ConfigError(f"engine.strategy.server={path} with variant={variant}: {problem}")


def learner_count(cfg: DictConfig) -> int | None:
    """P for this config, or None when it is only known once Lightning picks the devices."""
    if cfg.engine.get("name") == "simulated":
        return int(cfg.engine.strategy.num_learners)
    return process_count(cfg)


def process_count(cfg: DictConfig) -> int | None:
    """trainer.devices x trainer.num_nodes, or None when Lightning decides (GPU "auto")."""
    devices = cfg.trainer.get("devices", 1)
    nodes = int(cfg.trainer.get("num_nodes", 1))
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices) * nodes
    if isinstance(devices, str):
        if devices.strip() == "auto" or devices.strip() == "-1":
            # Lightning's "auto" on CPU is one process; on GPUs it depends on the machine.
            return nodes if cfg.trainer.get("accelerator") == "cpu" else None
        if "," in devices:  # "0,1": device indices
            return len([d for d in devices.split(",") if d.strip()]) * nodes
        devices = int(devices)
    if devices == -1:
        return nodes if cfg.trainer.get("accelerator") == "cpu" else None
    return int(devices) * nodes


def _learners_source(engine: str) -> str:
    if engine == "simulated":
        return "engine.strategy.num_learners"
    return "trainer.devices x trainer.num_nodes"


def is_no_delay(delay: Any) -> bool:
    """Whether a delay config injects nothing (absent, empty or ``NoDelay``)."""
    return not delay or delay.get("_target_") in _NO_DELAY_TARGETS


def delay_name(delay: Any) -> str:
    return str(delay.get("_target_")) if delay else "none"


def _check_delay_learners(delay: DictConfig, learners: int) -> None:
    # A straggler model can name learners that do not exist (slow_learners, trace): say so now,
    # not from inside a learner process.
    from hydra.utils import instantiate

    model = instantiate(delay)
    check = getattr(model, "check_learners", None)
    if check is not None:
        try:
            check(learners)
        except ValueError as error:
            raise ConfigError(f"delay {delay_name(delay)} with P={learners}: {error}") from None


def strategy_class(cfg: DictConfig) -> type:
    """The class ``engine.strategy._target_`` names; ConfigError when it names none (checked
    before any process starts). An import that fails inside an existing module propagates."""
    target = str(cfg.engine.strategy._target_)
    module_name, _, attribute = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise
        module = None
    found = getattr(module, attribute, None)
    if not isinstance(found, type):
        raise ConfigError(f"engine.strategy._target_={target!r} names no class; the shipped engines "
                          f"are engine=server, engine=simulated and engine=ddp")
    return found


# ---------------------------------------------------------------------------- races
def is_race(cfg: DictConfig) -> bool:
    """Whether ``cfg`` is a race (``race.contestants`` non-empty) rather than one run."""
    race = cfg.get("race")
    return bool(race) and bool(race.get("contestants"))


@dataclass(frozen=True)
class Contestant:
    """One run of a race: a variant with its K on an engine, with optional config overrides."""

    variant: str
    k: int | None
    engine: str
    label: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """A short name for folders and messages, e.g. ``k_sync:2``, ``sync@ddp``."""
        k = f":{self.k}" if self.k is not None else ""
        return f"{self.variant}{k}@{self.engine}"


def parse_contestant(spec: Any, engine: str, index: int) -> Contestant:
    """A contestant from ``"VARIANT[:K][@ENGINE]"`` or a mapping of `CONTESTANT_KEYS`;
    ``engine`` is the run's engine, the default. ``index`` (from 1) only names it in errors."""
    where = f"race.contestants[{index - 1}]"
    fields: dict[Any, Any]
    if isinstance(spec, str):
        match = _CONTESTANT_PATTERN.match(spec)
        if match is None:
            raise ConfigError(f"{where}={spec!r} is not a contestant: write VARIANT, VARIANT:K, "
                              "VARIANT@ENGINE or VARIANT:K@ENGINE, e.g. k_async:2 or sync@ddp")
        fields = {key: value for key, value in match.groupdict().items() if value is not None}
    elif isinstance(spec, (Mapping, DictConfig)):
        # A DictConfig's container is a dict: to_container's declared union covers ListConfigs.
        fields = dict(cast(Mapping, OmegaConf.to_container(spec, resolve=True))
                      if isinstance(spec, DictConfig) else spec)
        unknown = sorted(set(fields) - set(CONTESTANT_KEYS))
        if unknown:
            raise ConfigError(f"{where} has unknown keys {unknown}; a contestant takes "
                              f"{', '.join(CONTESTANT_KEYS)}")
    else:
        raise ConfigError(f"{where}={spec!r} is not a contestant: give a string such as "
                          "k_async:2 or a mapping {variant: ..., k: ..., engine: ...}")
    variant = fields.get("variant")
    if variant not in VARIANT_NAMES:
        raise ConfigError(f"{where}: unknown variant {variant!r}; choose one of "
                          f"{', '.join(VARIANT_NAMES)}")
    k = fields.get("k")
    if k is not None:
        if isinstance(k, bool) or not str(k).isdigit():
            raise ConfigError(f"{where}: K must be a positive integer, got {k!r}")
        k = int(k)
    contestant_engine = fields.get("engine") or engine
    allowed = RACE_ENGINES.get(engine, ())
    if contestant_engine not in allowed:
        raise ConfigError(
            f"{where}: engine {contestant_engine!r} cannot race in a launch of engine={engine}; "
            f"the contestants of one launch share its processes, so with engine={engine} a "
            f"contestant may name {', '.join(allowed) or 'no engine'}")
    overrides = fields.get("overrides") or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"{where}: overrides must map dotted keys to values, e.g. "
                          "{model.lr: 0.05}, got " + repr(overrides))
    label = fields.get("label")
    return Contestant(variant, k, contestant_engine, None if label is None else str(label),
                      dict(overrides))


def engine_config(name: str) -> DictConfig:
    """The ``engine`` node of ``conf/engine/<name>.yaml`` (a plain ``engine`` package)."""
    node = OmegaConf.load(str(files(CONF_PACKAGE).joinpath("engine").joinpath(f"{name}.yaml")))
    return cast(DictConfig, node)  # every conf/engine/*.yaml is a mapping


def contestant_configs(cfg: DictConfig) -> list[tuple[Contestant, DictConfig]]:
    """Each contestant of a race with its own single-run config: ``cfg`` with ``race`` removed,
    the contestant's variant and K, its engine's config where it differs from the run's, and its
    ``overrides``. Interpolations stay live, so the engine's ``${variant.name}`` and the logger's
    ``${output_dir}`` follow the contestant. Not validated here (see `validate_race`)."""
    engine = str(cfg.engine.get("name"))
    found = []
    for index, spec in enumerate(cfg.race.contestants, 1):
        contestant = parse_contestant(spec, engine, index)
        run = copy.deepcopy(cfg)
        with open_dict(run):
            run.race = None
            run.variant.name, run.variant.k = contestant.variant, contestant.k
            if contestant.engine != engine:
                run.engine = engine_config(contestant.engine)
            for key, value in contestant.overrides.items():
                OmegaConf.update(run, str(key), value, merge=True, force_add=True)
        found.append((contestant, run))
    return found


def validate_race(cfg: DictConfig) -> int | None:
    """Check a race: its settings, then every contestant as a single run; return P.

    All contestants must run in the same number of processes (one launch reuses them), and a
    race needs a logger: the report is drawn from each contestant's ``wallclock.csv``."""
    engine = cfg.engine.get("name")
    if engine not in ENGINE_NAMES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINE_NAMES)}")
    race = cfg.race
    unknown = sorted(set(map(str, race)) - {"contestants", "target_loss", "window"})
    if unknown:
        raise ConfigError(f"race has unknown keys {unknown}; it takes contestants, target_loss "
                          "and window")
    target = race.get("target_loss")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))):
        raise ConfigError(f"race.target_loss must be a number or null (the highest final loss "
                          f"among the contestants), got {target!r}")
    window = race.get("window", 20)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(f"race.window must be an integer >= 1 (updates), got {window!r}")
    if not cfg.get("logger"):
        raise ConfigError("a race draws its figure and table from each contestant's "
                          "wallclock.csv, which logger=none does not write: use logger=csv "
                          "(or logger=tensorboard), or race=none for a single run")
    if not cfg.get("fit", True) or cfg.get("ckpt_path"):
        raise ConfigError("a race fits every contestant from scratch: fit=false and ckpt_path "
                          "apply to single runs only (race=none)")
    processes, learners = process_count(cfg), None
    for index, (contestant, run) in enumerate(contestant_configs(cfg), 1):
        where = f"race contestant {index} ({contestant.name})"
        try:
            learners = _validate_run(run)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None
        if process_count(run) != processes:
            raise ConfigError(
                f"{where} runs in {process_count(run)} processes, the launch in {processes}: the "
                "contestants of one launch share its processes; set trainer.devices for all")
    return learners


def check_race_overrides(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Refuse command-line ``variant`` overrides in a race, which would be silently ignored.

    A race takes its variants from ``race.contestants``; ``variant=`` and ``variant.k=`` choose
    the variant of a single run, so they almost surely mean ``race=none`` was forgotten."""
    if not is_race(cfg):
        return
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "variant" or key.startswith("variant."):
            names = ", ".join(str(spec) for spec in cfg.race.contestants)
            raise ConfigError(
                f"{override} sets the variant of a single run, but this run is a race of "
                f"[{names}]: add race=none for a single run of that variant, or choose the "
                "contestants, e.g. 'race.contestants=[sync,k_async:2]'")
