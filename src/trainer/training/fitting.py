"""One ``model.fit`` of a session, from where its training state stands to the last
epoch, over the run's seeded per-epoch batch order.

Split from ``loop``: what is fitted and in which order is its own concern (a resumed
epoch skips the batches it consumed), apart from how a session is set up around it. Log
lines keep ``loop``'s logger name, as before the split.
"""

from __future__ import annotations

import logging

from trainer.data import run_dataset

# ``loop``'s logger: its lines predate the split.
log = logging.getLogger("trainer.training.loop")


def fit_run(model, data, val, cfg, state, steps, callbacks) -> None:
    """One ``fit`` from where ``state`` stands to the last epoch, over every epoch's seeded
    order (a resumed epoch without its consumed batches; ``RunProgress`` ends it)."""
    if state.epoch >= cfg.trainer.epochs:
        log.info(
            "Already trained %d of %d epochs: nothing left to train; finishing the run's "
            "end-of-run steps (raise trainer.epochs to train further)",
            state.epoch,
            cfg.trainer.epochs,
        )
        return
    if state.stopped_early:
        log.info("A callback ended this run at epoch %d; nothing left to train", state.epoch)
        return
    batches = run_dataset(
        data.x_train,
        data.y_train,
        batch_size=cfg.trainer.batch_size,
        seed=int(cfg.seed),
        epochs=cfg.trainer.epochs,
        first_epoch=state.epoch,
        skip_batches=state.step_in_epoch,
        max_batches=steps,
    )
    model.fit(
        batches,
        epochs=cfg.trainer.epochs,
        initial_epoch=state.epoch,
        steps_per_epoch=steps,
        validation_data=val,
        callbacks=callbacks,
        verbose=cfg.trainer.verbose,
        shuffle=False,  # the order is already the seeded per-epoch permutation
    )
