"""Every config group composes and instantiates; train(cfg) runs and writes its outputs."""

from __future__ import annotations

import re

import hydra
import keras
import numpy as np
import pytest
from omegaconf import OmegaConf

from tests.helpers.checkpoints import list_checkpoints
from tests.helpers.config import config_options
from trainer import train
from trainer.data import DataSplits, epoch_dataset, epoch_order
from trainer.errors import ConfigError, MissingClassError
from trainer.save_backends import SaveBackend, load_checkpoint, read_checkpoint_metadata
from trainer.training.building import build_model, configured_optimizer


@pytest.mark.parametrize("option", config_options("model"))
def test_every_model_builds_trains_one_step(compose_cfg, option):
    cfg = compose_cfg(f"model={option}")
    data: DataSplits = hydra.utils.instantiate(cfg.data)
    model, _ = build_model(cfg, data, total_steps=10)
    assert model.built and model.count_params() > 0
    history = model.fit(data.x_train[:16], data.y_train[:16], epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert model(data.x_val[:2]).shape == (2, data.num_classes)


def test_model_kinds_match_their_names(compose_cfg):
    data = hydra.utils.instantiate(compose_cfg().data)
    kinds = {
        option: type(build_model(compose_cfg(f"model={option}"), data, total_steps=1)[0])
        for option in ("mlp", "cnn", "resnet", "subclassed")
    }
    assert kinds["mlp"] is keras.Sequential
    probe = keras.Input((1,))
    functional = type(keras.Model(probe, keras.layers.Dense(1)(probe)))
    assert kinds["cnn"] is kinds["resnet"] is functional
    assert kinds["subclassed"].__name__ == "SubclassedClassifier"


def test_resnet_holds_layers_within_layers(compose_cfg):
    cfg = compose_cfg("model=resnet")
    model, _ = build_model(cfg, hydra.utils.instantiate(cfg.data), total_steps=1)
    block = model.get_layer("block0")
    inner = {type(layer).__name__ for layer in block._flatten_layers(include_self=False)}
    assert {"Conv2D", "BatchNormalization", "Dense"} <= inner
    assert keras.saving.get_registered_name(type(block)) == "trainer>ResidualBlock"


@pytest.mark.parametrize("option", [o for o in config_options("data") if o != "npz"])
def test_every_data_set_loads(compose_cfg, option):
    data = hydra.utils.instantiate(compose_cfg(f"data={option}").data)
    assert len(data.x_train) > len(data.x_val) > 0
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int32
    assert set(np.unique(data.y_train)) <= set(range(data.num_classes))


def test_digits_is_the_real_data_set(compose_cfg):
    data = hydra.utils.instantiate(compose_cfg("data=digits").data)
    assert len(data.x_train) + len(data.x_val) == 1797
    assert data.input_shape == (8, 8, 1) and data.num_classes == 10


def test_npz_data_trains(compose_cfg, tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "arrays.npz"
    np.savez(path, x=rng.normal(size=(40, 8, 8, 1)), y=rng.integers(0, 3, 40))
    cfg = compose_cfg("data=npz", f"data.path={path}", "model=mlp", "save=weights")
    metrics = train(cfg)
    assert np.isfinite(metrics["val_loss"])


def test_npz_missing_file_is_a_clear_error(compose_cfg, tmp_path):
    cfg = compose_cfg("data=npz", f"data.path={tmp_path / 'nope.npz'}")
    with pytest.raises(hydra.errors.InstantiationException, match=r"data\.path=") as caught:
        hydra.utils.instantiate(cfg.data)
    assert isinstance(caught.value.__cause__, ConfigError)


@pytest.mark.parametrize(
    ("override", "key", "received"),
    [
        ("model._target_=no.such.Thing", "model._target_ names 'no.such.Thing'", "'no.such.Thing'"),
        ("data._target_=no.such.load", "data._target_ names", "data._target_='no.such.load'"),
        ("optimizer._target_=no.such.Opt", "optimizer._target_", "'no.such.Opt'"),
        ("schedule._target_=no.such.Decay", "schedule._target_", "'no.such.Decay'"),
        ("save._target_=no.such.Backend", "save._target_", "'no.such.Backend'"),
        ("+callbacks.x={_target_: no.such.Cb}", "callbacks.x._target_", "'no.such.Cb'"),
        ("model.hidden=[0]", "model could not be built", "'hidden': [0]"),
        ("data.num_examples=0", "data.num_examples", "data.num_examples=0"),
        ("data.num_examples=-5", "data.num_examples", "data.num_examples=-5"),
        ("data.image_size=0", "data.image_size", "data.image_size=0"),  # aborted the process
        ("data.num_classes=0", "data.num_classes", "data.num_classes=0"),
    ],
)
def test_config_nodes_that_cannot_be_built_are_config_errors(
    compose_cfg, tmp_path, override, key, received
):
    """Hydra's "Error locating target ..." and "Error in call to target ...: ValueError(
    'zero-size array ...')" reached the user without the key's fix or 'Received:', and
    train(cfg) raised Hydra's InstantiationException."""
    with pytest.raises(ConfigError) as refused:
        train(compose_cfg("model=mlp", "save=h5", override))
    message = str(refused.value)
    assert key in message and received in message.rsplit("Received: ", 1)[1]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("y", "match"),
    [
        (np.array(["cat", "dog"] * 20), r"integer class labels 0\.\.N-1.*dtype <U3"),
        (np.linspace(0, 2, 40), r"would be truncated.*such as \[0\.05"),  # 1.7 -> class 1
        (np.r_[np.zeros(39), -1], r"class ids from 0 up.*such as \[-1\.0\]"),
        # A negative integer was blamed on float truncation (issue 39, item 7).
        (np.r_[np.zeros(39, "int64"), -2], r"class ids from 0 up.*such as \[-2\].*index 39"),
        (np.r_[np.zeros(39), np.nan], r"NaN or infinite.*Received nan at index \[39\]"),
        (np.eye(3)[np.arange(40) % 3], r"one-hot labels: save their argmax.*\(40, 3\)"),
        (np.zeros(39), r"\(40 examples.*shape \(39,\)"),
    ],
)
def test_npz_labels_that_would_train_wrongly_or_fail_inside_fit_are_refused(
    compose_cfg, tmp_path, y, match
):
    """Float labels were cast with astype(int32): 1.7 became class 1, silently; strings
    ended in a raw "invalid literal for int()"; negative ids failed inside fit."""
    path = tmp_path / "arrays.npz"
    np.savez(path, x=np.zeros((40, 4), "float32"), y=y)
    cfg = compose_cfg("data=npz", f"data.path={path}")
    with pytest.raises(hydra.errors.InstantiationException) as caught:
        hydra.utils.instantiate(cfg.data)
    assert isinstance(caught.value.__cause__, ConfigError)
    assert re.search(match, str(caught.value.__cause__)), caught.value.__cause__


def test_npz_whole_float_labels_and_bad_features(compose_cfg, tmp_path):
    path = tmp_path / "arrays.npz"
    np.savez(path, x=np.zeros((40, 4)), y=(np.arange(40) % 3).astype("float64"))
    data = hydra.utils.instantiate(compose_cfg("data=npz", f"data.path={path}").data)
    assert data.num_classes == 3 and data.y_train.dtype == np.int32
    np.savez(path, x=np.array(["a"] * 40), y=np.arange(40) % 3)
    with pytest.raises(hydra.errors.InstantiationException) as caught:
        hydra.utils.instantiate(compose_cfg("data=npz", f"data.path={path}").data)
    assert "data.x_key='x' must hold one numeric array" in str(caught.value.__cause__)


@pytest.mark.parametrize("option", config_options("optimizer"))
@pytest.mark.parametrize("schedule", config_options("schedule"))
def test_every_optimizer_and_schedule(compose_cfg, option, schedule):
    cfg = compose_cfg(f"optimizer={option}", f"schedule={schedule}")
    optimizer = configured_optimizer(cfg.optimizer, cfg.schedule, total_steps=100)
    assert isinstance(optimizer, keras.optimizers.Optimizer)
    schedule_type = keras.optimizers.schedules.LearningRateSchedule
    assert isinstance(optimizer._learning_rate, schedule_type) == (schedule != "none")


@pytest.mark.parametrize("option", config_options("save"))
def test_every_save_option_instantiates_a_backend(compose_cfg, option):
    backend = hydra.utils.instantiate(compose_cfg(f"save={option}").save)
    assert isinstance(backend, SaveBackend)
    assert backend.name == option


def test_epoch_order_depends_only_on_seed_and_epoch():
    assert np.array_equal(epoch_order(50, 3, 1), epoch_order(50, 3, 1))
    assert not np.array_equal(epoch_order(50, 3, 1), epoch_order(50, 3, 2))
    assert sorted(epoch_order(50, 3, 1)) == list(range(50))


def test_epoch_dataset_skips_consumed_batches():
    x = np.arange(20, dtype="float32")[:, None]
    y = np.arange(20, dtype="int32")
    full = [b[1].numpy() for b in epoch_dataset(x, y, batch_size=4, seed=1, epoch=0)]
    skipped = epoch_dataset(x, y, batch_size=4, seed=1, epoch=0, skip_batches=2)
    rest = [b[1].numpy() for b in skipped]
    assert len(full) == 5 and len(rest) == 3
    assert all(np.array_equal(a, b) for a, b in zip(full[2:], rest, strict=True))


@pytest.mark.parametrize("save", config_options("save"))
def test_train_writes_checkpoints_and_events(compose_cfg, tmp_path, save):
    cfg = compose_cfg(f"save={save}", "model=mlp")
    metrics = train(cfg)
    assert set(metrics) == {"val_loss", "val_accuracy"}
    run = tmp_path / "run"
    checkpoints = list_checkpoints(run / "checkpoints")
    assert [p.name.split(".")[0] for p in checkpoints] == ["step-00000003", "step-00000006"]
    assert (run / "checkpoints" / "latest").resolve() == checkpoints[-1].resolve()
    assert list((run / "tb").glob("events.out.tfevents.*"))
    restored = load_checkpoint(checkpoints[-1])
    assert restored.state.epoch == 2 and restored.state.global_step == 6
    assert restored.metadata["config"]["save"]["_target_"] == cfg.save._target_
    assert OmegaConf.create(restored.metadata["config"]).trainer.epochs == 2


def test_training_is_repeatable(compose_cfg, tmp_path):
    first = train(compose_cfg("model=mlp", "save=weights"))
    # The same config in a new directory (a fresh run over the first one's is refused).
    second = train(compose_cfg("model=mlp", "save=weights", f"run_dir={tmp_path / 'again'}"))
    assert first == second


def test_train_exports_and_links_tensorboard(compose_cfg, tmp_path):
    from trainer.save_backends import read_checkpoint_metadata
    from trainer.tensorboard.board import LINK_KEY
    from trainer.tensorboard.links import resolve_link

    cfg = compose_cfg("model=mlp", "save=h5", "export.enabled=true", "export.format=keras")
    train(cfg)
    run = tmp_path / "run"
    (version,) = (run / "export").iterdir()
    assert version.name == "1" and (version / "saved_model.pb").is_file()
    latest = run / "checkpoints" / "latest"
    metadata = read_checkpoint_metadata(latest)
    assert metadata[LINK_KEY]["step"] == 6
    resolve_link(latest, metadata)  # the event file exists and holds that step's card


def test_training_refuses_nan_features_before_training(compose_cfg, tmp_path):
    """Issue 39, item 2: data=npz whose features hold NaN trained to the end (the first
    kernel NaN, the loss printed as 0.693, no warning) and its checkpoints were saved and
    rotated. Now the run stops before training with a deliberate error naming the array and
    the first bad index (what `python train.py` prints as its one ``error:`` line, exit 2),
    and writes no checkpoint. In-process (it was a `python train.py` process): the entry
    point's mapping of such an error to that line and exit 2 is ``deliberate_message``,
    checked here, and the process boundary is tests/workflows/test_resume.py's."""
    from trainer.training import entry

    x = np.random.default_rng(0).normal(size=(60, 8, 8, 1)).astype("float32")
    x[17, 3, 2, 0] = np.nan
    np.savez(tmp_path / "arrays.npz", x=x, y=np.arange(60) % 3)
    cfg = compose_cfg("data=npz", "model=mlp", f"data.path={tmp_path / 'arrays.npz'}", tiny=False)
    with pytest.raises(Exception) as refused:
        train(cfg)
    message = entry.deliberate_message(refused.value)
    assert message is not None, refused.value  # None: a bug, printed as a traceback
    assert "data.x_key='x' holds 1 NaN or infinite values" in message
    assert "Received nan at index [17, 3, 2, 0]" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_your_own_model_target_says_how_to_replace_the_default_node(compose_cfg):
    """Issue 39, item 5: `model._target_=mymodule.build` kept resnet's `blocks` and `width`
    and failed with "unexpected keyword argument 'blocks'" and no way forward. The error now
    gives the override that works, and that override trains (with a key of its own)."""
    with pytest.raises(ConfigError) as refused:
        train(compose_cfg("model._target_=own_model.build", "save=h5"))
    message = str(refused.value)
    assert "Its keys ['blocks', 'width'] come from the option your _target_ replaced" in message
    assert "'~model' '+model={_target_: own_model.build}'" in message
    metrics = train(
        compose_cfg("~model", "+model={_target_: own_model.build, hidden: 4}", "save=h5")
    )
    assert "val_accuracy" in metrics


@pytest.mark.parametrize("backend", ["h5", "weights"])
def test_a_run_of_your_own_unregistered_layer_resumes(compose_cfg, tmp_path, backend):
    """Issue 39, item 1: with an unregistered layer of the user's own (as a quick script
    writes one), h5 and weights saved, and every resume failed with MissingClassError; the
    message's advice (register the class) could not help, since the checkpoint recorded the
    bare class name. A resume now hands the load the classes of the model the config built,
    and a load without them says the one fix that works."""
    own = ["~model", "+model={_target_: own_model.build_with_own_layer}", f"save={backend}"]
    train(compose_cfg(*own, "trainer.epochs=1"))
    run = tmp_path / "run"
    metrics = train(compose_cfg(*own, "trainer.epochs=2", "resume=latest", f"resume_dir={run}"))
    assert "val_accuracy" in metrics
    assert read_checkpoint_metadata(run / "checkpoints" / "latest")["state"]["epoch"] == 2

    import own_model

    with pytest.raises(MissingClassError) as missing:
        load_checkpoint(run / "checkpoints" / "latest")
    message = str(missing.value)
    assert "custom_objects={'Scale': Scale}" in message and "not registered when" in message
    loaded = load_checkpoint(
        run / "checkpoints" / "latest", custom_objects={"Scale": own_model.Scale}
    )
    assert isinstance(loaded.model.get_layer("scale"), own_model.Scale)
