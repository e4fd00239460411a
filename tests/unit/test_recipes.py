"""Every recipe: its header names its own command, it composes, every job of its sweep is a valid
config, and what it names can be instantiated (MNIST/CIFAR-10 from tiny files in tmp_path)."""

from __future__ import annotations

import inspect
import itertools
import math
from importlib.resources import files
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from lightning_stale.config import compose_config, learner_count, process_count

RECIPES = Path(str(files("lightning_stale.recipes")))
RECIPE_NAMES = sorted(path.stem for path in RECIPES.glob("*.yaml"))
# one run, or one race (of real processes, or of the simulated engine's one)
SINGLE_LAUNCHES = {"digits_k_async", "race_ddp", "local_updates_lm"}
SWEEPS = [name for name in RECIPE_NAMES if name not in SINGLE_LAUNCHES]
NEEDS_FILES = {"mnist_lenet", "cifar10_resnet"}


def data_overrides(recipe: str, data_root: Path) -> list[str]:
    return [f"data.data_dir={data_root}", "data.batch_size=4"] if recipe in NEEDS_FILES else []


def sweep_jobs(recipe: str) -> list[list[str]]:
    """The override lists of the jobs the recipe's sweep runs, expanded as Hydra's basic sweeper
    does (cartesian product of hydra.sweeper.params)."""
    params = OmegaConf.load(RECIPES / f"{recipe}.yaml").hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    choices = [[f"{o.key_or_group}={value}" for value in o.sweep_string_iterator()]
               if o.is_sweep_override() else [f"{o.key_or_group}={o.get_value_element_as_str()}"]
               for o in parsed]
    return [list(job) for job in itertools.product(*choices)]


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_header_gives_the_recipes_own_command(recipe):
    lines = (RECIPES / f"{recipe}.yaml").read_text().splitlines()
    header = list(itertools.takewhile(lambda line: line.startswith("#"), lines))
    assert header, f"{recipe}.yaml must start with a comment"
    assert any(f"python -m lightning_stale.train --config-name={recipe}" in line
               for line in header)
    if recipe != "digits_k_async":  # under a minute
        assert any("Expected wall time" in line for line in header)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_recipe_composes_and_instantiates(recipe, data_root, tmp_path):
    cfg = compose_config(recipe, data_overrides(recipe, data_root))
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    model = instantiate(cfg.model, input_shape=datamodule.input_shape,
                        num_classes=datamodule.num_classes)
    x, _ = next(iter(datamodule.train_dataloader()))
    assert model(x).shape[0] == x.shape[0]
    delay = instantiate(cfg.delay)
    assert math.isfinite(delay.sample(0))
    strategy = instantiate(cfg.engine.strategy)
    cfg.output_dir = str(tmp_path)
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=instantiate(cfg.logger),
                          default_root_dir=str(tmp_path))
    assert trainer.max_steps == cfg.trainer.max_steps


@pytest.mark.parametrize("recipe", SWEEPS)
def test_every_sweep_job_is_a_valid_single_process_config(recipe, data_root):
    raw = OmegaConf.load(RECIPES / f"{recipe}.yaml")
    assert raw.hydra.mode == "MULTIRUN"
    assert f"multirun/{recipe}/" in raw.hydra.sweep.dir
    jobs = sweep_jobs(recipe)
    assert len(jobs) >= 4
    labels = set()
    for job in jobs:  # compose_config validates: variant, K <= P, delay, one process
        cfg = compose_config(recipe, job + data_overrides(recipe, data_root))
        assert cfg.engine.name == "simulated" and process_count(cfg) == 1
        labels.add((cfg.variant.name, cfg.variant.k, cfg.engine.strategy.get("adaptive_k")))
    assert len(labels) == len(jobs)  # no two jobs the same run


@pytest.mark.parametrize("recipe", SWEEPS)
def test_sweeps_plot_when_they_end(recipe):
    callback = OmegaConf.load(RECIPES / f"{recipe}.yaml").hydra.callbacks.plot
    target = get_class(callback._target_)
    assert issubclass(target, Callback)
    assert "on_multirun_end" in vars(target)
    inspect.signature(target).bind(**{k: v for k, v in callback.items() if k != "_target_"})


def test_the_grids_cover_what_the_figures_need():
    tradeoff = {tuple(job) for job in sweep_jobs("tradeoff_digits")}
    assert len(tradeoff) == 16  # every K-variant with K = 1..P, P = 4
    cfg = compose_config("tradeoff_digits")
    assert learner_count(cfg) == 4
    floor = compose_config("convex_error_floor")
    assert floor.variant.name == "k_sync" and floor.data._target_.endswith("ConvexDataModule")
    assert floor.model.lr * instantiate(floor.data).smoothness <= 1  # the bound's step condition
    assert [job for job in sweep_jobs("convex_error_floor")] == [[f"variant.k={k}"]
                                                                 for k in range(1, 5)]
    theory = compose_config("theory_vs_measurement")
    assert theory.trainer.limit_val_batches == 0 and not theory.validate
    assert theory.delay._target_ == "lightning_stale.delays.Exponential"
    arms = [compose_config("adaptive_k", job) for job in sweep_jobs("adaptive_k")]
    assert sum(arm.engine.strategy.adaptive_k is not None for arm in arms) == 1
    assert sum(arm.engine.strategy.adaptive_k is None for arm in arms) == 3


@pytest.mark.parametrize("recipe", sorted(NEEDS_FILES))
def test_missing_data_folder_is_named(recipe, tmp_path):
    cfg = compose_config(recipe, [f"data.data_dir={tmp_path / 'nowhere'}"])
    # Hydra wraps the data module's FileNotFoundError; the message names the folder and files.
    with pytest.raises((FileNotFoundError, InstantiationException),
                       match=r"data files missing in folder .*nowhere"):
        instantiate(cfg.data)
