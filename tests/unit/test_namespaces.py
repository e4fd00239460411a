"""Both Lightning namespaces (``pytorch_lightning`` and ``lightning.pytorch``) and LightningCLI.

Runs in both CI environments: the one with only ``pytorch-lightning`` (the ``lightning`` cases
skip there) and the one with ``lightning`` too, where .ci/run sets
``LIGHTNING_STALE_BOTH_NAMESPACES=1`` so that a missing ``lightning`` fails instead of skipping.
Both strategies are tested as instances and as registered names, with a short fit in this
process (the real engine as P = 1).
"""

import importlib
import importlib.util
import os

import pytest
import torch

from engines import QUIET
from lightning_stale import SimulatedStaleStrategy, StaleStrategy
from lightning_stale.delays import Exponential, ShiftedExponential

HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
if os.environ.get("LIGHTNING_STALE_BOTH_NAMESPACES") == "1" and not HAS_LIGHTNING:
    raise RuntimeError(
        "LIGHTNING_STALE_BOTH_NAMESPACES=1 but the `lightning` package is not installed"
    )

NAMESPACES = [
    "pytorch_lightning",
    pytest.param(
        "lightning.pytorch",
        marks=pytest.mark.skipif(
            not HAS_LIGHTNING,
            reason="`lightning` is not installed (CI's second environment has it)",
        ),
    ),
]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def modules(namespace):
    """A user's module and data module written against ``namespace``."""
    if namespace == "pytorch_lightning":
        import user_modules

        return user_modules.WarmupAdamW, user_modules.BlobData
    import lightning_modules

    return lightning_modules.LitClassifier, lightning_modules.LitBlobs


def run(namespace, strategy, **trainer_kwargs):
    ns = importlib.import_module(namespace)
    module_cls, data_cls = modules(namespace)
    options = {k: v for k, v in {**QUIET, **trainer_kwargs}.items() if v is not None}
    trainer = ns.Trainer(strategy=strategy, max_steps=6, **options)
    model = module_cls()
    try:
        trainer.fit(model, data_cls())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer, model


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize(
    "make",
    [
        lambda: SimulatedStaleStrategy("k_async", 2, num_learners=3, delay=Exponential(0.01)),
        lambda: "simulated_stale",
        lambda: StaleStrategy("async", record_trace=False),
        lambda: "async",
    ],
    ids=["simulated", "simulated_stale-name", "stale", "async-name"],
)
def test_both_strategies_fit_with_either_trainer(one_process, namespace, make):
    strategy = make()
    trainer, model = run(namespace, strategy)
    ns_strategies = importlib.import_module(f"{namespace}.strategies")
    assert isinstance(trainer.strategy, ns_strategies.Strategy)
    assert isinstance(trainer.strategy, (SimulatedStaleStrategy, StaleStrategy))
    assert trainer.strategy.lightning_namespace == namespace
    assert trainer.strategy.stats["updates"] == 6 == trainer.global_step
    assert model.total_steps == 6  # estimated_stepping_batches: server updates


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_tqdm_bar_of_either_namespace_counts_server_updates(namespace):
    strategy = SimulatedStaleStrategy("k_async", 2, num_learners=3)
    # Named: Lightning's default bar is Rich's wherever `rich` is installed (mutmut brings it).
    tqdm_bar = importlib.import_module(f"{namespace}.callbacks").TQDMProgressBar()
    trainer, _ = run(namespace, strategy, enable_progress_bar=True, callbacks=[tqdm_bar])
    bar = trainer.progress_bar_callback.train_progress_bar
    assert (bar.n, bar.total) == (6, 6)  # 12 pushes per epoch, K = 2; the 6 updates of max_steps
    assert "updates=6" in str(bar) and "K=2" in str(bar)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_registered_names_are_in_the_registry_of_each_namespace(namespace):
    registry = importlib.import_module(f"{namespace}.strategies").StrategyRegistry
    for name in (
        "sync",
        "k_sync",
        "k_batch_sync",
        "async",
        "k_async",
        "k_batch_async",
        "simulated_stale",
    ):
        assert name in registry, name
    ns = importlib.import_module(namespace)
    trainer = ns.Trainer(strategy="k_async", **{**QUIET, "devices": 3})
    assert isinstance(trainer.strategy, StaleStrategy) and trainer.strategy.variant.k == 2


@pytest.mark.skipif(not HAS_LIGHTNING, reason="needs both namespaces installed")
def test_one_strategy_object_fits_again_with_a_trainer_of_its_namespace(one_process):
    strategy = SimulatedStaleStrategy("async", num_learners=2)
    run("lightning.pytorch", strategy)
    trainer, _ = run("lightning.pytorch", strategy, accelerator=None)
    assert trainer.strategy is strategy and strategy.stats["updates"] == 6


STALE_ARGS = [
    "--trainer.strategy=lightning_stale.StaleStrategy",
    "--trainer.strategy.variant=k_async",
    "--trainer.strategy.k=2",
    "--trainer.strategy.delay=lightning_stale.delays.Exponential",
    "--trainer.strategy.delay.mean=0.01",
    "--trainer.accelerator=cpu",
    "--trainer.devices=2",
]
SIMULATED_ARGS = [
    "--trainer.strategy=lightning_stale.SimulatedStaleStrategy",
    "--trainer.strategy.variant=k_batch_async",
    "--trainer.strategy.k=2",
    "--trainer.strategy.num_learners=3",
    "--trainer.strategy.delay=lightning_stale.delays.ShiftedExponential",
    "--trainer.strategy.delay.shift=0.002",
    "--trainer.strategy.delay.mean=0.01",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.max_steps=4",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def cli(namespace, args, run=False):
    cli_module = importlib.import_module(f"{namespace}.cli")
    module_cls, data_cls = modules(namespace)
    return cli_module.LightningCLI(
        module_cls, data_cls, run=run, args=args, save_config_callback=None
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_cli_configures_the_real_engine(namespace):
    strategy = cli(namespace, STALE_ARGS).trainer.strategy
    assert isinstance(strategy, StaleStrategy) and strategy.lightning_namespace == namespace
    assert (strategy.variant_name, strategy.k, strategy.variant.p) == ("k_async", 2, 2)
    assert isinstance(strategy.delay, Exponential) and strategy.delay.mean == 0.01


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_cli_fits_with_the_simulated_engine(namespace):
    result = cli(namespace, ["fit", *SIMULATED_ARGS], run=True)
    strategy = result.trainer.strategy
    assert (
        isinstance(strategy, SimulatedStaleStrategy) and strategy.lightning_namespace == namespace
    )
    assert (strategy.variant_name, strategy.k, strategy.num_learners) == ("k_batch_async", 2, 3)
    delay = strategy.delay
    assert isinstance(delay, ShiftedExponential) and (delay.shift, delay.exponential_mean) == (
        0.002,
        0.01,
    )
    assert strategy.stats["updates"] == 4 and result.model.total_steps == 4
    assert strategy.stats["virtual_time_s"] > 4 * 0.002  # the delays were drawn


def test_lightning_cli_nests_delay_models_and_takes_the_other_options():
    from lightning_stale.delays import SlowLearners
    from lightning_stale.method.compensation import StalenessCompensation

    args = [
        *STALE_ARGS[:3],
        "--trainer.strategy.delay=lightning_stale.delays.SlowLearners",
        "--trainer.strategy.delay.base=lightning_stale.delays.Exponential",
        "--trainer.strategy.delay.base.mean=0.01",
        "--trainer.strategy.delay.learners=[1]",
        "--trainer.strategy.delay.factor=3",
        "--trainer.strategy.staleness_compensation=inverse",
        "--trainer.strategy.adaptive_k={k0: 2, interval_s: 0.5}",
        "--trainer.strategy.delay_mode=total",
        "--trainer.accelerator=cpu",
        "--trainer.devices=3",
    ]
    strategy = cli("pytorch_lightning", args).trainer.strategy
    delay = strategy.delay
    assert isinstance(delay, SlowLearners) and delay.learners == (1,) and delay.factor == 3
    assert isinstance(delay.base, Exponential) and delay.base.mean == 0.01
    assert isinstance(strategy.staleness_compensation, StalenessCompensation)
    assert strategy.staleness_compensation.mode == "inverse"
    assert strategy.adaptive_k == {"k0": 2, "interval_s": 0.5} and strategy.delay_mode == "total"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_cli_rejects_a_bad_variant_naming_the_choices(namespace):
    with pytest.raises(ValueError, match=r"unknown variant 'fastest'; choose one of sync, k_sync"):
        cli(namespace, [*STALE_ARGS[:1], "--trainer.strategy.variant=fastest", *STALE_ARGS[2:]])
