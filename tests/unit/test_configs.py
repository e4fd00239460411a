"""Every config option composes, validates and instantiates; bad input fails early. (Recipes:
tests/unit/test_recipes.py; the race's own checks: tests/unit/test_race.py.)

Each group option is composed once on top of the defaults, with only the overrides it needs to
make sense (a stale variant needs an engine that can run it, least squares needs the convex
data, ...). Every ``_target_`` in the result must accept the keys its config gives it.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from hydra.errors import MissingConfigException
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_stale.config import (ConfigError, compose_config,
                                    contestant_configs, is_race, strategy_class, validate_config)
from lightning_stale.train import train

CONF = Path(str(files("lightning_stale.conf")))
GROUPS = ("data", "model", "variant", "delay", "trainer", "logger", "engine", "race")
OPTIONS = [(group, path.stem) for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]
# Keyword arguments train() adds to the configs' own when it instantiates them.
ADDED_BY_TRAIN = {
    "model": {"input_shape", "num_classes"},
    "trainer": {"strategy", "callbacks", "logger", "default_root_dir"},
}
TENSORBOARD = any(importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX"))


# ------------------------------------------------------------------ tiny data files


def needed_overrides(group: str, option: str, data_root: Path) -> list[str]:
    """What an option needs besides the defaults to form a runnable config."""
    overrides = [f"{group}={option}"]
    if group == "variant" or (group, option) == ("logger", "none"):
        # a race takes its variants from race.contestants and draws from their logs
        overrides.append("race=none")
    if (group, option) == ("engine", "ddp"):  # ddp runs only sync; the server the rest
        overrides.append("race.contestants=[sync,k_async:2@server]")
    if group == "model" and option == "least_squares":
        overrides.append("data=convex")
    if group == "data" and option == "convex":
        overrides.append("model=least_squares")
    if (group, option) == ("model", "gpt"):  # a language model needs tokens
        overrides.append("data=python_docs")
    if (group, option) == ("data", "python_docs"):
        overrides.append("model=gpt")
    if group == "data" and option in ("mnist", "cifar10"):
        overrides += [f"data.data_dir={data_root}", "data.batch_size=4"]  # 20 images a split
    if group == "delay" and option == "trace":
        overrides.append(f"delay.path={data_root / 'trace.csv'}")
    return overrides


# ------------------------------------------------------------------ signature checks


def target_nodes(node, path: str = ""):
    """(path, node) for every config node with a ``_target_``, depth first."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for key in node:
            yield from target_nodes(node._get_node(key), f"{path}.{key}" if path else str(key))
    elif isinstance(node, ListConfig):
        for index, item in enumerate(node):
            yield from target_nodes(item, f"{path}[{index}]")


def check_signature(path: str, node: DictConfig, extra: set[str] = frozenset()) -> bool:
    """Assert the target accepts every key of ``node``; False if the target is not importable."""
    target = node._target_
    function = get_method(target)  # classes too
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return True
    keys = {str(key) for key in node if not str(key).startswith("_")} | set(extra)
    unknown = keys - set(parameters)
    assert not unknown, f"{path}: {target} takes no {sorted(unknown)}; it takes {list(parameters)}"
    return True


def check_all_signatures(cfg: DictConfig) -> None:
    for path, node in target_nodes(cfg):
        check_signature(path, node, ADDED_BY_TRAIN.get(path, set()))


# ------------------------------------------------------------------ instantiation


def instantiate_all(cfg: DictConfig, output_dir: Path) -> None:
    """Build what train() builds, without fitting: for a race, each contestant's run."""
    validate_config(cfg)
    if is_race(cfg):
        for _, run in contestant_configs(cfg):
            instantiate_all(run, output_dir)
        return
    cfg = cfg.copy()
    cfg.output_dir = str(output_dir)
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    model = instantiate(cfg.model, input_shape=datamodule.input_shape,
                        num_classes=datamodule.num_classes)
    x, _ = next(iter(datamodule.train_dataloader()))
    assert torch.isfinite(model(x)).all()
    delay = instantiate(cfg.delay)
    if hasattr(delay, "sample"):
        assert math.isfinite(delay.sample(0))
    logger = instantiate(cfg.logger) if cfg.logger else False
    strategy = instantiate(cfg.engine.strategy)
    assert isinstance(strategy, strategy_class(cfg))
    callbacks = [instantiate(node) for node in cfg.engine.get("callbacks") or []]
    assert all(callable(getattr(callback, "on_before_optimizer_step", None))
               for callback in callbacks)
    trainer_cfg = cfg.trainer
    if trainer_cfg.accelerator == "gpu" and not torch.cuda.is_available():
        trainer_cfg = OmegaConf.merge(trainer_cfg, {"accelerator": "cpu", "devices": 1})
        strategy = None  # a GPU strategy's checks need a GPU; its signature was checked
    trainer = instantiate(trainer_cfg, strategy=strategy or "auto", logger=logger,
                          callbacks=callbacks, default_root_dir=str(output_dir))
    assert trainer.max_steps == cfg.trainer.max_steps


# ------------------------------------------------------------------ tests


def test_every_group_has_options():
    found = {group for group, _ in OPTIONS}
    assert found == set(GROUPS)
    assert {option for group, option in OPTIONS if group == "variant"} == {
        "sync", "k_sync", "k_batch_sync", "async", "k_async", "k_batch_async"}
    assert {option for group, option in OPTIONS if group == "race"} == {"default", "none"}


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group, option, data_root, tmp_path):
    if (group, option) == ("logger", "tensorboard") and not TENSORBOARD:
        with pytest.raises(ConfigError, match=r"pip install \"lightning-stale\[tensorboard\]\""):
            compose_config("train", needed_overrides(group, option, data_root))
        return
    cfg = compose_config("train", needed_overrides(group, option, data_root))
    check_all_signatures(cfg)
    instantiate_all(cfg, tmp_path)


def test_digits_k_async_recipe_settings():
    cfg = compose_config("digits_k_async")
    assert (cfg.variant.name, cfg.variant.k, cfg.engine.name) == ("k_async", 2, "server")
    assert cfg.trainer.devices == 4 and cfg.data._target_.endswith("DigitsDataModule")
    assert cfg.delay._target_ == "lightning_stale.delays.ShiftedExponential"
    assert cfg.engine.strategy.delay.shift == cfg.delay.shift  # the engine gets the delay


def test_default_config_is_the_race():
    cfg = compose_config()
    assert cfg.data._target_ == "lightning_stale.data.DigitsDataModule"
    assert cfg.engine.name == "server" and cfg.trainer.devices == 4
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.enable_progress_bar is False
    assert cfg.delay._target_ == "lightning_stale.delays.ShiftedExponential"
    assert is_race(cfg)
    runs = [(c.variant, c.k, c.engine, run.engine.strategy.variant, run.engine.strategy.k)
            for c, run in contestant_configs(cfg)]
    assert runs == [("sync", None, "server", "sync", None), ("k_sync", 2, "server", "k_sync", 2),
                    ("k_async", 2, "server", "k_async", 2)]
    single = compose_config("train", ["race=none"])
    assert not is_race(single) and single.variant.name == "sync"


def test_variant_k_override():
    cfg = compose_config("train", ["race=none", "variant=k_async", "variant.k=2"])
    assert (cfg.variant.name, cfg.variant.k) == ("k_async", 2)
    assert cfg.engine.strategy.k == 2 and cfg.engine.strategy.variant == "k_async"


def test_simulated_engine_runs_in_one_process():
    cfg = compose_config("train", ["race=none", "engine=simulated", "variant=k_sync",
                                   "variant.k=3"])
    assert cfg.trainer.devices == 1 and cfg.engine.strategy.num_learners == 4
    with pytest.raises(ConfigError, match=r"K=5"):
        compose_config("train", ["race=none", "engine=simulated", "variant=k_sync",
                                 "variant.k=5"])
    with pytest.raises(ConfigError, match="num_learners"):
        compose_config("train", ["race=none", "engine=simulated", "trainer.devices=4"])


def test_unknown_variant_lists_the_options():
    with pytest.raises(MissingConfigException) as error:
        compose_config("train", ["race=none", "variant=nonexistent"])
    assert "nonexistent" in str(error.value) and "k_batch_async" in str(error.value)
    with pytest.raises(ConfigError, match=r"'bogus'.*sync, k_sync, k_batch_sync"):
        compose_config("train", ["race=none", "variant.name=bogus"])


@pytest.mark.parametrize("overrides,message", [
    (["race=none", "variant=k_async", "variant.k=9"], r"variant\.k=9 .*P=4"),
    (["race=none", "variant=k_sync", "variant.k=3", "trainer.devices=2"],
     r"variant\.k=3 .*P=2"),
    (["race=none", "engine=ddp", "variant=k_async"],
     r"engine=ddp runs only variant=sync.*variant=k_async"),
    (["race=none", "variant=sync", "variant.k=2"], r"'sync' means K=P=4"),
    (["race=none", "delay=slow_learners", "delay.learners=[7]"], r"learner 7"),
    (["race=none", "delay=trace"], r"delay\.path"),
    (["delay=slow_learners", "delay.learners=[7]"],
     r"race contestant 1 \(sync@server\).*learner 7"),
    (["engine=ddp"], r"race contestant 2 \(k_sync:2@ddp\).*engine=ddp runs only variant=sync"),
    (["race=none", "engine.strategy.server=ring"], r"server='ring' .*auto, central, collective, sharded"),
    (["race=none", "variant=k_async", "engine.strategy.server=collective"], r"collective.*not 'k_async'"),
    (["race=none", "variant=async", "engine.strategy.server=sharded", "+trainer.gradient_clip_val=1.0"],
     r"gradient clipping .* server='central' or 'collective'"),
    (["race=none", "engine.strategy._target_=lightning_stale.NoSuchStrategy"], r"NoSuchStrategy.*names no class"),
])
def test_bad_config_fails_before_training(overrides, message, monkeypatch):
    with pytest.raises(ConfigError, match=message):
        compose_config("train", overrides)
    cfg = compose_config("train", overrides, validate=False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("train() instantiated something before rejecting the config")

    monkeypatch.setattr("lightning_stale.train.instantiate", must_not_run)
    with pytest.raises(ConfigError, match=message):
        train(cfg)


def test_server_engine_gets_variant_k_and_delay_object(monkeypatch):
    """The wiring train() relies on, checked against a stand-in for the strategy class."""
    import lightning_stale
    from lightning_stale.delays import ShiftedExponential
    from lightning_stale.train import build_strategy

    class RecordingStrategy:
        def __init__(self, variant, k=None, delay=None, delay_mode="after_compute", server="auto",
                     hold_freed_memory=False, shared_memory=False, overlap_allreduce=False,
                     payload_channels=True, record_events=None, digest_every=None, local_steps=None,
                     outer_optimizer="unset"):
            self.variant, self.k, self.delay, self.delay_mode = variant, k, delay, delay_mode
            self.local_steps, self.outer_optimizer = local_steps, outer_optimizer
            self.record_events, self.digest_every = record_events, digest_every
            self.server, self.hold_freed_memory = server, hold_freed_memory
            self.shared_memory, self.overlap_allreduce = shared_memory, overlap_allreduce
            self.payload_channels = payload_channels

    monkeypatch.setattr(lightning_stale, "StaleStrategy", RecordingStrategy, raising=False)
    strategy = build_strategy(compose_config("digits_k_async"))
    assert (strategy.variant, strategy.k, strategy.delay_mode, strategy.server) == ("k_async", 2, "after_compute", "auto")
    assert strategy.hold_freed_memory is True and strategy.shared_memory is True
    # overlap where the default group is gloo (None); no device channels (never run on GPUs)
    assert strategy.overlap_allreduce is None and strategy.payload_channels is False
    assert strategy.record_events is False and strategy.digest_every == 100  # no event log unless asked
    assert strategy.local_steps == 1 and strategy.outer_optimizer is None  # a push per step
    assert isinstance(strategy.delay, ShiftedExponential) and strategy.delay.shift == 0.01
