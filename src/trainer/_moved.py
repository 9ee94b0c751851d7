"""Module paths that moved in the 0.2 layout, still importable for one release.

Why a finder rather than one stub module per old path: a stub per row of ``_TABLE`` would
put those files back where the layout took them out. Each old path loads as a module holding the new
module's names (the same objects, so classes and functions compare equal) and warns with a
``DeprecationWarning`` naming the new path. A Hydra ``_target_`` or a pickled reference that
names an old path therefore keeps resolving. Remove after 0.2.

Four old modules became packages of the same name (``trainer.training``, ``trainer.cli``,
``trainer.tensorboard``, ``trainer.runs``): the package stands at that path, so they have no
entry; ``trainer.training.train`` and ``trainer.cli.main`` still resolve.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

_TABLE = """
atomic                                     storage.atomic
building                                   training.building
checkpointing.callback                     checkpointing.keras_callback
cli_extra                                  cli.inspect,cli.import_legacy
config                                     training.config
direct_io                                  storage.direct_io
distribute                                 training.distribute
entry                                      training.entry
export                                     exports.exporter
export_sources                             exports.sources
hparams_sessions                           tensorboard.hparams
instantiation                              training.instantiation
integrity                                  storage.integrity
interrupts                                 training.interrupts
limits                                     storage.limits
locks                                      storage.locks
resume                                     training.resume
run_end                                    training.run_end
save_backends.compile_objects              model_state.compile_objects
save_backends.config_state                 model_state.config_check
save_backends.json_tuples                  model_state.json_tuples
save_backends.layerstate                   model_state.layer_protocol
save_backends.legacy.standin               save_backends.legacy.traced_layers
save_backends.legacy.weights               save_backends.legacy.variable_values
save_backends.modelstate                   model_state.kit
save_backends.policies                     model_state.dtype_policy
save_backends.readiness                    model_state.readiness
save_backends.rebuild                      model_state.rebuild
save_backends.savedmodel.call_matching     save_backends.savedmodel.features.call_matching
save_backends.savedmodel.composites        save_backends.savedmodel.save.composites
save_backends.savedmodel.config_rebuilt    save_backends.savedmodel.save.config_rebuilt
save_backends.savedmodel.constraints       save_backends.savedmodel.features.constraints
save_backends.savedmodel.endpoints         save_backends.savedmodel.save.endpoints
save_backends.savedmodel.frozen_flags      save_backends.savedmodel.features.frozen_flags
save_backends.savedmodel.graph_revival     save_backends.savedmodel.load.graph_revival
save_backends.savedmodel.input_signature   save_backends.savedmodel.save.input_signature
save_backends.savedmodel.layer_state       save_backends.savedmodel.features.layer_state
save_backends.savedmodel.masks             save_backends.savedmodel.features.masks
save_backends.savedmodel.object_graph      save_backends.savedmodel.save.object_graph
save_backends.savedmodel.partial_load      save_backends.savedmodel.load.partial_load
save_backends.savedmodel.python_gradients  save_backends.savedmodel.features.python_gradients
save_backends.savedmodel.revival           save_backends.savedmodel.load.revival
save_backends.savedmodel.rnn_states        save_backends.savedmodel.features.rnn_states
save_backends.savedmodel.saver_def         save_backends.savedmodel.bundle.saver_def
save_backends.savedmodel.standins          save_backends.savedmodel.features.standins
save_backends.savedmodel.state_variables   save_backends.savedmodel.save.state_variables
save_backends.savedmodel.stored_variables  save_backends.savedmodel.load.stored_variables
save_backends.savedmodel.structure         save_backends.savedmodel.save.structure
save_backends.savedmodel.tensor_bundle     save_backends.savedmodel.bundle.tensor_bundle
save_backends.savedmodel.trace_cache       save_backends.savedmodel.save.trace_cache
save_backends.savedmodel.tracing           save_backends.savedmodel.save.tracing
save_backends.savedmodel.training_logic    save_backends.savedmodel.features.training_logic
save_backends.savedmodel.variables_first   save_backends.savedmodel.save.variables_first
save_backends.savedmodel.variables_writer  save_backends.savedmodel.bundle.variables_writer
save_backends.targets                      storage.targets
save_backends.trainable                    model_state.trainable
save_backends.vocabularies                 model_state.vocabularies
serializables                              model_state.serializables
serving                                    model_state.serving
sessions                                   runs.sessions
summary_writes                             tensorboard.summary_writes
sweeps                                     training.sweeps
testing.models                             testing.suite_models
user_callbacks                             training.user_callbacks,callbacks
verify                                     cli.verify
warmup                                     exports.warmup
"""
# old path -> new path; "a,b": the old module's names now live in two modules
MOVED = {
    f"trainer.{old}": ",".join(f"trainer.{n}" for n in new.split(","))
    for old, new in map(str.split, _TABLE.strip().splitlines())
}


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        return None  # the default: an empty module named by the old path

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} moved to {self.new}; import it from there "
            f"(the old path goes away after trainer 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        targets = [importlib.import_module(name) for name in self.new.split(",")]
        for target in reversed(targets):
            names = {k: v for k, v in vars(target).items() if not k.startswith("__")}
            module.__dict__.update(names)
        module.__getattr__ = lambda name: getattr(targets[0], name)  # names defined later


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths in ``MOVED``; every other name is left to the next finder."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new))


def install() -> None:
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
