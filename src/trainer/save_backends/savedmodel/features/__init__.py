"""Per-feature pieces both the save and the load path use: masks, RNN states, weight
constraints, frozen flags, Python gradients, training logic, layers' own state."""
