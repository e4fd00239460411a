"""The progress bar shows the server's updates, K and mean staleness, and its counter counts
server updates (both engines, in this process)."""

import pytest
import pytorch_lightning as pl
from pytorch_lightning import Callback
from pytorch_lightning.callbacks import TQDMProgressBar

import user_modules as um
from engines import fit

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class BarWatcher(Callback):
    """What the TQDM bar shows after every training batch (it runs before the bar: it looks
    when the next batch starts, and when the epoch ends)."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx > 0:
            self._look(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        self._look(trainer, pl_module)

    def _look(self, trainer, pl_module):
        bar = trainer.progress_bar_callback
        self.seen.append(
            (
                trainer.current_epoch,
                bar.train_progress_bar.n,
                bar.train_progress_bar.total,
                str(bar.train_progress_bar),
                bar.get_metrics(trainer, pl_module),
                trainer.strategy.stats["updates"],
            )
        )


def test_the_bar_counts_server_updates_and_shows_k_and_staleness(engine):
    pl.seed_everything(0)
    watcher = BarWatcher()
    trainer = um.fit_user_module(
        engine,
        um.Classifier(),
        um.BlobData(batch_size=16),
        max_epochs=2,
        enable_progress_bar=True,
        callbacks=[watcher, TQDMProgressBar()],  # named: where `rich` is installed it is the default
    )
    stats = trainer.strategy.stats
    k, per_epoch = stats["k"], 12 // stats["k"]  # 12 batches of 16 per epoch (pushes, all learners)
    last = {}
    for epoch, n, total, text, metrics, updates in watcher.seen:
        last[epoch] = (n, text, metrics)
        assert total == per_epoch and n == updates - epoch * per_epoch  # the epoch's updates
        assert metrics["updates"] == updates and metrics["K"] == k  # the server's, as it drew
    assert sorted(last) == [0, 1] and last[1][0] == per_epoch
    n, text, metrics = last[1]
    assert f"updates={2 * per_epoch}" in text and f"K={k}" in text and "staleness=" in text
    assert "val/acc" in metrics  # the bar's own metrics are still there
    assert metrics["staleness"] >= 0 and (k == 1 or metrics["staleness"] > 0)
    assert stats["updates"] == 2 * per_epoch
    # after fit the bar is Lightning's own again
    bar = trainer.progress_bar_callback
    assert "get_metrics" not in vars(bar) and "ServerProgress" not in [
        type(c).__name__ for c in trainer.callbacks
    ]
    assert "updates" not in trainer.logged_metrics  # shown, not logged (WallClockLogger logs)


def test_a_custom_bar_is_left_alone_but_shows_the_figures(engine):
    class Quiet(TQDMProgressBar):
        def get_metrics(self, trainer, pl_module):
            return {
                k: v for k, v in super().get_metrics(trainer, pl_module).items() if k != "v_num"
            }

    pl.seed_everything(0)
    bar = Quiet(refresh_rate=5)
    trainer = fit(
        engine,
        um.Classifier(),
        um.BlobData(batch_size=16),
        variant="async",
        max_steps=10,
        enable_progress_bar=True,
        callbacks=[bar],
    )
    assert trainer.progress_bar_callback is bar
    shown = str(bar.train_progress_bar)
    assert "updates=10" in shown and "K=1" in shown and "v_num" not in shown
