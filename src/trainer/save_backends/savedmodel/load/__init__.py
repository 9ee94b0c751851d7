"""The load path of a trainer SavedModel: revive each layer from its config or from its
traced functions, reading variables straight from the bundle."""
