"""Composing and checking the Hydra configuration of the app, from the command line or from code.

The configs ship inside the package: ``conf/`` as ``lightning_stale.conf`` (the primary config
``train`` and its groups) and ``recipes/`` as ``lightning_stale.recipes`` (ready-made runs whose
defaults list starts from ``train``). ``compose_config`` finds either kind by name, and
``validate_config`` rejects bad combinations before any data is loaded or any process started.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_stale.method.variants import VARIANT_NAMES, Variant

CONF_PACKAGE = "lightning_stale.conf"
RECIPES_PACKAGE = "lightning_stale.recipes"
ENGINE_NAMES = ("server", "simulated", "ddp")
# How each engine is named in errors; the ones not listed are called by their config name.
_ENGINE_TITLES = {"server": "the parameter-server engine", "simulated": "the simulated engine"}
_NO_DELAY_TARGETS = ("lightning_stale.delays.NoDelay",)


class ConfigError(ValueError):
    """A configuration that cannot run, reported before anything is started."""


class EngineNotAvailableError(ConfigError):
    """The engine's strategy class cannot be imported (it is not part of this version)."""


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
        validate_config(cfg)
    return cfg


def validate_config(cfg: DictConfig) -> int | None:
    """Check the variant, K, engine and delay against each other; return P when it is known.

    P (the number of learners) is ``trainer.devices x trainer.num_nodes`` for the process
    engines, ``engine.strategy.num_learners`` for the simulated one; None when devices is left
    to Lightning ("auto" on GPUs), in which case the strategy checks K itself at setup.
    """
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing values (???) for {', '.join(missing)}; set them on the command "
                          f"line, e.g. {missing[0]}=...")
    engine = cfg.engine.get("name")
    if engine not in ENGINE_NAMES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINE_NAMES)}")
    variant, k = cfg.variant.get("name"), cfg.variant.get("k")
    if variant not in VARIANT_NAMES:
        raise ConfigError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANT_NAMES)}")

    if engine == "ddp":
        if variant != "sync":
            raise ConfigError(
                f"engine=ddp runs only variant=sync (its all-reduce waits for every learner), got "
                f"variant={variant}; use engine=server for "
                f"{', '.join(name for name in VARIANT_NAMES if name != 'sync')}")
        if not is_no_delay(cfg.get("delay")):
            raise ConfigError(
                f"engine=ddp cannot inject straggler delays, got delay "
                f"{delay_name(cfg.get('delay'))}; use delay=none, or engine=server to simulate "
                "stragglers")

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
    """The engine's strategy class; EngineNotAvailableError when this version lacks it.

    Only a missing attribute counts as "not available": an import that fails inside an existing
    module is a real error and propagates.
    """
    target = str(cfg.engine.strategy._target_)
    module_name, _, attribute = target.rpartition(".")
    module = importlib.import_module(module_name)
    found = getattr(module, attribute, None)
    if found is None:
        engine = cfg.engine.name
        title = _ENGINE_TITLES.get(engine, f"engine={engine}")
        raise EngineNotAvailableError(
            f"{title} is not built yet ({target} cannot be imported); use engine=ddp variant=sync")
    return found
